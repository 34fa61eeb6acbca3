"""The tests' fork server (tests/_zygote.py) launches a program as a new interpreter would: the same exit status,
standard output and files for each program here, run both ways (a new ``python`` and a child of the server); a sweep
worker handed over to it (a stand-in) passes signals on, ends as its child ends, and takes it along when killed."""
from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from _zygote import FORK_SERVER, Zygote, alive

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


@pytest.mark.parametrize("code", ["import time; print('started', flush=True); time.sleep(600)",
                                  "import os, time; os.close(1); os.close(2); time.sleep(600)"],
                         ids=["streams open", "streams closed"])
def test_a_launch_past_its_timeout_is_killed_and_raises_as_subprocess_run_does(code, tmp_path):
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as raised:
        Zygote.run([sys.executable, "-c", code], {"PATH": "/usr/bin"}, tmp_path, timeout=3)
    assert time.monotonic() - start < 60
    if "started" in code:  # where it hung, on its stderr before it was killed
        assert raised.value.stdout == "started\n" and "time.sleep(600)" not in raised.value.stderr
        assert 'File "<string>", line 1 in <module>' in raised.value.stderr


def test_a_launch_past_its_timeout_whose_descendant_holds_its_streams_still_returns(tmp_path):
    code = ("import subprocess, sys, time\n"
            "print(subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']).pid, flush=True)\n"
            "time.sleep(600)\n")
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as raised:
        Zygote.run([sys.executable, "-c", code], {"PATH": "/usr/bin"}, tmp_path, timeout=5)
    assert time.monotonic() - start < 90
    os.kill(int(raised.value.stdout.split()[0]), signal.SIGKILL)  # the orphan, which subprocess.run leaves too


class _Interrupted(Exception):
    pass


def test_a_caller_interrupted_while_it_waits_takes_its_launch_along(tmp_path):
    """An exception in the caller while its launch runs (an interrupt, pytest-timeout's) kills the launch, as
    subprocess.run does; it is raised in the waiting thread as an interrupt arrives there (between two polls)."""
    import ctypes
    import threading

    pid_file = tmp_path / "pid"
    code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(600)"
    main = threading.get_ident()

    def interrupt():
        while not pid_file.exists() or not pid_file.read_text():
            time.sleep(0.05)
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(main), ctypes.py_object(_Interrupted))
    threading.Thread(target=interrupt, daemon=True).start()
    with pytest.raises(_Interrupted):
        Zygote.run([sys.executable, "-c", code], {"PATH": "/usr/bin"}, tmp_path, timeout=300)
    child = int(pid_file.read_text())
    assert _gone_within(child, 60), f"the launch {child} of an interrupted caller still runs"


def _gone_within(pid: int, seconds: float) -> bool:
    """Whether process `pid` has ended (and been reaped) within `seconds`."""
    deadline = time.monotonic() + seconds
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_a_caller_that_dies_mid_request_leaves_the_server_serving(tmp_path):
    path = Zygote.child_env({})[FORK_SERVER]
    for partial in (b"", b"\x00\x00", struct.pack("!Q", 100) + b'{"argv": '):
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(path)
        conn.sendall(partial)
        conn.close()
    done = Zygote.run([sys.executable, "-c", "print('served')"], {"PATH": "/usr/bin"}, tmp_path, timeout=120)
    assert (done.returncode, done.stdout) == (0, "served\n")


# --- a stand-in: a sweep worker that submitit's local executor started, handed over to the server ------------------
def _stand_in(tmp_path, code: str, path=None) -> subprocess.Popen:
    """A new interpreter that hands `code` over to this process's server (as tests/_site/sitecustomize.py does for a
    sweep worker) and stands in for it."""
    path = path or Zygote.child_env({})[FORK_SERVER]
    boot = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); from _zygote import hand_over; "
            f"hand_over({str(path)!r}, ['-u', '-c', {code!r}]); print('not handed over', flush=True)")
    return subprocess.Popen([sys.executable, "-c", boot], cwd=tmp_path, stdout=subprocess.PIPE, text=True)


