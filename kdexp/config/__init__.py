"""kdexp.config: the typed schema of a run, its value checks and its identity.

- ``schema``: the dataclasses (registered in Hydra's ConfigStore as ``kdexp_schema``): the one set of defaults;
- ``validate(cfg)``: every value checked before anything is built (``rules``: generic rules, ``sources``: model,
  data and files on disk, ``checks``: the rest and the cross-key checks; the loss and balancer rules are
  kdexp.losses.options');
- ``config_hash(cfg)``: the identity of a sweep point;
- ``qwen3``: the Qwen3 shapes a run can name (``QWEN3_SIZES``), torch-free: the checks read them, kdexp.models builds
  from them.
- ``multirun``: a sweep's points composed as Hydra will compose them, each checked before anything starts;
- ``help``: the ``--help`` page, generated from the schema, the groups and the rules.
"""
from kdexp.config.checks import check_launch, validate
from kdexp.config.identity import config_hash
from kdexp.config.schema import (
    BalancerConfig,
    DataConfig,
    KdexpConfig,
    LoggerConfig,
    LossConfig,
    ModelConfig,
    ParallelConfig,
    PathsConfig,
    TrainerConfig,
    WandbConfig,
    register,
)

__all__ = ["validate", "check_launch", "config_hash", "register", "KdexpConfig", "ModelConfig", "LossConfig", "BalancerConfig",
           "DataConfig", "TrainerConfig", "ParallelConfig", "WandbConfig", "LoggerConfig", "PathsConfig"]
