"""torchrun as kdexp's runs expect it: the same launcher with the workers' status passed on.

    python -m kdexp.launchers torchrun --nproc-per-node 2 -m kdexp.run parallel.tensor=2

takes torchrun's own arguments unchanged (``torch.distributed.run``). What differs is the end of a failed launch:
torchrun exits 1 for any failed worker, after its ``ChildFailedError`` summary and its own Python traceback. Here:

- a user error (every failed rank exited 2, kdexp's status for a value the checks reject) ends as a single process
  does: the workers' one ``kdexp: error: ...`` line (global rank 0 prints it) and exit status 2, no launcher report;
- any other failure prints torchrun's failure summary (each rank's exit code and the root cause, with the line kdexp
  wrote into the rank's error file) without the launcher's traceback, and exits with the root cause's status
  (128 + N for a worker killed by signal N, so 143 for a SIGTERM-stopped run as under srun);
- a signal to the launcher itself (SIGTERM from a scheduler) is forwarded to the workers by torchrun, which save their
  checkpoint; it then prints one line and exits 128 + N.
"""
from __future__ import annotations

import logging
import sys

USER_ERROR = 2  # kdexp.run's status for a refused value (docs/running.md)
# A rank still checking when another refused the config is stopped by torchrun with SIGTERM: killed by it (-15) or
# ending as kdexp ends a run SIGTERM stopped (143).
_STOPPED = (USER_ERROR, -15, 128 + 15)

# torchrun's agent logs each failed worker, each worker it stops and that the launcher itself has no error file to
# copy into; the summary this launcher prints (or the workers' own line, for a user error) says the same once.
_AGENT_LOGGERS = ("torch.distributed.elastic.multiprocessing.api",
                  "torch.distributed.elastic.multiprocessing.errors.error_handler")


class _AgentNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not msg.startswith(("failed (exitcode: ", "no error file defined for parent", "Sending process "))


def _line(message: str | dict) -> str:
    # a rank's error file as torch reads it: kdexp writes {"message": {"message": line, "extraInfo": ...}}
    return message.get("message", str(message)) if isinstance(message, dict) else message


def _status(exitcode: int) -> int:
    return exitcode if exitcode > 0 else 128 - exitcode if exitcode < 0 else 1


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(argv)
    for name in _AGENT_LOGGERS:
        logging.getLogger(name).addFilter(_AgentNoise())
    try:
        run(args)
    except ChildFailedError as e:
        rank, root = e.get_first_failure()
        if root.exitcode == USER_ERROR and all(f.exitcode in _STOPPED for f in e.failures.values()):
            if e.failures.get(0) is None or e.failures[0].exitcode != USER_ERROR:
                print(_line(root.message), file=sys.stderr)  # rank 0 speaks; stopped before it did, it is said here
            return USER_ERROR
        print(e.format_msg(), file=sys.stderr)
        return _status(root.exitcode)
    except SignalException as e:
        sig = e.sigval
        print(f"kdexp: torchrun stopped by {sig.name}; its workers were sent {sig.name}", file=sys.stderr)
        return 128 + int(sig)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