def test_a_stand_in_passes_signals_on_and_ends_as_its_child(tmp_path):
    proc = _stand_in(tmp_path, "import os, signal, time\n"
                               "signal.signal(signal.SIGUSR2, lambda *a: print('USR2', flush=True))\n"
                               "print('ready', os.getpid(), flush=True)\n"
                               "while True: time.sleep(0.1)\n")
    ready = proc.stdout.readline().split()
    assert ready[0] == "ready" and int(ready[1]) != proc.pid  # the child runs it, not the stand-in
    proc.send_signal(signal.SIGUSR2)  # preemption's signal: the child's handler
    assert proc.stdout.readline().strip() == "USR2"
    proc.send_signal(signal.SIGTERM)  # the child dies of it: so does its stand-in
    assert proc.wait(timeout=60) == -signal.SIGTERM


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM])
def test_a_stand_in_whose_child_dies_of_a_signal_dies_of_it_too_and_never_runs_the_launch_again(tmp_path, signum):
    """A child that kills itself (tests/_fault_run.py's SIGKILL after a step): its stand-in is killed by the same
    signal, as a fresh process would be. (For SIGKILL it raised instead, which Python reports out of sitecustomize
    and then runs the launch a second time in the stand-in: see the torchrun test below.)"""
    marks = tmp_path / "ran"
    proc = _stand_in(tmp_path, f"import os\nopen({str(marks)!r}, 'a').write('ran\\n')\n"
                               f"os.kill(os.getpid(), {int(signum)})\n")
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == -signum and "not handed over" not in out, (proc.returncode, out)
    assert marks.read_text() == "ran\n"  # once: the child's run only


def test_a_stand_in_killed_outright_takes_its_child_along(tmp_path):
    proc = _stand_in(tmp_path, "import os, time\nprint(os.getpid(), flush=True)\ntime.sleep(600)\n")
    child = int(proc.stdout.readline())
    proc.kill()
    proc.wait(timeout=60)
    assert _gone_within(child, 60), f"the child {child} of a SIGKILLed stand-in still runs"


def test_without_a_server_the_process_starts_as_usual(tmp_path):
    proc = _stand_in(tmp_path, "print('handed over')", path=tmp_path / "no-socket")
    assert proc.communicate(timeout=120)[0] == "not handed over\n" and proc.returncode == 0


