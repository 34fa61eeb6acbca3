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

Events are written with tensorboardX's event-file writer and protos (numpy + protobuf: small enough for an offline
node's wheelhouse; the tensorboard package, a server with grpcio and a data-server binary, is only needed to view
them). The summaries are the ones TensorBoard's own writers emit by default, so that ``tensorboard --logdir`` with
its default (fast) loader serves them: scalars as float32 ``simple_value`` (what ``add_scalar`` writes), HParams as
tensorboard.plugins.hparams.summary_v2 builds them (experiment config with discrete domains, session start with group
name and start time, session end); the HParams metric columns are the last value of those scalars. float32 keeps about
7 significant digits (a value is rounded to within 6e-8 of itself, relative; beyond 3.4e38 it becomes inf):
metrics.jsonl and summary.json keep the exact float64 values, and the reports read those.
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
HPARAMS_METRICS = ("val/lm_loss", "val/kl_to_teacher", "val/top1_agreement", "val/onpolicy_reverse_kl", "train/loss",
                   "train/kd_loss", "train/kept_mass", "perf/tokens_per_s")


def available() -> Optional[str]:
    """None when the event writer (tensorboardX) can be imported, else why not."""
    try:
        from tensorboardX.writer import FileWriter  # noqa: F401
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


# HParams plugin tags and version (tensorboard.plugins.hparams.metadata).
_HPARAMS_PLUGIN, _HPARAMS_VERSION = "hparams", 0
_EXPERIMENT_TAG = "_hparams_/experiment"
_SESSION_START_TAG = "_hparams_/session_start_info"
_SESSION_END_TAG = "_hparams_/session_end_info"


def _writer(log_dir: Path):
    from tensorboardX.writer import FileWriter

    return FileWriter(str(log_dir))


def _plugin_value(tag: str, plugin: str, content: bytes, tensor):
    from tensorboardX.proto.summary_pb2 import Summary, SummaryMetadata

    meta = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name=plugin, content=content))
    return Summary(value=[Summary.Value(tag=tag, metadata=meta, tensor=tensor)])


def _empty_float_tensor():
    from tensorboardX.proto.tensor_pb2 import TensorProto
    from tensorboardX.proto.tensor_shape_pb2 import TensorShapeProto
    from tensorboardX.proto.types_pb2 import DataType

    return TensorProto(dtype=DataType.Value("DT_FLOAT"), tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=0)]))


def _hparams_summary(tag: str, **data):
    """One HParams plugin summary (experiment / session_start_info / session_end_info), with the empty float tensor
    tensorboard's summary_v2 attaches (metadata.NULL_TENSOR)."""
    from tensorboardX.proto.plugin_hparams_pb2 import HParamsPluginData

    content = HParamsPluginData(version=_HPARAMS_VERSION, **data).SerializeToString()
    return _plugin_value(tag, _HPARAMS_PLUGIN, content, _empty_float_tensor())


def _scalar_summary(tag: str, value: float):
    """A scalar as TensorBoard's own writers emit it by default (tensorboardX / torch.utils.tensorboard
    ``add_scalar``): a float32 ``simple_value``, which every TensorBoard loader serves, the default fast one
    (tensorboard-data-server) included; it does not serve float64 scalar tensors."""
    from tensorboardX.proto.summary_pb2 import Summary

    return Summary(value=[Summary.Value(tag=tag, simple_value=value)])


def _experiment_pb(planned: dict[str, list[Any]]):
    from tensorboardX.proto.api_pb2 import DataType, Experiment, HParamInfo, MetricInfo, MetricName

    kinds = {bool: "DATA_TYPE_BOOL", float: "DATA_TYPE_FLOAT64", int: "DATA_TYPE_FLOAT64", str: "DATA_TYPE_STRING"}
    infos = []
    for key, values in planned.items():
        info = HParamInfo(name=key)
        types = set(map(type, values))
        if len(types) == 1:  # a discrete domain of one type (summary_v2's Discrete); else an untyped column
            info.type = DataType.Value(kinds[types.pop()])
            info.domain_discrete.extend(sorted(values, key=lambda v: (str(type(v)), v)))
        infos.append(info)
    metrics = [MetricInfo(name=MetricName(tag=m), display_name=m) for m in HPARAMS_METRICS]
    return _hparams_summary(_EXPERIMENT_TAG, experiment=Experiment(hparam_infos=infos, metric_infos=metrics,
                                                                   time_created_secs=time.time()))


