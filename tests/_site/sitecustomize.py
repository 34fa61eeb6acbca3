"""Test runs only (on PYTHONPATH in the environment of the launches that tests/_zygote.py's server runs): a process
that such a launch starts to run Python code of kdexp's hands itself over to the test process's fork server and
stands in for its child (tests/_zygote.py: hand_over), instead of importing torch, megatron-core, Hydra and W&B
again: a worker that submitit's local executor starts for a sweep point (``python -u -m submitit.core._submit
FOLDER``) and a rank that torchrun starts (``python -u ...`` with TORCHELASTIC_RUN_ID set). Any other interpreter, a
SLURM job's included, starts as usual."""
import os
import sys

_local_worker = (os.environ.get("SUBMITIT_EXECUTOR") == "local"
                 and sys.orig_argv[1:4] == ["-u", "-m", "submitit.core._submit"])
_rank = bool(os.environ.get("TORCHELASTIC_RUN_ID")) and sys.orig_argv[1:2] == ["-u"]
if os.environ.get("KDEXP_TEST_FORK_SERVER") and (_local_worker or _rank):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from _zygote import hand_over

    hand_over(os.environ["KDEXP_TEST_FORK_SERVER"], sys.orig_argv[1:])  # returns only if the server is gone
    del sys.path[0], sys.modules["_zygote"]
