"""What torch.save raises on a full disk, for the fault tests: its RuntimeError (the zip writer's enforce message),
the OSError (ENOSPC) as its context, which kdexp.track.faults finds and names."""
import errno
import os


def raise_full_disk(*_args, **_kwargs):
    try:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    except OSError:
        raise RuntimeError("[enforce fail at inline_container.cc:672] unexpected pos 10560 vs 10454")
