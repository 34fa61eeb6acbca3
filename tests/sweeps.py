"""Sweeps for the report and notebook tests: hand-made run dirs with known numbers, and one real tiny sweep.

``write_run_dir`` writes what the trainer, Hydra and the sweep callback write (.hydra/, metrics.jsonl, summary.json,
point.json, error.log) with numbers chosen by the test. ``run_tiny_sweep`` runs ``python -m kdexp.run -m`` for real.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path
from typing import Any, Optional

import yaml

from kdexp.track import records
from _launch import UNCHECKED_RUN, kdexp_run

REPO = Path(__file__).resolve().parents[1]


def config_hash(config: dict, overrides: list[str]) -> str:
    """What the trainer's kdexp.config.config_hash stands for here: the same config and overrides = the same training
    (a hash of the resolved config there; the hand-made config is not a full one, so its overrides count too)."""
    blob = json.dumps({"config": config, "overrides": sorted(o for o in overrides if not o.startswith("hydra"))},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def write_run_dir(run_dir: Path, *, overrides: list[str], config: dict, choices: Optional[dict] = None,
                  num: Optional[int] = None, train: Optional[list[dict]] = None, val: Optional[list[dict]] = None,
                  final: Optional[dict] = None, steps: Optional[int] = None, error: Optional[str] = None,
                  traceback: Optional[str] = None, point_status: Optional[str] = None,
                  reused_from: Optional[str] = None, summary: Optional[dict] = None) -> Path:
    """A run dir. ``final`` given = finished (summary.json, its fields updated from ``summary``, e.g. a diverged
    status); ``error`` given = failed (point.json + error.log). JSON is written as the trainer writes it (strict:
    NaN as "NaN")."""
    run_dir = Path(run_dir)
    (run_dir / ".hydra").mkdir(parents=True, exist_ok=True)
    (run_dir / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (run_dir / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    hydra: dict[str, Any] = {"hydra": {"mode": "MULTIRUN" if num is not None else "RUN",
                                       "job": {"name": "run", **({"num": num} if num is not None else {})},
                                       "overrides": {"task": overrides},
                                       "runtime": {"choices": {"hydra/launcher": "basic", **(choices or {})}}}}
    (run_dir / ".hydra" / "hydra.yaml").write_text(yaml.safe_dump(hydra))
    lines = [{"step": r["step"], "kind": "train", **{k: v for k, v in r.items() if k != "step"}} for r in train or []]
    lines += [{"step": r["step"], "kind": "val", **{k: v for k, v in r.items() if k != "step"}} for r in val or []]
    if lines:
        with (run_dir / "metrics.jsonl").open("w") as f:
            for rec in sorted(lines, key=lambda r: (r["step"], r["kind"] == "val")):
                f.write(records.dumps(rec) + "\n")
    point = {"num": num, "overrides": overrides, "run_dir": str(run_dir.resolve()), "metrics": {}, "error": None,
             "status": point_status or "running"}
    if final is not None:
        summary = {"status": "finished", "config_hash": config_hash(config, overrides), "overrides": overrides,
                   "steps": steps,
                   "wall_s": 1.5, "final": final, "reused_from": reused_from, **(summary or {})}
        (run_dir / "summary.json").write_text(records.dumps(summary))
        point.update(status=records.ended_status(summary), metrics=final, error=summary.get("error"))
    if error is not None:
        point.update(status="failed", error=error)
        (run_dir / "error.log").write_text(traceback or f"Traceback (most recent call last):\n  ...\n{error}\n")
    (run_dir / "point.json").write_text(records.dumps(point))
    return run_dir


def tiny_config(alpha: float, loss: str, arm: Optional[str] = None) -> dict:
    config = {"model": {"teacher": "tiny-teacher", "student": "tiny-student"},
              "loss": {"name": loss, "top_k": 64, "top_p": 0.95 if loss == "top_p" else None, "min_k": 1},
              "balancer": {"name": "alpha", "alpha": alpha},
              "trainer": {"max_steps": 4, "lr": 0.002, "min_lr": "${trainer.lr}"},
              "paths": {"cache": "${oc.env:HOME}/.cache/kdexp"}}
    if arm is not None:
        config["experiment_arm"] = arm
    return config


def run_tiny_sweep(sweep_dir: Path, *, cache_dir: Path, extra: tuple[str, ...] = (),
                   timeout: float = 1800) -> subprocess.CompletedProcess:
    """A real multirun of the tiny default: balancer.alpha=0.0,1.0 (two finished points) plus alpha=1.5, which the
    config validation rejects inside the job, so the sweep also has a real failed point (started through
    tests/_unchecked_run.py: ``python -m kdexp.run`` refuses such a sweep whole before it starts). Returns the
    process."""
    env = {**os.environ, "KDEXP_CACHE": str(cache_dir), "WANDB_MODE": "disabled"}
    args = ["-m", "experiment=smoke", "logger=none",
            "logger.tensorboard=true",  # tests/test_tensorboard.py serves this sweep's events
            "trainer.max_steps=4", "trainer.eval_interval=2", "trainer.eval_iters=1", "trainer.log_interval=1",
            "trainer.checkpoint_interval=4", "balancer.alpha=0.0,1.0,1.5", f"hydra.sweep.dir={sweep_dir}", *extra]
    return kdexp_run(args, env, sweep_dir.parent, check=False, timeout=timeout, entry=UNCHECKED_RUN)


_REAL: dict = {}


def real_tiny_sweep(tmp_path_factory, seeded_cache) -> tuple[Path, subprocess.CompletedProcess]:
    """The real tiny sweep, run once per test process however many modules ask for it (memoized here, because a
    session fixture would have to live in conftest.py; conftest.py puts its modules on one xdist worker), from a
    copy of the smoke experiment's built cache (conftest's seeded_cache)."""
    if "dir" not in _REAL:
        base = tmp_path_factory.mktemp("real_sweep")
        sweep_dir = base / "sweep"
        _REAL["proc"] = run_tiny_sweep(sweep_dir, cache_dir=seeded_cache(base / "cache"))
        _REAL["dir"] = sweep_dir
    return _REAL["dir"], _REAL["proc"]


def expected_real_points(sweep_dir: Path) -> dict:
    """What the real sweep's files say, read with json alone (the reference the report is checked against):
    {alpha: {"status": .., "final": {..}, "error": .., "last": {metric: last value in metrics.jsonl}}}."""
    out = {}
    for point_file in sorted(Path(sweep_dir).rglob("point.json")):
        run_dir = point_file.parent
        point = json.loads(point_file.read_text())
        alpha = next(float(o.split("=", 1)[1]) for o in point["overrides"] if o.startswith("balancer.alpha="))
        summary_file = run_dir / "summary.json"
        summary = json.loads(summary_file.read_text()) if summary_file.exists() else None
        last: dict = {}
        if (run_dir / "metrics.jsonl").exists():
            for line in (run_dir / "metrics.jsonl").read_text().splitlines():
                rec = json.loads(line)
                last.update({k: v for k, v in rec.items() if k not in ("step", "kind")})
        out[alpha] = {"status": point["status"], "error": point.get("error"), "run_dir": run_dir,
                      "final": (summary or {}).get("final"), "last": last}
    return out


def checked_real_points(sweep_dir: Path, proc: subprocess.CompletedProcess) -> dict:
    """expected_real_points, after checking the sweep did what the tests rely on: alpha 0.0 and 1.0 finished, 1.5
    refused by the job's own validation before it claimed a run dir (no point.json, no run dir: named in sweep.json's
    ``refused`` list only, which adds it here as {"status": "refused", "error": its line}). Otherwise the assertion
    shows each point's error and the sweep's output."""
    points = expected_real_points(sweep_dir)
    sweep = json.loads((Path(sweep_dir) / "sweep.json").read_text())
    refused = sweep.get("refused") or []
    statuses = {a: p["status"] for a, p in points.items()}
    detail = (f"sweep rc={proc.returncode} statuses={statuses} refused={refused}\n"
              + "".join(f"alpha={a}: {p['error']}\n" for a, p in points.items() if p["error"])
              + f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}")
    assert statuses == {0.0: "finished", 1.0: "finished"}, detail
    assert len(refused) == 1 and "balancer.alpha=1.5" in refused[0]["overrides"], detail
    assert proc.returncode == 1, detail  # a refused point fails the sweep's exit status
    points[1.5] = {"status": "refused", "error": refused[0]["error"], "run_dir": None, "final": None, "last": {}}
    return points


def run_diverging_sweep(sweep_dir: Path, *, index_dir: Path, timeout: float = 1800) -> subprocess.CompletedProcess:
    """A real multirun of the smoke experiment with trainer.lr=0.002 (finishes) and 1e6 (a non-finite gradient norm
    stops it at step 3, after the step-2 checkpoint). ``index_dir`` = a fresh finished-points index, so neither
    point is reused from another test's run of the same config (the session's teacher cache is shared).
    model.attention=megatron: after an lr-1e6 step the attention scores reach ~1e12, where torch's CPU SDPA backward
    already gives NaN (it stops one step earlier, before any checkpoint) while the unfused softmax stays finite; this
    sweep is about the bookkeeping of a diverged point with a checkpoint before it."""
    env = {**os.environ, "WANDB_MODE": "disabled"}
    args = ["-m", "experiment=smoke", "logger=none", "trainer.max_steps=4", "trainer.eval_interval=2",
            "trainer.eval_iters=1", "trainer.log_interval=1", "trainer.checkpoint_interval=2",
            "model.attention=megatron", f"paths.index={index_dir}", "trainer.lr=0.002,1e6", f"hydra.sweep.dir={sweep_dir}"]
    return kdexp_run(args, env, sweep_dir.parent, check=False, timeout=timeout)
