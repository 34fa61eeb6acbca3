"""A fork server for the tests' launches of ``python -m kdexp.run`` (and of the test entry points beside it).

Every launch of a fresh interpreter pays for importing torch, megatron-core, Hydra and W&B before kdexp does any work:
about 8 s of a 10 s one-step smoke run on this 2-core machine, and the suite launches hundreds. The server imports
those third-party modules once (the list a real run imports: PRELOAD), then forks one child per launch; the child
becomes the launch as ``python ARGV`` would: its argv, environment, working directory, standard streams (the
caller's file descriptors, passed over the socket), a fresh ``__main__``, kdexp imported afresh (never preloaded, so
each launch reads its environment and source as a new process does), and it exits the way the interpreter exits
(SystemExit's code, 1 and a traceback for an exception, death by SIGINT for an unhandled KeyboardInterrupt, atexit
handlers and non-daemon threads joined). The server reaps it and sends its exit status (subprocess's convention: -N
for death by signal N) back to the caller, who holds the child's real pid (signals, locks and ``/proc`` see it).

What differs from a fresh interpreter, and why it is harmless for what the tests launch: the child's parent is the
server, not the test; the preloaded modules were imported under the server's environment (OMP_NUM_THREADS is applied
again in the child through torch.set_num_threads; numpy's and Python's random streams are reseeded); import-time
warnings of the preloaded modules are not shown again (kdexp filters megatron's anyway; tests/test_quiet.py checks
the filters in-process and tests/test_bench_help.py launches fresh interpreters). The processes such a launch starts in
turn, a local sweep's workers and torchrun's ranks, hand themselves over to the server (hand_over, called from
tests/_site/sitecustomize.py) and stand in for their child, as does each ``python -m kdexp...`` of a docs page that
tests/test_readme.py runs in a shell; SLURM jobs and the launches a test holds while they run stay real processes.

    python tests/_zygote.py SOCKET      # the server: one per pytest worker, started by Zygote below

Protocol on the unix socket, one connection per launch: the caller sends an 8-byte length with its stdin, stdout and
stderr descriptors attached (SCM_RIGHTS; a stand-in adds the read end of a pipe it holds open while it lives), then
that many bytes of JSON {argv, env, cwd[, unbuffered]}; the server answers the child's pid on a line, and later its
exit status on a line.
"""
from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

# What a smoke run imports besides kdexp and the standard library's cheap modules: imported by the server once.
# torch._dynamo (with sympy) is what torch's optimizers import on their first construction; matplotlib's Agg
# figure is what a sweep point's live report draws with (`python -X importtime` of a one-point sweep: 0.6 s and
# 0.3 s a child would otherwise import again).
PRELOAD = ("torch", "numpy", "megatron.core", "megatron.core.models.gpt", "megatron.core.inference.contexts",
           "megatron.core.optimizer", "megatron.core.distributed", "megatron.core.dist_checkpointing",
           "megatron.core.datasets.gpt_dataset", "hydra", "hydra.main", "hydra._internal.utils", "omegaconf", "wandb",
           "submitit", "pandas", "tensorboard", "torch.utils.tensorboard", "tensorboardX", "tokenizers", "yaml",
           "torch._dynamo", "sympy", "matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg")


def _preload() -> None:
    import importlib
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in PRELOAD:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - a module this machine lacks is imported by the child if it needs it
                pass
    # Hydra discovers its plugins by walking hydra_plugins on sys.path: done in the child (kdexp's own plugin).
    import gc

    gc.collect()
    gc.freeze()  # the preloaded objects leave the collector's generations: a child's collections skip them


def _pythonpath(env) -> list[str]:
    """The entries of env's PYTHONPATH as a new interpreter puts them on sys.path (absolute)."""
    return [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]


