"""Test runs only (on PYTHONPATH in the environment of the launches that tests/_zygote.py's server runs, and of the
docs' pages that tests/test_readme.py runs in a shell): a process that such a launch starts to run Python code of
kdexp's hands itself over to the test process's fork server and stands in for its child (tests/_zygote.py:
hand_over), instead of importing torch, megatron-core, Hydra and W&B again: a worker that submitit's local executor
starts for a sweep point (``python -u -m submitit.core._submit FOLDER``), a rank that torchrun starts (``python -u
...`` with TORCHELASTIC_RUN_ID set), and, where KDEXP_TEST_HAND_OVER=kdexp (a docs page's shell), a command line's
``python -m kdexp...``. Any other interpreter, a SLURM job's included, starts as usual."""
import os
import sys

_local_worker = (os.environ.get("SUBMITIT_EXECUTOR") == "local"
                 and sys.orig_argv[1:4] == ["-u", "-m", "submitit.core._submit"])
_rank = bool(os.environ.get("TORCHELASTIC_RUN_ID")) and sys.orig_argv[1:2] == ["-u"]
_command = (os.environ.get("KDEXP_TEST_HAND_OVER") == "kdexp" and sys.orig_argv[1:2] == ["-m"]
            and sys.orig_argv[2:3] and sys.orig_argv[2].split(".")[0] == "kdexp")
if os.environ.get("KDEXP_TEST_FORK_SERVER") and (_local_worker or _rank or _command):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from _zygote import hand_over

    hand_over(os.environ["KDEXP_TEST_FORK_SERVER"], sys.orig_argv[1:])  # returns only if the server is gone
    del sys.path[0], sys.modules["_zygote"]
