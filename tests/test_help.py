"""`python -m kdexp.run --help`: kdexp's header and examples first, every config group with its options and every
schema key with its default, then Hydra's flags. The keys are collected here independently of kdexp.config.help
(OmegaConf's view of the schema), so a key the page misses fails."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from _launch import kdexp_run

ROOT = Path(__file__).resolve().parents[1]


def _leaves(node, prefix=""):
    for key, value in node.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


@pytest.fixture(scope="module")
def page():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = kdexp_run(["--help"], env, ROOT, check=False, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_header_and_examples_first_then_hydra_flags(page):
    assert page.startswith("kdexp.run: one knowledge-distillation run")
    assert "powered by Hydra" not in page
    for example in ("python -m kdexp.run loss=top_p loss.top_p=0.9 -m balancer.alpha=0.5,0.9,1.0",
                    "hydra/launcher=slurm_gpu"):
        assert example in page.split("== Config groups", 1)[0]
    flags = page.split("== Hydra flags ==", 1)[1]
    assert "--multirun,-m" in flags and "--cfg,-c" in flags and "--hydra-help" in flags


def test_every_schema_key_with_its_default(page):
    from kdexp.config.schema import KdexpConfig

    lines = page.split("== Keys", 1)[1].split("== Hydra flags ==", 1)[0].splitlines()
    heads = {line.split(":", 1)[0]: line for line in lines if line and not line.startswith(" ")}
    schema = OmegaConf.to_container(OmegaConf.structured(KdexpConfig), resolve=False)
    missing = []
    for key, default in _leaves(schema):
        if key not in heads:
            missing.append(key)
            continue
        shown = "null" if default is None else str(default).lower() if isinstance(default, bool) else str(default)
        assert heads[key].endswith("= " + shown) or default == "???", (key, heads[key], shown)
    assert not missing, f"--help lacks schema keys: {missing}"


def test_every_group_option_and_the_choices_read_from_the_rules(page):
    groups = page.split("== Config groups", 1)[1].split("== Keys", 1)[0]
    for group, options in {"loss": "topk*, dense, renorm_topk, sampled, top_p", "teacher": "online*, cached",
                           "hydra/launcher": "basic*, local_cpu, slurm_cpu, slurm_gpu",
                           "rollout": "off*, on_policy",
                           "arm": "after, before, k128_ghost, k128_renorm, k32_ghost, k32_renorm, k8_ghost, k8_renorm, "
                                  "op_ghost, op_mix, op_off, op_renorm, op_sampled_token, sampled, top_p, topp_k128, "
                                  "topp_k32, topp_k8"}.items():
        assert f"\n{group}: {options}\n" in groups, group
    keys = page.split("== Keys", 1)[1]
    for key, allowed in {"trainer.precision": "one of fp32, bf16", "trainer.seed": "an integer >= 0 and < 4294967296",
                         "loss.divergence": "one of forward_kl, reverse_kl, jsd", "balancer.alpha": "a number in [0, 1]",
                         "teacher.dtype": "one of float32, bfloat16, float16", "loss.top_p": "in (0, 1]"}.items():
        block = keys.split(f"\n{key}:", 1)[1].split("\n", 2)[1]
        assert f"allowed: {allowed}" in block, (key, block)


def test_common_groups_first_presets_last_and_no_code_names(page):
    groups = page.split("== Config groups", 1)[1].split("== Keys", 1)[0]
    order = [line.split(":", 1)[0] for line in groups.splitlines() if line and not line.startswith(" ")]
    assert order[:7] == ["model", "loss", "balancer", "teacher", "rollout", "data", "trainer"], order
    assert order[-2:] == ["experiment", "arm"], order
    keys = page.split("== Keys", 1)[1].split("== Hydra flags ==", 1)[0]
    heads = [line.split(":", 1)[0] for line in keys.splitlines() if line and not line.startswith(" ")]
    assert [h.split(".")[0] for h in heads][:1] == ["model"] and heads.index("experiment_arm") > heads.index(
        "trainer.seed"), heads
    import re

    assert not re.findall(r"one of [A-Z][A-Z_]+|: Any\b|\bNone\b", page.split("== Hydra flags ==", 1)[0])


def test_model_keys_list_the_qwen3_sizes(page):
    from kdexp.config.qwen3 import QWEN3_SIZES

    keys = page.split("== Keys", 1)[1]
    for key in ("model.teacher", "model.student"):
        block = keys.split(f"\n{key}:", 1)[1].split("\n", 2)[1]
        listed = block.split("allowed: one of ", 1)[1].split(";", 1)[0].split(", ")
        assert sorted(listed) == sorted(QWEN3_SIZES) and listed[:3] == ["0.6b", "1.7b", "4b"], (key, block)


def test_hydra_help_is_still_hydras(page):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = kdexp_run(["--hydra-help"], env, ROOT, check=False, timeout=300)
    assert proc.returncode == 0 and "hydra/launcher:" in proc.stdout and "submitit_slurm" in proc.stdout, proc.stdout


def test_plan_help_explains_every_line_of_its_table(capsys):
    from kdexp.plan.__main__ import main

    with pytest.raises(SystemExit) as stop:
        main(["--help"])
    assert stop.value.code == 0
    page = capsys.readouterr().out
    assert main(["--gpus", "8", "model=qwen3", "parallel.tensor=2", "trainer.gpu_memory_gb=79.6"]) == 0
    table = capsys.readouterr().out
    explained = page.split("how to read the table:", 1)[1]
    for label in ("peak allocated", "reserve", "needs", "FLOPs per token", "tokens/s at MFU"):
        assert any(line.startswith(label) for line in table.splitlines()), (label, table)
        assert f"\n  {label}" in explained, label
    assert "fits trainer.gpu_memory_gb=79.6" in table and '"fits"' in explained
