"""Test runs only (on PYTHONPATH in the environment of the launches that tests/_zygote.py's server runs, and of the
docs' pages that tests/test_readme.py runs in a shell): a process that such a launch starts to run Python code of
kdexp's hands itself over to the test process's fork server and stands in for its child (tests/_zygote.py:
hand_over), instead of importing torch, megatron-core, Hydra and W&B again: a worker that submitit starts for a sweep
point (``python -u -m submitit.core._submit FOLDER``: the local executor's process, or each task that srun starts in a
SLURM job, which inherits the submitting driver's environment as sbatch exports it), a rank that torchrun starts
(``python -u ...`` with TORCHELASTIC_RUN_ID set), and, where KDEXP_TEST_HAND_OVER=kdexp (a docs page's shell), a
command line's ``python -m kdexp...``. The stand-in stays the process its launcher started and waits for, signals
and reads the exit of (torchrun's agent, slurmstepd): SLURM's signals (USR2 before a time limit) reach the child
through it. Any other interpreter starts as usual."""
import os
import sys

_worker = (os.environ.get("SUBMITIT_EXECUTOR") in ("local", "slurm")
           and sys.orig_argv[1:4] == ["-u", "-m", "submitit.core._submit"])
_rank = bool(os.environ.get("TORCHELASTIC_RUN_ID")) and sys.orig_argv[1:2] == ["-u"]
_command = (os.environ.get("KDEXP_TEST_HAND_OVER") == "kdexp" and sys.orig_argv[1:2] == ["-m"]
            and sys.orig_argv[2:3] and sys.orig_argv[2].split(".")[0] == "kdexp")
if os.environ.get("KDEXP_TEST_FORK_SERVER") and (_worker or _rank or _command):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from _zygote import hand_over

    hand_over(os.environ["KDEXP_TEST_FORK_SERVER"], sys.orig_argv[1:])  # returns only if the server is gone
    del sys.path[0], sys.modules["_zygote"]