def _session_start_pb(hparams: dict[str, Any], group: str):
    from tensorboardX.proto.plugin_hparams_pb2 import SessionStartInfo

    start = SessionStartInfo(group_name=group, start_time_secs=time.time())
    for key in sorted(hparams):
        value = hparams[key]
        if isinstance(value, bool):
            start.hparams[key].bool_value = value
        elif isinstance(value, (int, float)):
            start.hparams[key].number_value = value
        else:
            start.hparams[key].string_value = str(value)
    return _hparams_summary(_SESSION_START_TAG, session_start_info=start)


def write_experiment(sweep_dir: Path, planned: dict[str, list[Any]]) -> bool:
    """The sweep's HParams experiment config, once: False when a point already wrote it (or no plan)."""
    if not planned:
        return False
    target = Path(sweep_dir) / EXPERIMENT_DIR
    try:
        target.mkdir(parents=True)  # atomic: the first point to start writes the one config
    except FileExistsError:
        return False
    writer = _writer(target)
    try:
        writer.add_summary(_experiment_pb(planned))
    finally:
        writer.close()
    return True


class TensorBoardLogger:
    """One run's events: scalars as logged, its HParams session start at once and end at ``close``."""

    def __init__(self, run_dir: Path, *, name: str, overrides: list[str], sweep_dir: Optional[Path] = None,
                 reused_from: Optional[str] = None):
        planned = planned_hparams(sweep_dir) if sweep_dir is not None else {}
        if sweep_dir is not None:
            write_experiment(sweep_dir, planned)
        self.hparams = session_hparams(overrides, planned)
        if reused_from:
            self.hparams["reused_from"] = str(reused_from)
        self.writer = _writer(Path(run_dir))
        self.writer.add_summary(_session_start_pb(self.hparams, name))
        self.seen: set[str] = set()
        self.last_step = 0

    def log(self, metrics: dict, step: int) -> None:
        for key, value in metrics.items():
            if key in ("step", "kind") or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isfinite(value):  # a NaN would hide the curve's scale; metrics.jsonl keeps it
                self.writer.add_summary(_scalar_summary(key, float(value)), global_step=step)
                self.seen.add(key)
        self.last_step = max(self.last_step, step)

    def summary(self, final: dict) -> None:
        """Final metrics not already logged as scalars (so the HParams view has a value for them)."""
        self.log({k: v for k, v in final.items() if k not in self.seen}, self.last_step)

    def close(self, exit_code: int = 0) -> None:
        from tensorboardX.proto.api_pb2 import Status
        from tensorboardX.proto.plugin_hparams_pb2 import SessionEndInfo

        status = Status.Value("STATUS_SUCCESS" if exit_code == 0 else "STATUS_FAILURE")
        end = SessionEndInfo(status=status, end_time_secs=time.time())
        self.writer.add_summary(_hparams_summary(_SESSION_END_TAG, session_end_info=end))
        self.writer.close()


def enabled_in(cfg: Any) -> bool:
    """logger.tensorboard, and the package importable (else one warning: the run goes on without it)."""
    if not cfg.logger.tensorboard:
        return False
    problem = available()
    if problem is not None:
        log.warning("logger.tensorboard=true but tensorboardX cannot be imported (%s): no TensorBoard events; "
                    "pip install tensorboardX, or logger.tensorboard=false", problem)
        return False
    return True


__all__ = ["TensorBoardLogger", "write_experiment", "planned_hparams", "session_hparams", "typed_values",
           "EXPERIMENT_DIR", "HPARAMS_METRICS", "available", "enabled_in"]