def _send_request(path: str, request: dict, fds: list[int]) -> socket.socket:
    """Connect to the server at ``path`` and send one launch (the protocol above); the connection, for its answers."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    body = json.dumps(request).encode()
    socket.send_fds(conn, [struct.pack("!Q", len(body))], fds)
    conn.sendall(body)
    return conn


def _recv_line(conn: socket.socket) -> str:
    """One answer line, read byte by byte: nothing is buffered past it, and a timeout leaves the socket usable."""
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = conn.recv(1)
        if not chunk:
            raise EOFError("the server closed the connection")
        buf += chunk
    return buf.decode()


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise EOFError("caller closed the connection")
        buf += chunk
    return buf


def _child(request: dict, fds: list[int]) -> None:
    """Become the launch. Never returns: the interpreter's exit ends the child (SystemExit raised through serve)."""
    import faulthandler
    import random
    import runpy
    import types

    for target, fd in enumerate(fds[:3]):
        os.dup2(fd, target)
        os.close(fd)
    # a launch past its timeout writes every thread's stack to its stderr before it is killed (Zygote.run)
    faulthandler.register(STACKS_SIGNAL, file=2, all_threads=True)
    if len(fds) > 3:  # a stand-in process (hand_over) holds the other end: when it dies, so does its launch
        threading.Thread(target=_die_with_stand_in, args=(fds[3],), daemon=True).start()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # sys.path as a new interpreter builds it: the launch's PYTHONPATH entries (made absolute), then the rest
    sys.path[1:] = _pythonpath(request["env"]) + _BASE_PATH
    random.seed()
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        threads = os.environ.get("OMP_NUM_THREADS")
        torch.set_num_threads(int(threads) if threads and threads.isdigit() else len(os.sched_getaffinity(0)))
    _standard_streams(bool(os.environ.get("PYTHONUNBUFFERED")) or request.get("unbuffered", False))
    argv = request["argv"]
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    if argv[0] == "-m":
        sys.argv = ["-m", *argv[2:]]
        sys.path[0] = os.getcwd()
        runpy._run_module_as_main(argv[1], alter_argv=True)  # what `python -m` runs
    elif argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path[0] = ""
        exec(compile(argv[1], "<string>", "exec"), main.__dict__)
    else:
        sys.argv = list(argv)
        sys.path[0] = str(Path(argv[0]).resolve().parent)
        main.__dict__["__file__"] = argv[0]
        code = compile(Path(argv[0]).read_text(), argv[0], "exec")
        exec(code, main.__dict__)
    sys.exit(0)


def _die_with_stand_in(fd: int) -> None:
    while os.read(fd, 1):
        pass
    os.kill(os.getpid(), signal.SIGKILL)


def _standard_streams(unbuffered: bool) -> None:
    """sys.stdin/stdout/stderr over descriptors 0-2 as a new interpreter makes them: stdout buffered unless
    PYTHONUNBUFFERED (then written through, stderr too), stderr else line-buffered, escaping what it cannot encode."""
    import io

    def text(fd: int, errors: str, line: bool) -> io.TextIOWrapper:
        raw = io.FileIO(fd, "w", closefd=False)
        return io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw), encoding="utf-8", errors=errors,
                                line_buffering=line, write_through=unbuffered)

    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding="utf-8")
    sys.stdout = text(1, "strict", os.isatty(1))
    sys.stderr = text(2, "backslashreplace", not unbuffered)
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr


# the server's sys.path after its first entry, without its own PYTHONPATH's entries (a child puts its launch's there)
_BASE_PATH: list[str] = []


def serve(path: str) -> None:
    own = set(_pythonpath(os.environ))
    _BASE_PATH[:] = [p for p in sys.path[1:] if p not in own]
    _preload()
    if threading.active_count() != 1:  # a fork keeps only the forking thread: a lock another thread held stays held
        raise SystemExit(f"zygote: {threading.enumerate()} after the imports; forking them is unsafe")
    # (numpy's OpenBLAS may start a native pool at import; it restarts it in a forked child itself: pthread_atfork.)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    print("ready", flush=True)
    parent = os.getppid()
    waiting: dict[int, socket.socket] = {}
    while os.getppid() == parent:  # until the test process ends (Zygote.stop) or dies
        ready, _, _ = select.select([server], [], [], 0.02)
        if ready:
            conn, _ = server.accept()
            conn.settimeout(60)  # a caller that connects and never sends must not stop the server
            fds: list[int] = []
            try:
                (size,), fds = _recv_header(conn)
                request = json.loads(_recv_exact(conn, size))
            except (OSError, EOFError, ValueError, struct.error) as e:  # the caller died mid-request: nobody to run
                print(f"zygote: a request was dropped: {e!r}", file=sys.stderr, flush=True)
                for fd in fds:
                    os.close(fd)
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                server.close()
                conn.close()
                for other in waiting.values():
                    other.close()
                _child(request, fds)
            for fd in fds:
                os.close(fd)
            try:
                conn.sendall(f"{pid}\n".encode())
            except OSError:
                pass
            waiting[pid] = conn
        while waiting:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is None:  # not a launch of ours (nothing else forks here): nobody waits for it
                continue
            try:
                conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:  # the caller is gone (a stand-in killed outright): nobody to tell
                pass
            conn.close()


