"""kdexp.train.signals in this process and in a 2-rank gloo group: a real signal is recorded (never acted on inside
the handler), the ranks agree on it, the previous handler (submitit's requeue) runs before the exit, and the exit is a
SystemExit with status 128 + the signal. The runs a signal stops and resume are in test_train.py (a plain run) and
test_slurm.py (a SLURM job requeued by submitit)."""
from __future__ import annotations

import os
import signal

import pytest
import torch.multiprocessing as mp

from kdexp.distributed.testing import free_port
from kdexp.train import signals


def test_a_real_signal_is_recorded_and_the_previous_handlers_come_back():
    before = {s: signal.getsignal(s) for s in signals.preempt_signals()}
    with signals.Preemption() as p:
        assert p.agreed("cpu") == 0
        os.kill(os.getpid(), signal.SIGUSR2)
        os.kill(os.getpid(), signal.SIGTERM)  # the first signal is the one reported
        assert p.agreed("cpu") == signal.SIGUSR2
    assert {s: signal.getsignal(s) for s in signals.preempt_signals()} == before


def test_stop_hands_over_to_the_previous_handler_then_exits_with_128_plus_the_signal():
    seen = []
    old = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))  # e.g. submitit's handler
    try:
        with signals.Preemption() as p:
            os.kill(os.getpid(), signal.SIGUSR1)
            with pytest.raises(signals.Preempted) as stop:
                p.stop(p.agreed("cpu"), 7, "stopped after step 7")
        assert seen == [signal.SIGUSR1]
        assert stop.value.code == 128 + signal.SIGUSR1 and stop.value.step == 7 and str(stop.value) == \
            "stopped after step 7"
        assert isinstance(stop.value, SystemExit) and not isinstance(stop.value, Exception)
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_what_the_previous_handler_raises_wins():
    """submitit's handler ends rank 0 with sys.exit(-1) after `scontrol requeue`: that exit is the process's."""
    def requeue_and_exit(signum, frame):
        raise SystemExit(-1)

    old = signal.signal(signal.SIGUSR2, requeue_and_exit)
    try:
        with signals.Preemption() as p, pytest.raises(SystemExit) as stop:
            p.stop(signal.SIGUSR2, 3, "x")
        assert stop.value.code == -1 and not isinstance(stop.value, signals.Preempted)
    finally:
        signal.signal(signal.SIGUSR2, old)


def _agree_worker(rank: int, world: int, port: int, out) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    with signals.Preemption() as p:
        first = p.agreed("cpu")
        if rank == 1:  # only one rank is signalled: both must stop at the same step boundary
            os.kill(os.getpid(), signal.SIGTERM)
        second = p.agreed("cpu")
    dist.destroy_process_group()
    out.put((rank, first, second))


@pytest.mark.slow
def test_ranks_agree_on_a_signal_that_reached_one_of_them():
    port = free_port()
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.spawn(_agree_worker, args=(2, port, out), nprocs=2, join=True)
    got = sorted(out.get() for _ in range(2))
    assert got == [(0, 0, signal.SIGTERM), (1, 0, signal.SIGTERM)]