def test_a_stand_in_whose_server_goes_away_waits_for_its_child_and_never_runs_the_launch_twice(tmp_path):
    import _zygote

    sock = tmp_path / "own.sock"  # a server of this test's own, to kill
    server = subprocess.Popen([sys.executable, _zygote.__file__, str(sock)], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        marks = tmp_path / "ran"
        proc = _stand_in(tmp_path, f"import time\nprint('started', flush=True)\ntime.sleep(3)\n"
                                   f"open({str(marks)!r}, 'a').write('ran\\n')\n", path=sock)
        assert proc.stdout.readline() == "started\n"
        server.kill()
        server.wait()
        out = proc.communicate(timeout=120)[0]
    finally:
        server.kill()
    assert proc.returncode == 1 and "not handed over" not in out, out
    assert marks.read_text() == "ran\n"  # the child ran it, once: the stand-in did not run it again


@pytest.mark.parametrize("executor", ["local", "slurm", "other"])
def test_only_a_sweep_worker_hands_itself_over(executor, tmp_path):
    """tests/_site/sitecustomize.py: ``python -u -m submitit.core._submit`` under submitit's local or SLURM executor
    (a local worker, a SLURM task) hands over (and fails as a fresh one does on a folder without a job); under
    another executor, or any other command, it does not."""
    env = {**Zygote.child_env({"PATH": "/usr/bin:/bin"}), "SUBMITIT_EXECUTOR": executor,
           "KDEXP_TEST_FORK_SERVER_VERBOSE": "1"}
    cmd = [sys.executable, "-u", "-m", "submitit.core._submit", str(tmp_path / "no-job")]
    worker = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    fresh = subprocess.run(cmd, env={**env, FORK_SERVER: ""}, cwd=tmp_path, capture_output=True, text=True,
                           timeout=300)
    assert ("handed over" in worker.stderr) == (executor != "other"), worker.stderr
    assert worker.returncode == fresh.returncode != 0
    other = subprocess.run([sys.executable, "-u", "-c", "print('ran here')"], env=env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=300)
    assert other.stdout == "ran here\n" and "handed over" not in other.stderr


def test_a_docs_shell_hands_over_its_kdexp_commands_only(tmp_path):
    """KDEXP_TEST_HAND_OVER=kdexp (tests/test_readme.py's shell): a line's ``python -m kdexp...`` hands over and prints
    and returns what a fresh one does; ``python -c`` and other modules start as usual."""
    env = {**Zygote.child_env({"PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).parents[1])}),
           "KDEXP_TEST_HAND_OVER": "kdexp", "KDEXP_TEST_FORK_SERVER_VERBOSE": "1"}
    line = ["bash", "-c", f"{sys.executable} -m kdexp.bench.gpu --help; echo exit $?"]
    forked = subprocess.run(line, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    fresh = subprocess.run(line, env={**env, "KDEXP_TEST_HAND_OVER": ""}, cwd=tmp_path, capture_output=True,
                           text=True, timeout=300)
    assert "handed over" in forked.stderr and "handed over" not in fresh.stderr, forked.stderr
    assert forked.stdout == fresh.stdout and forked.stdout.endswith("exit 0\n"), (forked.stdout, fresh.stdout)
    for other in (["-c", "print('ran here')"], ["-m", "json.tool", "--help"]):
        proc = subprocess.run([sys.executable, *other], env=env, cwd=tmp_path, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0 and "handed over" not in proc.stderr, proc.stderr


def test_torchrun_ranks_hand_themselves_over_and_run_as_fresh_ones(tmp_path):
    """A torchrun launch run by the server: its ranks (``python -u SCRIPT`` with TORCHELASTIC_RUN_ID) hand over, join
    their gloo group and print what fresh ranks print; a rank's failure fails torchrun alike, and so do ranks that
    SIGKILL themselves, each having run once."""
    script = tmp_path / "ranks.py"
    script.write_text(textwrap.dedent("""
        import os, sys, torch, torch.distributed as dist
        dist.init_process_group("gloo")
        x = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(x)
        # one write per line (print writes its end separately): the two ranks share one pipe
        sys.stdout.write(f"rank {dist.get_rank()} of {dist.get_world_size()}: {x.item()}\\n")
        sys.stdout.flush()
        if sys.argv[1:] == ["kill"]:  # as tests/_fault_run.py ends a rank after a step
            os.kill(os.getpid(), 9)
        dist.destroy_process_group()
        sys.exit(3 if sys.argv[1:] == ["fail"] and os.environ["RANK"] == "1" else 0)
        """))
    from kdexp.distributed.testing import free_port

    for args in ([], ["fail"], ["kill"]):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), str(script), *args]
        env = {**os.environ, "KDEXP_TEST_FORK_SERVER_VERBOSE": "1"}
        fresh = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        cmd[cmd.index("--master-port") + 1] = str(free_port())
        forked = Zygote.run(cmd, env, tmp_path, timeout=300)
        assert forked.stderr.count("handed over") == 2 and "handed over" not in fresh.stderr, forked.stderr
        assert forked.returncode == fresh.returncode == (1 if args else 0), (fresh.stderr[-2000:], forked.stderr[-2000:])
        assert sorted(forked.stdout.splitlines()) == sorted(fresh.stdout.splitlines()) == [
            "rank 0 of 2: 3.0", "rank 1 of 2: 3.0"], (fresh.stdout, forked.stdout)