def _recv_header(conn: socket.socket):
    data, fds, _, _ = socket.recv_fds(conn, 8, 4)
    data += _recv_exact(conn, 8 - len(data))
    return struct.unpack("!Q", data), fds


class Zygote:
    """The caller's side: one server per process (started on first use), ``run`` as subprocess.run."""

    _lock = threading.Lock()
    _server: Optional[subprocess.Popen] = None
    _path: Optional[str] = None

    @classmethod
    def _ensure(cls) -> str:
        with cls._lock:
            if cls._server is None or cls._server.poll() is not None:
                import tempfile

                d = tempfile.mkdtemp(prefix="kdexp-zygote-")
                cls._path = os.path.join(d, "sock")
                cls._server = subprocess.Popen([sys.executable, __file__, cls._path], stdin=subprocess.DEVNULL,
                                               stdout=subprocess.PIPE, text=True)
                line = cls._server.stdout.readline()
                if line.strip() != "ready":
                    raise RuntimeError(f"the zygote did not start: {line!r}")
                atexit.register(cls.stop)
            return cls._path

    @classmethod
    def stop(cls) -> None:
        """End the server (its children have been reaped: every run() waited for its own) and remove its socket."""
        if cls._server is not None:
            cls._server.kill()
            cls._server.wait()
            shutil.rmtree(os.path.dirname(cls._path), ignore_errors=True)
            cls._server = None

    @classmethod
    def child_env(cls, env: dict) -> dict:
        """A launch's environment, plus what lets the workers of a sweep it runs on this machine (submitit's local
        executor) hand themselves over to the server too (tests/_site/sitecustomize.py)."""
        return {**env, FORK_SERVER: cls._ensure(),
                "PYTHONPATH": os.pathsep.join(filter(None, [SITE_DIR, env.get("PYTHONPATH")]))}

    @staticmethod
    def accepts(cmd: list[str]) -> bool:
        """A launch the server can become: ``python -m MOD ...``, ``python -c CODE ...`` or ``python FILE.py ...``."""
        return (len(cmd) >= 2 and cmd[0] == sys.executable
                and (cmd[1] in ("-m", "-c") and len(cmd) >= 3 or cmd[1].endswith(".py")))

    @classmethod
    def run(cls, cmd: list[str], env: dict, cwd, timeout: float) -> subprocess.CompletedProcess:
        path = cls._ensure()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        null = os.open(os.devnull, os.O_RDONLY)
        chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
        conn = None
        try:
            try:
                conn = _send_request(path, {"argv": cmd[1:], "env": cls.child_env(env),
                                            "cwd": str(cwd or os.getcwd())}, [null, out_w, err_w])
            finally:
                for fd in (null, out_w, err_w):
                    os.close(fd)
            pid = int(_recv_line(conn))
            try:
                code = cls._wait(pid, conn, chunks, timeout)
            except BaseException:  # an interrupt, the test's own timeout: the child goes too, as subprocess.run does
                _kill(pid)
                raise
        finally:
            for fd in (out_r, err_r):
                os.close(fd)
            if conn is not None:
                conn.close()
        out, err = (b"".join(chunks[fd]).decode(errors="replace") for fd in (out_r, err_r))
        if code is None:
            raise subprocess.TimeoutExpired(cmd, timeout, out, err)
        return subprocess.CompletedProcess(cmd, code, out, err)

    @staticmethod
    def _wait(pid: int, conn: socket.socket, chunks: dict, timeout: float) -> Optional[int]:
        """Read the launch's streams into ``chunks`` until they close, then its exit status; None when it ran past
        ``timeout`` seconds and was killed (its stacks first, on its stderr). Its descendants may hold the streams
        open after it is gone: they are read for a moment, never waited for (subprocess.run does not either)."""
        open_fds = list(chunks)

        def read(until: float) -> None:
            while open_fds and (left := until - time.monotonic()) > 0:
                poll = select.poll()  # not select.select: a test process may hold descriptors past 1024
                for fd in open_fds:
                    poll.register(fd, select.POLLIN)
                for fd, _ in poll.poll(min(left, 1.0) * 1000):
                    data = os.read(fd, 1 << 16)
                    if data:
                        chunks[fd].append(data)
                    else:
                        open_fds.remove(fd)

        deadline = time.monotonic() + timeout
        read(deadline)
        if not open_fds:  # the streams closed: the child ends, or runs on without them until the deadline
            conn.settimeout(max(1.0, deadline - time.monotonic()))
            try:
                return int(_recv_line(conn))
            except TimeoutError:
                pass
        _kill(pid, STACKS_SIGNAL)
        read(time.monotonic() + 3)
        _kill(pid)
        conn.settimeout(60)
        try:
            _recv_line(conn)  # reaped
        except (TimeoutError, EOFError, ValueError):
            pass
        read(time.monotonic() + 1)
        return None


