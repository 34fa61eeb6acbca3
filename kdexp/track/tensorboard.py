"""TensorBoard for a run and for a sweep: ``tensorboard --logdir <sweep dir>`` shows every point's curves and the
sweep's HParams table and parallel-coordinates view (``logger.tensorboard``, on by default; rank 0 only).

  <run dir>/events.out.tfevents.*      the point's scalars (every metrics.jsonl row, same names and steps), its
                                       HParams session: start (its swept values, group = the point's name) and end
                                       (success / failure); a reused point replays the original's rows
  <sweep dir>/hparams/events.out...    the sweep's one HParams experiment config: every swept key with the values
                                       the sweep plans (sweep.json), and the final metrics as the metric columns

The experiment config is written once per sweep, by the first point to start (an atomic mkdir decides), so TensorBoard
finds exactly one (with several it would pick one arbitrarily). Swept values are typed as Hydra types them; a key
whose planned values mix numbers and text is shown as text in every point, so each column has one type. A single run
writes its session with all its overrides, and TensorBoard derives the experiment from it.

Events are written with torch.utils.tensorboard's writer and the hparams protos of tensorboard.plugins.hparams
(summary_v2 builds them without TensorFlow).
"""
from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any, Optional

from kdexp.track import records
from kdexp.track.naming import sweep_keys

log = logging.getLogger("kdexp")

EXPERIMENT_DIR = "hparams"  # under the sweep dir: the TensorBoard run holding the sweep's experiment config
# The metric columns of the HParams view: each point's last value of these scalars (its final metrics).
HPARAMS_METRICS = ("val/lm_loss", "val/kl_to_teacher", "val/top1_agreement", "train/loss", "train/kd_loss",
                   "train/kept_mass", "perf/tokens_per_s")


def available() -> Optional[str]:
    """None when the tensorboard package can be imported, else why not."""
    try:
        import tensorboard  # noqa: F401
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return None


# ---------------------------------------------------------------------------------------------------------------------
def planned_hparams(sweep_dir: Path) -> dict[str, list[Any]]:
    """Swept key -> its planned values in order (sweep.json), typed: numbers as float, booleans, else strings (a key
    mixing kinds is all strings). Empty without a plan of two or more points."""
    sweep = records.read_json(Path(sweep_dir) / records.SWEEP) or {}
    planned = [p["overrides"] for p in sweep.get("points", []) if p.get("overrides") is not None]
    if len(planned) < 2:
        return {}
    out: dict[str, list[Any]] = {}
    for key in sweep_keys(planned):
        raw = [records.parse_overrides(o).get(key) for o in planned]
        out[key] = list(dict.fromkeys(typed_values(raw)))
    return out


def typed_values(raw: list[Optional[str]]) -> list[Any]:
    """Override texts -> the values one HParams column holds (one type for all: see planned_hparams)."""
    values = [records.parse_scalar(r) for r in raw]
    if all(isinstance(v, bool) for v in values):
        return values
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return [float(v) for v in values]
    return ["null" if r is None else str(r) for r in raw]


def session_hparams(overrides: list[str], planned: dict[str, list[Any]]) -> dict[str, Any]:
    """This point's HParams values: its value of each planned key, typed as that column is (a key it does not set is
    'default'); a single run's every override."""
    given = records.parse_overrides([o for o in overrides if not records.is_hydra_key(records.override_key(o))])
    if not planned:
        return {k: typed_values([v])[0] for k, v in given.items()}
    out = {}
    for key, values in planned.items():
        if key not in given:
            out[key] = "default"
            continue
        text = isinstance(values[0], str)
        out[key] = str(given[key]) if text else typed_values([given[key]])[0]
    return out


def _writer(log_dir: Path):
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=str(log_dir))


def write_experiment(sweep_dir: Path, planned: dict[str, list[Any]]) -> bool:
    """The sweep's HParams experiment config, once: False when a point already wrote it (or no plan)."""
    from tensorboard.plugins.hparams import summary_v2 as hp

    if not planned:
        return False
    target = Path(sweep_dir) / EXPERIMENT_DIR
    try:
        target.mkdir(parents=True)  # atomic: the first point to start writes the one config
    except FileExistsError:
        return False
    hparams = [hp.HParam(k, hp.Discrete(v)) if len(set(map(type, v))) == 1 else hp.HParam(k) for k, v in
               planned.items()]
    metrics = [hp.Metric(m, display_name=m) for m in HPARAMS_METRICS]
    writer = _writer(target)
    try:
        writer.file_writer.add_summary(hp.hparams_config_pb(hparams=hparams, metrics=metrics))
    finally:
        writer.close()
    return True


class TensorBoardLogger:
    """One run's events: scalars as logged, its HParams session start at once and end at ``close``."""

    def __init__(self, run_dir: Path, *, name: str, overrides: list[str], sweep_dir: Optional[Path] = None,
                 reused_from: Optional[str] = None):
        from tensorboard.plugins.hparams import summary_v2 as hp

        planned = planned_hparams(sweep_dir) if sweep_dir is not None else {}
        if sweep_dir is not None:
            write_experiment(sweep_dir, planned)
        self.hparams = session_hparams(overrides, planned)
        if reused_from:
            self.hparams["reused_from"] = str(reused_from)
        self.writer = _writer(Path(run_dir))
        self.writer.file_writer.add_summary(hp.hparams_pb(self.hparams, trial_id=name))
        self.seen: set[str] = set()
        self.last_step = 0

    def log(self, metrics: dict, step: int) -> None:
        for key, value in metrics.items():
            if key in ("step", "kind") or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isfinite(value):  # a NaN would hide the curve's scale; metrics.jsonl keeps it
                self.writer.add_scalar(key, float(value), global_step=step, new_style=True, double_precision=True)
                self.seen.add(key)
        self.last_step = max(self.last_step, step)

    def summary(self, final: dict) -> None:
        """Final metrics not already logged as scalars (so the HParams view has a value for them)."""
        self.log({k: v for k, v in final.items() if k not in self.seen}, self.last_step)

    def close(self, exit_code: int = 0) -> None:
        from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2
        from tensorboard.compat.proto import summary_pb2

        end = plugin_data_pb2.SessionEndInfo(status=api_pb2.STATUS_SUCCESS if exit_code == 0 else
                                             api_pb2.STATUS_FAILURE, end_time_secs=time.time())
        content = plugin_data_pb2.HParamsPluginData(session_end_info=end)
        summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(
            tag=metadata.SESSION_END_INFO_TAG, metadata=metadata.create_summary_metadata(content))])
        self.writer.file_writer.add_summary(summary)
        self.writer.close()


def enabled_in(cfg: Any) -> bool:
    """logger.tensorboard, and the package importable (else one warning: the run goes on without it)."""
    on = cfg.get("logger", {}).get("tensorboard", False) if hasattr(cfg, "get") else False
    if not on:
        return False
    problem = available()
    if problem is not None:
        log.warning("logger.tensorboard=true but tensorboard cannot be imported (%s): no TensorBoard events; "
                    "pip install tensorboard, or logger.tensorboard=false", problem)
        return False
    return True


__all__ = ["TensorBoardLogger", "write_experiment", "planned_hparams", "session_hparams", "typed_values",
           "EXPERIMENT_DIR", "HPARAMS_METRICS", "available", "enabled_in"]
