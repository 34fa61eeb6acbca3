"""Third-party noise is switched off where it starts, and kdexp's own warnings still show.

- megatron's "full scope is deprecated" (TransformerConfig's default cuda_graph_scope): kdexp passes the setting in
  its current spelling, so the warning is never raised;
- megatron's optional-kernel warnings (Apex, Transformer Engine) are filtered by message *and* megatron's module, so
  the same words from kdexp's code still show;
- W&B's banner: kdexp passes wandb's own `silent` setting (WANDB_SILENT, when set, decides instead).
"""
from __future__ import annotations

import warnings

import pytest


def test_kdexp_builds_megatron_config_without_the_deprecation_warning():
    from kdexp.models import get_spec
    from kdexp.models.build import transformer_config

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # nothing filtered: the warning must not be raised at all
        transformer_config(get_spec("tiny-student"))
    assert not [w for w in caught if "full scope" in str(w.message)], [str(w.message) for w in caught]


def test_megatron_filters_name_megatron_and_kdexp_warnings_still_show():
    from kdexp.train.point import quiet_megatron

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_megatron()  # installs its filters in front of "always"
        for module in ("megatron.core.models.backends", "kdexp.losses._native"):
            warnings.warn_explicit("Apex is not installed. Falling back to Torch Norm", UserWarning, "x.py", 1,
                                   module=module, registry={})
        warnings.warn_explicit("kdexp: a warning of its own", UserWarning, "y.py", 1, module="kdexp.train.loop",
                               registry={})
    shown = [(str(w.message), w.filename) for w in caught]
    assert shown == [("Apex is not installed. Falling back to Torch Norm", "x.py"),
                     ("kdexp: a warning of its own", "y.py")], shown


@pytest.mark.parametrize("env, silent", [({}, True), ({"WANDB_SILENT": "false"}, None)])
def test_wandb_gets_its_silent_setting_unless_the_user_chose(env, silent, tmp_path, monkeypatch):
    import wandb
    from omegaconf import OmegaConf

    from kdexp.config.schema import KdexpConfig
    from kdexp.track.wandb_logger import WandbLogger

    monkeypatch.delenv("WANDB_SILENT", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    seen = {}

    def fake_init(mode, settings, **kwargs):
        seen["silent"] = settings.silent if "silent" in settings.model_fields_set else None
        seen["mode"] = mode
        raise SystemExit  # stop before a real run starts

    monkeypatch.setattr(wandb, "init", fake_init)
    cfg = OmegaConf.structured(KdexpConfig)
    cfg.paths.cache = cfg.paths.index = str(tmp_path)
    with pytest.raises(SystemExit):
        WandbLogger(cfg, tmp_path, enabled=True, name="n", group=None, job_type="run")
    assert seen == {"silent": silent, "mode": "offline"}
