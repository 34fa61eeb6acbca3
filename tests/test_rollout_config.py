"""The rollout group: both options compose and validate; every rollout key's bad value is one line naming the key,
the value and the allowed range, before anything is built (and exit status 2 through the command line)."""
from __future__ import annotations

import re

import pytest
from omegaconf import OmegaConf

from kdexp.config import KdexpConfig, validate
from _launch import kdexp_run, run_env
from test_config import cfg_of

ON = ["rollout=on_policy", "trainer.seq_length=64"]

BAD = [
    (["rollout.name=online"], "rollout.name='online'", "one of off, on_policy"),
    ([*ON, "rollout.on_policy_fraction=1.5"], "rollout.on_policy_fraction=1.5", r"in \[0, 1\]$"),
    ([*ON, "rollout.on_policy_fraction=-0.1"], "rollout.on_policy_fraction", r"\[0, 1\]"),
    ([*ON, "rollout.on_policy_fraction=nan"], "rollout.on_policy_fraction", "finite"),
    (["rollout.on_policy_fraction=0.5"], "rollout.on_policy_fraction=0.5", "must be 0 with rollout=off"),
    (["rollout.estimator=sampled_token"], "rollout.estimator", "read by rollout=on_policy only"),
    (["rollout.warmup_steps=3"], "rollout.warmup_steps=3", "read by rollout=on_policy only"),
    ([*ON, "rollout.prompt_tokens=0"], "rollout.prompt_tokens=0", ">= 1"),
    (["rollout.prompt_tokens=300"], "rollout.prompt_tokens=300", r"\[1, trainer.seq_length=256\]"),
    ([*ON, "rollout.max_new_tokens=0"], "rollout.max_new_tokens=0", ">= 1"),
    (["rollout.max_new_tokens=5000"], "rollout.max_new_tokens=5000", "max_position_embeddings"),
    ([*ON, "rollout.max_new_tokens=49"], "rollout.max_new_tokens=49", r"\[1, 48\] with rollout=on_policy"),
    ([*ON, "rollout.temperature=0"], "rollout.temperature=0.0", "> 0"),
    ([*ON, "rollout.temperature=inf"], "rollout.temperature", "finite"),
    ([*ON, "rollout.top_p=0"], "rollout.top_p=0.0", r"in \(0, 1\]$"),
    ([*ON, "rollout.top_p=1.2"], "rollout.top_p", r"\(0, 1\]"),
    ([*ON, "rollout.estimator=reinforce"], "rollout.estimator='reinforce'", "distribution, sampled_token"),
    ([*ON, "rollout.warmup_steps=-1"], "rollout.warmup_steps=-1", ">= 0"),
    ([*ON, "rollout.warmup_steps=201"], "rollout.warmup_steps=201", r"\[0, trainer.max_steps=200\]"),
    ([*ON, "teacher=cached"], "teacher.name='cached'", "online with rollout=on_policy"),
    ([*ON, "rollout.prompts=/nonexistent/p.jsonl"], "rollout.prompts='/nonexistent/p.jsonl'", "no such file$"),
    (["rollout.prompts=/nonexistent/p.jsonl"], "rollout.prompts", "read by rollout=on_policy only"),
]


@pytest.fixture(autouse=True)
def _temp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KDEXP_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("WORLD_SIZE", raising=False)


@pytest.mark.parametrize("overrides, key, allowed", BAD)
def test_bad_rollout_values_name_the_key(overrides, key, allowed):
    with pytest.raises(ValueError) as err:
        validate(cfg_of(*overrides))
    message = str(err.value)
    assert "\n" not in message, message
    assert message.startswith(key), message
    assert re.search(allowed, message), message


def test_every_rollout_key_has_a_bad_case():
    keys = {re.match(r"[\w.]+", key).group(0) for _, key, _ in BAD}
    for name in OmegaConf.structured(KdexpConfig).rollout:
        assert f"rollout.{name}" in keys, name


def test_both_options_compose_and_validate():
    off = cfg_of()
    validate(off)
    assert (off.rollout.name, off.rollout.on_policy_fraction) == ("off", 0.0)
    on = cfg_of(*ON, "rollout.estimator=sampled_token", "rollout.on_policy_fraction=0.5", "rollout.warmup_steps=2")
    validate(on)
    assert (on.rollout.name, on.rollout.on_policy_fraction, on.rollout.estimator) == ("on_policy", 0.5,
                                                                                       "sampled_token")
    assert cfg_of("rollout=off").rollout.name == "off"  # the bare word, not YAML's boolean


def test_a_bad_rollout_value_is_one_line_exit_2_before_any_work(tmp_path):
    env = run_env(tmp_path / "cache", WANDB_MODE="disabled")
    run_dir = tmp_path / "run"
    r = kdexp_run(["rollout=on_policy", "rollout.temperature=-1", f"hydra.run.dir={run_dir}"], env, tmp_path,
                  check=False)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.splitlines() == ["kdexp: error: rollout.temperature=-1.0 is invalid: must be a finite number > 0"]
    assert not run_dir.exists() and not (tmp_path / "cache").exists()
