"""A fake teacher + token stream for the teacher-cache tests, and (run as a script) one job that builds the cache.

    python tests/_teacher_cache_worker.py <cache_dir> [--kill-after J] [--slow S] [--draws S]

builds (or reuses) the cache of the fake teacher at <cache_dir> through kdexp.teacher.writer.ensure_at, the code path
a run takes, logging at INFO on stderr. --kill-after J SIGKILLs the process right after shard J is finished (a
preempted node); --slow S sleeps S seconds per teacher forward so that a second job surely meets the first one's lock;
--draws S builds a "sampled" cache of S draws per token (proposal temperature 1) instead of the top-K one.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time

import torch

VOCAB, SEQ, SAMPLES, SHARD = 300, 6, 10, 3  # 300 > 256: two-byte indices; 4 shards, the last one short
K_MAX, TEMPS = 12, (1.0, 2.0)
DRAW_SEED = 1234  # a sampled cache's data.seed


class FakeTeacher(torch.nn.Module):
    """Logits = a fixed random table per (token, position): deterministic across processes, no megatron."""

    def __init__(self, slow: float = 0.0):
        super().__init__()
        g = torch.Generator().manual_seed(11)
        self.table = torch.randn(VOCAB, SEQ, VOCAB, generator=g) * 3
        self.slow = slow

    def forward(self, ids, positions, mask):
        if self.slow:
            time.sleep(self.slow)
        import kdexp.distributed as kd

        st = kd.state() if kd.is_initialized() else None
        if st is None or st.tp_size == 1:
            return self.table[ids, positions]
        width = VOCAB // st.tp_size  # this rank's contiguous vocabulary shard, as megatron's output layer gives it
        return self.table[ids, positions][..., st.tp_rank * width:(st.tp_rank + 1) * width]


def dataset():
    g = torch.Generator().manual_seed(5)
    return [{"tokens": torch.randint(0, VOCAB, (SEQ,), generator=g)} for _ in range(SAMPLES)]


def layout(values: str = "float32", **sampled):
    """The fake teacher's top-K_max layout, or with `sampled` keywords (draws, proposal_temperature, draw_seed) a
    "sampled" one."""
    from kdexp.teacher import format as fmt

    record = dict(k_max=0, record="sampled", **{"draw_seed": DRAW_SEED, **sampled}) if sampled else dict(k_max=K_MAX)
    return fmt.Layout(samples=SAMPLES, seq_length=SEQ, temperatures=TEMPS, values=values,
                      index_bytes=fmt.index_bytes(VOCAB), shard_samples=SHARD, **record)


def key(layout, **changes):
    """Like kdexp.teacher.writer.cache_key: the record's own entries (k_max, or the draws') and the common ones."""
    return {"teacher": "fake", "data.seed": 1234, "record": layout.record, **layout.key_entries(),
            "temperatures": list(layout.temperatures), "values": layout.values, **changes}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--kill-after", type=int, default=None)
    ap.add_argument("--slow", type=float, default=0.0)
    ap.add_argument("--draws", type=int, default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(var, None)
    import kdexp.distributed as kd
    from kdexp.teacher import writer

    kd.initialize(seed=0)
    if args.kill_after is not None:
        writer.SHARD_END_HOOKS.append(
            lambda j: os.kill(os.getpid(), signal.SIGKILL) if j == args.kill_after else None)
    lay = layout() if args.draws is None else layout(draws=args.draws, proposal_temperature=1.0)
    cache = writer.ensure_at(args.path, key(lay), lay, FakeTeacher(args.slow), dataset(), 2)
    print(f"shards={cache.layout.shards}", flush=True)


if __name__ == "__main__":
    main()
