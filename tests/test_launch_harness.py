"""The tests' fork server (tests/_zygote.py) launches a program as a new interpreter would: the same exit status,
standard output and files for each program here, run both ways (a new ``python`` and a child of the server)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from _zygote import Zygote

PROGRAMS = {
    "argv, cwd and environment": "import os, sys; print(sys.argv, os.getcwd(), os.environ['X'], 'Y' in os.environ)",
    "exit code": "raise SystemExit(3)",
    "exit message": "raise SystemExit('refused: a message')",
    "uncaught exception": "print('before', flush=True); 1 / 0",
    "unhandled KeyboardInterrupt dies by SIGINT": "raise KeyboardInterrupt",
    "SIGKILL": "import os; print('x', flush=True); os.kill(os.getpid(), 9)",
    "atexit and non-daemon threads": textwrap.dedent("""
        import atexit, threading, time
        atexit.register(lambda: print('atexit after the thread'))
        threading.Thread(target=lambda: (time.sleep(0.5), print('thread'))).start()
        """),
    "files left open are flushed, garbage cycles finalized": textwrap.dedent("""
        log = open('open.txt', 'w')
        log.write('x' * 100)
        def f(): pass
        class Cycle:
            def __init__(self): self.me = self
            def __del__(self): print('finalized')
        Cycle()
        """),
    "stdout buffered unless PYTHONUNBUFFERED, stderr in order": textwrap.dedent("""
        import os, sys
        print('out', sys.stdout.write_through, sys.stdout.line_buffering, sys.stderr.line_buffering)
        print('err', file=sys.stderr)
        """),
    "torch's threads follow OMP_NUM_THREADS": "import torch; print(torch.get_num_threads())",
    "a module run with -m": None,
    "a script file": None,
}


@pytest.mark.parametrize("name", PROGRAMS)
@pytest.mark.parametrize("omp", ["1", "2"])
def test_a_program_runs_the_same_forked_as_fresh(name, omp, tmp_path):
    env = {"PATH": "/usr/bin:/bin", "X": "x value", "OMP_NUM_THREADS": omp, "PYTHONUNBUFFERED": "1" if omp == "1" else ""}
    if name == "a module run with -m":
        (tmp_path / "some_mod.py").write_text("import sys\nprint(__name__, sys.argv, sys.path[0], __spec__.name)\n")
        cmd = [sys.executable, "-m", "some_mod", "a", "b=c"]
    elif name == "a script file":
        (tmp_path / "script.py").write_text("import sys\nprint(__name__, __file__, sys.argv, sys.path[0])\n")
        cmd = [sys.executable, str(tmp_path / "script.py"), "--flag"]
    else:
        cmd = [sys.executable, "-c", PROGRAMS[name], "arg 1", "x=2"]
    assert Zygote.accepts(cmd)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    fresh = subprocess.run(cmd, env=env, cwd=tmp_path / "a", capture_output=True, text=True, timeout=300)
    files_fresh = {p.name: p.read_text() for p in (tmp_path / "a").iterdir()}
    forked = Zygote.run(cmd, env, tmp_path / "b", timeout=300)
    files_forked = {p.name: p.read_text() for p in (tmp_path / "b").iterdir()}
    assert forked.returncode == fresh.returncode, (fresh, forked)
    assert forked.stdout.replace("/b", "/a") == fresh.stdout, (fresh.stdout, forked.stdout)
    assert files_forked == files_fresh
    # stderr: the same last line (a traceback's frames above the program's differ: the server's own)
    assert forked.stderr.strip().splitlines()[-1:] == fresh.stderr.strip().splitlines()[-1:], (fresh, forked)


def test_random_streams_differ_between_children(tmp_path):
    code = "import random, numpy; print(random.random(), numpy.random.random())"
    outs = {Zygote.run([sys.executable, "-c", code], {"PATH": "/usr/bin"}, tmp_path, timeout=300).stdout
            for _ in range(3)}
    assert len(outs) == 3


def test_a_launch_past_its_timeout_is_killed_and_raises_as_subprocess_run_does(tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        Zygote.run([sys.executable, "-c", "import time; print('started', flush=True); time.sleep(600)"],
                   {"PATH": "/usr/bin"}, tmp_path, timeout=3)
