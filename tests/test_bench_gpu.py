"""kdexp.bench.gpu (the GPU check) on a CPU machine: it imports, says plainly that there is no GPU, and its two checks
tell a CUDA run from a CPU fallback and kdexp's loss from a wrong one."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kdexp.bench import gpu


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the check runs for real there")
def test_without_a_gpu_it_exits_1_with_one_line():
    r = subprocess.run([sys.executable, "-m", "kdexp.bench.gpu"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [r.stderr.strip()]  # one line, no traceback
    assert r.stderr.startswith("kdexp.bench.gpu: no CUDA GPU: torch.cuda.is_available() is False")


def test_bad_arguments_exit_2():
    r = subprocess.run([sys.executable, "-m", "kdexp.bench.gpu", "--steps", "0"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2 and "--steps" in r.stderr


def test_loss_rows_agree_with_the_plain_version_and_catch_a_wrong_loss(monkeypatch):
    rows = gpu.loss_bench(tokens=4, vocab=2048, repeats=1, device="cpu")
    assert {(r["config"], r["dtype"]) for r in rows} == {(c, d) for c in ("dense", "topk", "topk_topp", "topp",
                                                                          "topk_renorm") for d in ("fp32", "bf16")}
    assert all(r["ok"] and r["max_abs_diff"] <= gpu.LOSS_TOL[r["dtype"]] for r in rows), rows
    import kdexp.losses

    real = kdexp.losses.logits_kd_loss
    monkeypatch.setattr(kdexp.losses, "logits_kd_loss", lambda s, t, **kw: real(s, t, **kw) * 1.01)
    assert not any(r["ok"] for r in gpu.loss_bench(tokens=4, vocab=2048, repeats=1, device="cpu"))


@pytest.mark.slow
def test_a_run_on_the_cpu_does_not_pass_as_a_gpu_run(tmp_path):
    import os

    out = gpu.distill(tmp_path, "float32", steps=2, cache=os.environ.get("KDEXP_CACHE"))  # conftest's session cache
    assert out["rc"] == 0 and out["status"] == "finished" and out["steps"] == 2, out
    assert out["saved_from"] == ["cpu"] and out["ok"] is False
    assert all(isinstance(out[k], float) for k in ("train/loss", "val/kl_to_teacher"))


@pytest.mark.slow
def test_the_on_policy_part_runs_and_reports_its_rollout_metrics_on_the_cpu(tmp_path):
    import os

    out = gpu.distill(tmp_path, "float32", steps=3, cache=os.environ.get("KDEXP_CACHE"), on_policy=True)
    assert out["rc"] == 0 and out["status"] == "finished" and out["on_policy"] is True, out
    for key in gpu.ON_POLICY_KEYS:  # the last step trained on the student's samples; every eval generated
        assert isinstance(out[key], float) and out[key] == out[key], (key, out)
    assert out["rollout/length"] > 0 and out["val/onpolicy_reverse_kl"] >= 0
    assert out["saved_from"] == ["cpu"] and out["ok"] is False  # a CPU run never passes as a GPU run


def test_modelopt_twins_are_reported_as_absent_when_it_is_not_installed():
    rows = gpu.loss_bench(tokens=2, vocab=1100, repeats=1, device="cpu")
    twins = [r for r in rows if r["config"] in gpu.MODELOPT_TWIN]
    assert len(twins) == 4 and all("modelopt_ms" in r for r in twins)
    from kdexp.bench.losses import modelopt_kd

    if modelopt_kd("dense", None) is None:
        assert all(r["modelopt_ms"] is None for r in twins)
    else:
        assert all(r["modelopt_ms"] > 0 and r["modelopt_max_abs_diff"] < 1e-2 for r in twins)


@pytest.mark.slow
def test_the_real_shape_part_runs_at_tiny_shapes_on_the_cpu():
    """Part 3 through its child process at tiny shapes: the trainer's setup and step run, the numbers are consistent
    with the plan, and a CPU run (no max_memory_allocated) does not pass as a GPU one."""
    import argparse

    from kdexp.bench import gpu_scale

    args = argparse.Namespace(teacher="tiny-teacher", student="tiny-student", scale_steps=2, lm_steps=1, seq=64,
                              micro=2, recompute="none", attention="sdpa")
    out = gpu.scale(args, "true")
    assert out.get("finite") is True and out["ok"] is False, out  # finite losses; no CUDA peak: not a pass
    assert out["fused_head"] == "true" and "head chunk working set" in out["plan_items_gib"]  # as set, and planned
    assert (out["precision"], out["params_dtype"], out["seq"], out["steps"]) == ("bf16", "bfloat16", 64, 2)
    assert out["kd_peak_gib"] is None and out["plan_peak_gib"] == pytest.approx(sum(out["plan_items_gib"].values()))
    assert out["kd_step_ms"] > 0 and out["kd_overhead"] == pytest.approx(out["kd_step_ms"] / out["lm_step_ms"] - 1)
    assert out["kd_tokens_per_s"] == pytest.approx(2 * 64 / (out["kd_step_ms"] / 1e3))
    assert out["peak_tflops"] == 989.0 and gpu_scale.PEAK_TFLOPS["H100"] == 989.0
    assert 0 < out["kd_mfu"] < 1e-3 and 0 < out["lm_mfu"] < 1e-3  # a CPU is far below a GPU's peak
    assert out["grad_dtypes"] and out["optimizer_state_dtypes"] and out["plan_precision"].startswith("bf16")
