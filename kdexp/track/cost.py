"""What a run cost: the ``cost`` record of its summary.json (and what a teacher-cache build cost, in its manifest).

    {"wall_s": 812.4, "device_count": 1, "device_kind": "NVIDIA H100 80GB HBM3", "device_hours": 0.2257,
     "tokens": 819200, "student_flops": 1.2e15, "teacher_forward_flops": 3.4e14,
     "cache": {"path": ".../teacher_cache/ab12", "build": {"wall_s": .., "device_count": .., "device_kind": ..,
               "device_hours": .., "tokens": .., "shards_written": .., "shards_kept": ..},
               "teacher_forward_flops": 2.7e14},
     "one_time": [{"what": "teacher pretraining", "path": ".../teacher/ea85", "built_here": true, "flops": 1.9e12,
                   "build": {"wall_s": 41.6, "device_count": 1, "device_kind": .., "device_hours": .., "tokens": ..}}]}

FLOPs are model FLOPs by kdexp.plan's formulas (kdexp.plan.flops_per_token, handed in: the plan sits above this
package), for the training steps only (the evaluation passes are not counted). ``tokens`` are the positions through
the student's training forward (on an on-policy step, its rollouts': rollout.prompt_tokens + max_new_tokens - 1 per
sample, not trainer.seq_length), and ``student_flops`` holds the student's generation on those steps (forward only).
With ``teacher=cached`` the step runs no teacher (``teacher_forward_flops`` 0) and the cache build's teacher pass is
recorded under ``cache``, once per build: the report divides it over the points of a sweep that share the cache
(kdexp.report.cost). Other one-time work a run used (the embedded teacher's pretraining, done by whichever point
needed it first) is listed under ``one_time`` with what building it cost (its ``build.json``, None when it was built
before such records existed), shared the same way. ``wall_s``, tokens and FLOPs are this process's work in the point:
a run resumed after a kill counts its last attempt only, the steps after the checkpoint it resumed from
(summary.json's ``resumed_from`` and ``trained_steps`` say which); device-hours = wall_s x device_count / 3600, and
like tokens/s it depends on the machine and its load.
"""
from __future__ import annotations

import platform
from pathlib import Path
from typing import Any, Callable, Optional

from kdexp.track import records

_USED_CACHE: list[str] = []  # the teacher cache this process's current run opened (kdexp.teacher.writer notes it)
_ONE_TIME: dict[str, tuple[str, bool]] = {}  # path -> (what, built by this run): one-time artefacts this run used
ONE_TIME_RECORD = "build.json"  # in a one-time artefact's directory: what building it cost (one_time_record)


def note_cache(path: str | Path, built: bool = False) -> None:
    """Called by the teacher cache when a run opens it (``built``: this run wrote it): the run's cost names the cache
    it used."""
    _USED_CACHE[:] = [str(path), "built" if built else ""]


def note_one_time(what: str, path: str | Path, *, built: bool) -> None:
    """Called when a run uses a one-time artefact (``built`` now, or by an earlier run: the embedded teacher's
    pretraining): the run's cost names it, so the report shares what building it cost over every point that used
    it, and takes it out of the wall time of the point that built it."""
    _ONE_TIME[str(path)] = (what, built or _ONE_TIME.get(str(path), ("", False))[1])


def one_time_record(*, wall_s: float, tokens: int, device: Any = None, **extra: Any) -> dict:
    """What one-time work cost (written as ONE_TIME_RECORD into the artefact, before its manifest seals it)."""
    count, kind = device_info(device)
    return {"wall_s": wall_s, "device_count": count, "device_kind": kind,
            "device_hours": device_hours(wall_s, count), "tokens": tokens, **extra}


def device_info(device: Any = None) -> tuple[int, str]:
    """(device count, device kind) of the running job: the world size (one device per process), and the GPU's name
    on CUDA, else 'cpu (<arch>)'."""
    import torch
    import torch.distributed as dist

    count = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    on_cuda = device is not None and getattr(device, "type", str(device)) == "cuda"
    if on_cuda and torch.cuda.is_available():
        return count, torch.cuda.get_device_name(device)
    return count, f"cpu ({platform.machine() or 'unknown'})"


def device_hours(wall_s: float, device_count: int) -> float:
    return wall_s * device_count / 3600.0