# A launch's child writes every thread's stack on its stderr when it gets this (faulthandler; no launch uses it)
STACKS_SIGNAL = signal.SIGRTMIN + 7
FORK_SERVER = "KDEXP_TEST_FORK_SERVER"  # the socket of this test process's server, in its launches' environment
SITE_DIR = str(Path(__file__).resolve().parent / "_site")
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGCONT, signal.SIGALRM)


def hand_over(path: str, argv: list[str]) -> None:
    """Make this just-started interpreter a stand-in for its launch run by the server at ``path``: the child gets
    this process's argv (``-u`` as a flag), environment, working directory and standard streams; the signals a
    supervisor sends (FORWARDED) are passed on to it; this process ends as it ends (its exit code, or killed by the
    same signal), and a stand-in killed outright takes its child with it. Returns (the caller goes on as a normal
    interpreter) when the server cannot be reached."""
    unbuffered = argv[:1] == ["-u"]
    alive_r, alive_w = os.pipe()  # alive_w stays open in this process until it ends
    try:
        conn = _send_request(path, {"argv": argv[1:] if unbuffered else argv, "env": dict(os.environ),
                                    "cwd": os.getcwd(), "unbuffered": unbuffered}, [0, 1, 2, alive_r])
    except OSError:
        os.close(alive_r)
        os.close(alive_w)
        return
    os.close(alive_r)
    try:
        pid = int(_recv_line(conn))
    except (OSError, EOFError, ValueError):  # the server dropped the request: no child runs it, this process does
        conn.close()
        os.close(alive_w)
        return
    # From here on a child runs the launch, so this never returns: an exception raised out of sitecustomize is
    # reported by Python, which then runs the launch itself, a second time beside (or after) its child.
    try:
        _stand_in_for(pid, conn)
    except BaseException as e:  # noqa: BLE001
        print(f"zygote: stand-in {os.getpid()} for {pid} failed: {e!r}", file=sys.stderr, flush=True)
    os._exit(1)


def _stand_in_for(pid: int, conn: socket.socket) -> None:
    """Pass FORWARDED signals on to the child `pid` until the server says how it ended, then end alike."""
    if os.environ.get("KDEXP_TEST_FORK_SERVER_VERBOSE"):
        print(f"handed over: {os.getpid()} -> {pid}", file=sys.stderr, flush=True)

    def forward(signum, _frame):
        _kill(pid, signum)
    for signum in FORWARDED:
        signal.signal(signum, forward)
    try:
        code = int(_recv_line(conn))
    except (OSError, EOFError, ValueError):  # the server is gone after it forked: never run the launch a second time
        print(f"zygote: the fork server went away; waiting for its child {pid}, whose exit status is lost",
              file=sys.stderr, flush=True)
        while alive(pid):
            time.sleep(0.5)
        os._exit(1)
    _end_as(code)


def _end_as(code: int) -> None:
    """End this process as a child that ended with `code` did (subprocess's convention: -N for death by signal N):
    killed by the same signal (SIGKILL takes no handler to reset; a signal whose default is to be ignored ends it
    with 128 + N, as a shell reports it), else exiting with the code."""
    if code < 0:
        signum = -code
        if signum != signal.SIGKILL:
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    os._exit(code if code >= 0 else 128 - code)


def alive(pid: int) -> bool:
    """Whether a process `pid` exists (a zombie not yet reaped counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _kill(pid: int, signum: int = 9) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    serve(sys.argv[1])
