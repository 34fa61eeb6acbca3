"""metrics.jsonl, the fixed-width console line, and interval averages kept on the device.

Per-step values are summed as tensors and read back to the host once per log interval (the only other per-step host
read is the non-finite guard's one scalar, kdexp.train.step). Only global rank 0 writes.
"""
from __future__ import annotations

import json
import logging
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Optional

import torch

from kdexp.track import faults, records

log = logging.getLogger("kdexp")


class IntervalMeter:
    """Running sums of detached scalar tensors over one log interval. Each key is averaged over the steps that
    reported it (an on-policy run's rollout/* keys come from its on-policy steps only, train/lm_loss from the
    others)."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, int] = {}
        self.count = 0

    def add(self, values: dict[str, torch.Tensor]) -> None:
        for key, value in values.items():
            value = value.detach().float()
            self.sums[key] = self.sums[key] + value if key in self.sums else value.clone()
            self.counts[key] = self.counts.get(key, 0) + 1
        self.count += 1

    def averages(self) -> dict[str, float]:
        if not self.count:
            return {}
        keys = list(self.sums)
        host = torch.stack([self.sums[k] for k in keys]).cpu().tolist()  # the one host sync of the interval
        return {k: v / self.counts.get(k, self.count) for k, v in zip(keys, host)}

    def reset(self) -> None:
        self.sums, self.counts, self.count = {}, {}, 0

    def state_dict(self) -> dict:
        return {"sums": {k: v.cpu() for k, v in self.sums.items()}, "count": self.count, "counts": dict(self.counts)}

    def load_state_dict(self, state: dict, device: torch.device) -> None:
        self.sums = {k: v.to(device) for k, v in state["sums"].items()}
        self.count = state["count"]
        self.counts = dict(state.get("counts", {}))  # a checkpoint from before per-key counts: every key each step


class MetricsFile:
    """Append-only metrics.jsonl in strict JSON (kdexp.track.records: non-finite floats as strings).

    On resume, lines past the checkpoint step are dropped (they are recomputed). A run resumed from another run's
    checkpoint (``history``: that run's metrics.jsonl) starts from that run's lines up to the checkpoint step, so the
    file holds the whole history.
    """

    def __init__(self, path: Path, enabled: bool, resume_step: Optional[int] = None,
                 history: Optional[Path] = None):
        self.path = Path(path)
        self.enabled = enabled
        if not enabled:
            return
        source = Path(history) if history is not None else self.path
        if source.exists():
            self._keep_until(source, resume_step or 0)
        elif self.path.exists():  # the other run left no lines: this dir's own lines are of no checkpoint
            self._keep_until(self.path, 0)

    def _keep_until(self, source: Path, step: int) -> None:
        kept = []
        for line in source.read_text().splitlines():
            try:
                if records.loads(line)["step"] <= step:
                    kept.append(line)
            except (json.JSONDecodeError, KeyError, TypeError):  # a line cut by a kill
                continue
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".metrics.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write("".join(line + "\n" for line in kept))
        os.replace(tmp, self.path)

    def write(self, record: dict) -> None:
        """Append one line; a write that fails (a full disk) is cut back so that no half line is left."""
        if not self.enabled:
            return
        data = memoryview((records.dumps(record, sort_keys=True) + "\n").encode())
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            end = os.lseek(fd, 0, os.SEEK_END)
            try:
                with faults.writing(self.path):
                    while data:
                        data = data[os.write(fd, data):]
            except BaseException:
                os.ftruncate(fd, end)
                raise
        finally:
            os.close(fd)


def _fmt_eta(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600:d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def console_line(step: int, max_steps: int, m: dict[str, float], eta_s: float) -> str:
    """One fixed-width line per interval (step, losses, kept mass, nucleus size, tokens/s, lr, eta)."""
    return (f"step {step:>6d}/{max_steps:<6d} loss {m.get('train/loss', float('nan')):8.4f} "
            f"lm {m.get('train/lm_loss', float('nan')):8.4f} kd {m.get('train/kd_loss', float('nan')):8.4f} "
            f"kept {m.get('train/kept_mass', float('nan')):6.4f} "
            f"nucleus {m.get('train/nucleus_size', float('nan')):8.1f} "
            f"tok/s {m.get('perf/tokens_per_s', 0.0):9.0f} lr {m.get('train/lr', 0.0):9.3e} eta {_fmt_eta(eta_s)}"
            + (f" on-policy {m['rollout/on_policy_fraction']:4.2f} rollout kd {m.get('rollout/kd_loss', math.nan):8.4f}"
               f" len {m.get('rollout/length', math.nan):6.1f}" if "rollout/on_policy_fraction" in m else ""))


def eval_line(step: int, m: dict[str, float]) -> str:
    line = (f"eval {step:>6d}        val/lm_loss {m['val/lm_loss']:8.4f} "
            f"val/kl_to_teacher {m['val/kl_to_teacher']:8.4f} val/top1_agreement {m['val/top1_agreement']:6.4f}")
    if "val/onpolicy_reverse_kl" in m:
        line += f" val/onpolicy_reverse_kl {m['val/onpolicy_reverse_kl']:8.4f}"
    return line


class Progress:
    """A progress bar on rank 0, only when stderr is a terminal (log lines stay the record)."""

    def __init__(self, total: int, enabled: bool):
        self.total = total
        self.enabled = enabled and sys.stderr.isatty()

    def update(self, step: int) -> None:
        if self.enabled:
            width = 30
            done = int(width * step / max(1, self.total))
            sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {step}/{self.total}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