def build_record(*, wall_s: float, tokens: int, shards_written: int, shards_kept: int, device: Any = None) -> dict:
    """A teacher cache build's cost, for its manifest."""
    count, kind = device_info(device)
    return {"wall_s": wall_s, "device_count": count, "device_kind": kind,
            "device_hours": device_hours(wall_s, count), "tokens": tokens, "shards_written": shards_written,
            "shards_kept": shards_kept}


def samples_per_step(cfg: Any, world_size: int) -> int:
    """Samples in one optimizer step: the global batch, by the trainer's own accumulation rule."""
    from kdexp.config.checks import accumulation_steps

    t, par = cfg.trainer, cfg.parallel
    dp = max(1, world_size // (int(par.tensor) * int(par.pipeline)))
    micro = int(t.micro_batch_size)
    return accumulation_steps(t.global_batch_size, micro, dp) * micro * dp


def trained_tokens(cfg: Any, world_size: int, steps: int) -> tuple[int, int]:
    """(tokens through the student's training forward, tokens the student's sampler generated) over the last
    ``steps`` steps of the run: an on-policy step trains on its rollouts' positions (prompt + new tokens - 1) and
    generates prompt + new tokens per sample (prefill and decode, one forward each)."""
    from kdexp.config.rollout import on_policy_step, positions_per_sample

    per = samples_per_step(cfg, world_size)
    end = int(cfg.trainer.max_steps)
    trained = generated = 0
    for step in range(end - steps, end):
        trained += per * positions_per_sample(cfg, step)
        if on_policy_step(cfg.rollout, step):
            generated += per * (int(cfg.rollout.prompt_tokens) + int(cfg.rollout.max_new_tokens))
    return trained, generated


def run_cost(cfg: Any, *, wall_s: float, flops_per_token: Callable[[Any], dict], device: Any = None,
             steps: Optional[int] = None) -> dict:
    """The cost record of a run that trained ``steps`` steps (default cfg.trainer.max_steps) in ``wall_s`` seconds:
    only the work this process did (a resumed run counts the steps after its checkpoint). ``flops_per_token(cfg)``
    -> {"student", "teacher_forward"}: model FLOPs per trained token (kdexp.plan.flops_per_token)."""
    count, kind = device_info(device)
    steps = int(cfg.trainer.max_steps) if steps is None else int(steps)
    tokens, generated = trained_tokens(cfg, count, steps)
    cached = cfg.teacher.name == "cached"
    cost: dict[str, Any] = {"wall_s": wall_s, "device_count": count, "device_kind": kind,
                            "device_hours": device_hours(wall_s, count), "tokens": tokens,
                            "student_flops": None, "teacher_forward_flops": None, "cache": None}
    try:
        per_token = flops_per_token(cfg)
    except Exception as exc:  # noqa: BLE001 - a finished run must not fail on its bookkeeping
        per_token = {"student": None, "teacher_forward": None}
        cost["flops_error"] = f"{type(exc).__name__}: {exc}"
    else:
        # the student's generation is forward only: a third of its training FLOPs per token (2N of 6N)
        cost["student_flops"] = per_token["student"] * (tokens + generated / 3)
        cost["teacher_forward_flops"] = 0.0 if cached else per_token["teacher_forward"] * tokens
    used = _USED_CACHE[:]
    _USED_CACHE.clear()  # a sweep's next point in this process must not inherit it
    one_time = []
    for path, (what, built) in _ONE_TIME.items():
        build = records.read_json(Path(path) / ONE_TIME_RECORD)
        build = build if isinstance(build, dict) else None
        # the teacher's pretraining: forward + backward, 3x its forward FLOPs per token (kdexp.plan's rule)
        per = per_token["teacher_forward"]
        one_time.append({"what": what, "path": path, "built_here": built, "build": build,
                         "flops": 3 * per * build["tokens"] if per and build and build.get("tokens") else None})
    _ONE_TIME.clear()
    cost["one_time"] = one_time
    if cached and used:
        manifest = records.read_json(Path(used[0]) / "manifest.json") or {}
        build: Optional[dict] = manifest.get("build")
        cost["cache"] = {"path": used[0], "build": build, "built_here": used[1] == "built",
                         "teacher_forward_flops": per_token["teacher_forward"] * build["tokens"]
                         if build and build.get("tokens") and per_token["teacher_forward"] else None}
    return cost


__all__ = ["run_cost", "build_record", "note_one_time", "one_time_record", "ONE_TIME_RECORD", "note_cache", "device_info", "device_hours", "samples_per_step",
           "trained_tokens"]
