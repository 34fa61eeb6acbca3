"""kdexp's sweep semantics, by their public names: the path conf YAMLs and callers use (``kdexp.track.sweep``).

Importing it registers the OmegaConf resolvers the configs refer to: ``kdexp_uid`` and ``kdexp_stamp``
(kdexp.track.rundir) and ``kdexp_site_dir`` (kdexp.launchers.site). Each concept lives in its own module:

  kdexp.track.callback       SweepCallback, the Hydra callback (conf/config.yaml names its subclass with the live
                             dashboard, kdexp.report.callback.LiveSweepCallback)
  kdexp.track.points         point.json / sweep.json bookkeeping, failure records, progress lines
  kdexp.track.naming         W&B group / name / job type of a run
  kdexp.track.hydra_adapter  the only use of Hydra internals (planning the points, a job's exception)
  kdexp.track.rundir         run and sweep dirs (stamp, uid, where a sweep's dir is)
  kdexp.track.records        the file formats (names, statuses, strict JSON, error logs, overrides)
  kdexp.track.slots          how many points of a submitit-local sweep train at once (launch.local_parallel)
  kdexp.distributed.launch   global rank (only rank 0 writes)
"""
from __future__ import annotations

import kdexp.launchers.site  # noqa: F401  (registers kdexp_site_dir, used by hydra.searchpath)
from kdexp.distributed.launch import global_rank
from kdexp.track.callback import SweepCallback
from kdexp.track.hydra_adapter import plan_points
from kdexp.track.naming import job_type, run_name, sweep_keys, wandb_group, wandb_names
from kdexp.track.points import progress_line, rebuild_sweep, record_failure, record_point, report_command
from kdexp.track.records import STATUSES, override_key
from kdexp.track.rundir import sweep_uid
from kdexp.track.slots import take_local_slot

__all__ = ["SweepCallback", "global_rank", "sweep_uid", "record_point", "record_failure", "rebuild_sweep",
           "progress_line", "report_command", "plan_points", "run_name", "sweep_keys", "override_key", "wandb_group",
           "wandb_names", "job_type", "STATUSES", "take_local_slot"]
