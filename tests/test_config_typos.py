"""A typo never runs a different job (issue 26): group options and keys that do not exist, a loss option set that
contradicts the loss's name, and a tensor-parallel size the launch cannot hold. The command-line side (one line,
exit 2) is tests/test_cli.py's test_a_typo_never_runs_another_job."""
from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from hydra.errors import ConfigCompositionException

import kdexp.conf  # noqa: F401  (registers the schema and resolvers)
from kdexp.config import check_launch, overrides, validate

REPO = Path(__file__).resolve().parents[1]


def cfg_of(*args: str):
    with initialize_config_module(config_module="kdexp.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(args))


@pytest.fixture(autouse=True)
def _temp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KDEXP_CACHE", str(tmp_path / "cache"))
    for var in ("RANK", "WORLD_SIZE", "SUBMITIT_EXECUTOR", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_ID"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize("group", ["arm", "experiment"])
def test_a_missing_option_of_the_once_optional_groups_fails_in_hydra_too(group):
    # conf/config.yaml's `- arm: null` (not `optional`): Hydra itself refuses it, also through the compose API
    with pytest.raises(ConfigCompositionException, match=f"Could not find '{group}/nope'"):
        cfg_of(f"{group}=nope")
    assert cfg_of().experiment_arm is None  # and the default still selects none


def test_a_key_added_with_plus_is_refused_by_validate_with_the_closest_key():
    cfg = cfg_of("+loss.topk=5")  # Hydra opens the struct schema for `+`
    assert cfg.loss.top_k == 1024
    with pytest.raises(ValueError, match=r"^loss.topk is not a kdexp option: the config has no key 'loss.topk' "
                                         r"\(did you mean 'loss.top_k'\?\)$"):
        validate(cfg)
    with pytest.raises(ValueError, match=r"^bogus is not a kdexp option"):
        validate(cfg_of("+bogus=1"))


@pytest.mark.parametrize("override, says", [
    ("loss.intermediate.0.kind=mse", None),  # below a list: the list's items are OmegaConf's business
    ("trainer.max_steps=3", None),
    ("hydra.job.name=x", None),  # Hydra's own keys are Hydra's
    ("~loss.top_k", None),
    ("trainer.lr.x=1", None),  # below a leaf: OmegaConf says a float has no key
    ("+trainer.lrr=1", "the config has no key 'trainer.lrr' (did you mean 'trainer.lr'?)"),
    ("trainr.lr=1", "the config has no key 'trainr.lr' (did you mean 'trainer.lr'?)"),
    ("hydra/launchr=x", "there is no config group 'hydra/launchr'"),
    ("loss=[topk,top_p]", None),
    ("arm=null", None),
    ("experiment=[qwen3_before_after,smoke]", None),
])
def test_the_override_check(override, says):
    if says is None:
        overrides.check([override])
    else:
        with pytest.raises(ValueError) as err:
            overrides.check([override])
        assert str(err.value) == f"{override}: {says}"


@pytest.mark.parametrize("args, key, fits", [
    (["loss=dense", "loss.top_p=0.9"], "top_p", "top_p"),
    (["loss=dense", "loss.top_k=64"], "top_k", "topk"),
    (["loss=topk", "loss.top_k=null"], "top_k", "dense"),
    (["loss=topk", "loss.normalization=renormalize", "loss.ghost_token=false"], "normalization", "renorm_topk"),
    (["loss=renorm_topk", "loss.normalization=full"], "normalization", "topk"),
    (["loss=top_p", "loss.top_p=null"], "top_p", "dense"),
    (["loss=top_p", "loss.top_p=1.0"], "top_p", "dense"),  # a nucleus of 1.0 cuts nothing
])
def test_options_that_contradict_the_loss_name(args, key, fits):
    with pytest.raises(ValueError, match=rf"^loss\.{key}=.* is invalid: contradicts {args[0]} .* make a loss={fits} "
                                         rf"loss; choose loss={fits}"):
        validate(cfg_of(*args))


def test_the_loss_names_are_one_table_the_yaml_files_and_the_schema_agree_with():
    """kdexp.losses.options.LOSS_NAMES is the one table of loss names: each conf/loss/<name>.yaml sets `name: <name>`
    of the table, each shipped name has its file, and the schema's default is one of them."""
    import yaml

    from kdexp.config.schema import LossConfig
    from kdexp.losses.options import LOSS_NAMES

    files = {p.stem: yaml.safe_load(p.read_text()) or {} for p in (REPO / "conf" / "loss").glob("*.yaml")}
    assert {stem: body.get("name", LossConfig.name) for stem, body in files.items()} == {n: n for n in LOSS_NAMES}
    assert LossConfig.name in LOSS_NAMES


def test_an_unknown_loss_name_is_refused_first():
    """Before the data, model or tokenizer checks (a bad data.max_chars in the same config is not the one named)."""
    with pytest.raises(ValueError, match=r"^loss\.name='nope' is invalid: must be one of sampled, top_p, renorm_topk, "
                                         r"topk, dense \(conf/loss/<name>\.yaml; a new loss registers its name with "
                                         r"kdexp\.objective\.register_loss\)$"):
        validate(cfg_of("loss.name=nope", "data.max_chars=100"))


@pytest.mark.parametrize("args", [
    ["loss.top_p=0.9"],  # a nucleus inside the default Top-K: still Top-K-bounded, the cached-teacher sweep
    ["loss=top_p", "loss.top_k=512"],  # a nucleus bounded by a Top-K
    ["loss=dense", "loss.temperature=2.0", "loss.divergence=jsd"],
    ["loss=renorm_topk", "loss.top_k=64"],
])
def test_options_that_keep_the_loss_name(args):
    validate(cfg_of(*args))


def test_tensor_parallel_needs_as_many_processes(monkeypatch):
    cfg = cfg_of("parallel.tensor=2")
    validate(cfg)  # a lone process may print or plan a TP=2 run
    with pytest.raises(ValueError, match=r"^parallel.tensor=2 is invalid: needs 2 processes .* this is one process: "
                                         r"launch with `torchrun --nproc-per-node 2 -m kdexp.run \.\.\.`"):
        check_launch(cfg)
    check_launch(cfg_of())
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    check_launch(cfg)
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match=r"must divide the world size 3 \(launched by torchrun\)$"):
        check_launch(cfg)


def test_the_megatron_optimizer_without_cuda_is_refused_before_any_work():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: trainer.optimizer=megatron is valid here")
    with pytest.raises(ValueError, match=r"^trainer.optimizer='megatron' is invalid: needs CUDA"):
        check_launch(cfg_of("trainer.optimizer=megatron"))
