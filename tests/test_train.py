"""The distillation run end to end (subprocesses, tiny models): run dir contents, resume after SIGKILL, TP=2 vs TP=1,
sweep re-runs that retrain nothing."""
from __future__ import annotations

import json

import pytest
from _launch import SIGNAL_RUN, comparable, kdexp_run, metrics, run_env, summary

pytestmark = pytest.mark.slow

SMOKE = ["experiment=smoke"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A cold KDEXP_CACHE, not conftest's seeded one: smoke_run, the module's first run, builds the data and pretrains
    the embedded teacher (its log says so); the module's other runs find them."""
    return run_env(tmp_path_factory.mktemp("kdexp_cache"))


@pytest.fixture(scope="module")
def smoke_run(env, tmp_path_factory):
    cwd = tmp_path_factory.mktemp("smoke")
    run_dir = cwd / "run"
    proc = kdexp_run([*SMOKE, f"hydra.run.dir={run_dir}", "trainer.export_hf=true"], env, cwd)
    return run_dir, proc


def test_run_dir_holds_config_metrics_checkpoints_wandb_summary(smoke_run):
    run_dir, proc = smoke_run
    assert (run_dir / ".hydra" / "config.yaml").is_file() and (run_dir / "run.log").is_file()
    s = summary(run_dir)
    assert s["status"] == "finished" and s["steps"] == 6 and s["reused_from"] is None
    for key in ("val/lm_loss", "val/kl_to_teacher", "val/top1_agreement", "train/kept_mass", "train/ghost_mass",
                "train/nucleus_size", "perf/tokens_per_s", "train/loss"):
        assert key in s["final"], key
    assert 0.0 < s["final"]["train/kept_mass"] <= 1.0 and 0.0 <= s["final"]["val/top1_agreement"] <= 1.0
    assert s["final"]["val/kl_to_teacher"] > 0
    train = metrics(run_dir, "train")
    assert [x["step"] for x in train] == [1, 2, 3, 4, 5, 6]
    assert [x["step"] for x in metrics(run_dir, "val")] == [3, 6]
    assert all(x["train/nucleus_size"] == pytest.approx(1024) for x in train)  # Top-K 1024 of 2048, no top_p
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "6"
    assert list((run_dir / "wandb").glob("offline-run-*")), "W&B offline run missing"
    log = proc.stdout + proc.stderr
    assert "stage teacher" in log and "kept" in log and "tok/s" in log and str(run_dir) in log


def test_exported_student_loads_in_transformers(smoke_run):
    import torch
    from transformers import AutoModelForCausalLM

    run_dir, _ = smoke_run
    model = AutoModelForCausalLM.from_pretrained(run_dir / "student_hf", dtype=torch.float32)
    assert model.config.model_type == "qwen3" and model.config.vocab_size == 2048
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 128  # tiny-student
    with torch.no_grad():
        logits = model(torch.arange(16)[None]).logits
    assert logits.shape == (1, 16, 2048) and torch.isfinite(logits).all()


def test_exported_student_generates_with_transformers_alone(smoke_run):
    """The run's own export (tests/test_export.py checks the files; here the run writes them): the shipped BPE's
    tokenizer and generation ids ride along, and generate stops at its eos."""
    from test_export import _generate, _stops_at_eos

    run_dir, _ = smoke_run
    _stops_at_eos(_generate(run_dir / "student_hf"), json.loads((run_dir / "student_hf" /
                                                                "generation_config.json").read_text())["eos_token_id"])


def test_rerun_in_same_dir_does_not_retrain(smoke_run, env):
    run_dir, _ = smoke_run
    before = summary(run_dir)
    proc = kdexp_run([*SMOKE, f"hydra.run.dir={run_dir}", "trainer.export_hf=true"], env, run_dir.parent)
    assert "already finished" in proc.stdout + proc.stderr
    assert summary(run_dir) == before


def test_sigkill_then_resume_matches_uninterrupted(smoke_run, env, tmp_path):
    reference, _ = smoke_run
    run_dir = tmp_path / "killed"
    args = [*SMOKE, f"hydra.run.dir={run_dir}", "trainer.checkpoint_interval=2", "trainer.export_hf=true"]
    proc = kdexp_run(args, env, tmp_path, check=False, kill_at=5)
    assert proc.returncode == -9, proc.stderr[-3000:]  # SIGKILL after step 5, last checkpoint at step 4
    assert not (run_dir / "summary.json").exists()
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "4"
    kdexp_run(args, env, tmp_path)
    assert comparable(summary(run_dir)["final"]) == pytest.approx(comparable(summary(reference)["final"]), rel=1e-5)
    resumed = metrics(run_dir, "train")
    assert [x["step"] for x in resumed] == [1, 2, 3, 4, 5, 6]  # the killed step 5 was dropped and redone
    for a, b in zip(resumed, metrics(reference, "train")):
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-5)


def test_sigterm_mid_step_checkpoints_that_step_and_the_printed_command_resumes_bit_exact(smoke_run, env, tmp_path):
    reference, _ = smoke_run
    run_dir = tmp_path / "preempted"
    args = [*SMOKE, f"hydra.run.dir={run_dir}", "trainer.export_hf=true"]  # checkpoints every 3 steps
    proc = kdexp_run(args, env, tmp_path, check=False, entry=SIGNAL_RUN, entry_args=["4", "TERM"])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 128 + 15, out[-3000:]  # 143: what a shell reports for a process SIGTERM ended
    (line,) = [x for x in out.splitlines() if "preempted by" in x]
    assert f"preempted by SIGTERM after step 4/6: checkpoint step 4 saved in {run_dir / 'checkpoints'}" in line
    assert "Traceback" not in out and not (run_dir / "summary.json").exists()
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "4"  # step 4 itself, not the periodic 3
    command = line.split("resume with: ")[1].split()
    assert command[:3] == ["python", "-m", "kdexp.run"] and f"hydra.run.dir={run_dir}" in command
    resumed = kdexp_run(command[3:], env, tmp_path, check=False)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from step 4" in resumed.stdout + resumed.stderr
    assert [x["step"] for x in metrics(run_dir, "train")] == [1, 2, 3, 4, 5, 6]  # each step once: none redone
    assert comparable(summary(run_dir)["final"]) == comparable(summary(reference)["final"])  # bit-exact
    assert [comparable(x) for x in metrics(run_dir, "train")] == [comparable(x) for x in metrics(reference, "train")]


# (overrides, launcher): one launch through kdexp's torchrun (docs/running.md), the same torchrun for a good run
TP2 = {"whole logits": (("loss.fused_head=false",), "torchrun"), "fused head": (("loss.fused_head=true",), "torchrun"),
       "fused head, SP": (("loss.fused_head=true", "parallel.sequence=true"), "kdexp")}


@pytest.mark.parametrize("overrides, launcher", TP2.values(), ids=TP2.keys())
def test_torchrun_tensor_parallel_2_matches_tp1(smoke_run, env, tmp_path, overrides, launcher):
    """TP 2 (whole logits, the fused head, the fused head under sequence parallelism) against the TP 1 smoke run on
    the default path: every step's losses and the final metrics within 1e-5 relative (measured ~1e-7: only the
    summation order of the TP reductions differs; val/onpolicy_reverse_kl too: the student's continuations are TP 1's),
    and the exported weights gathered from the two shards."""
    reference, _ = smoke_run
    run_dir = tmp_path / "tp2"
    kdexp_run([*SMOKE, f"hydra.run.dir={run_dir}", "parallel.tensor=2", "logger=none", "trainer.export_hf=true",
               *overrides], env, tmp_path, torchrun=2, launcher=launcher)
    tp2, tp1 = metrics(run_dir, "train"), metrics(reference, "train")
    assert len(tp2) == len(tp1) == 6
    for a, b in zip(tp2, tp1):
        for key in ("train/loss", "train/lm_loss", "train/kd_loss", "train/kept_mass"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (a["step"], key)
    want = comparable(summary(reference)["final"])
    if "parallel.sequence=true" in overrides:  # no generation under sequence parallelism: no on-policy eval metric
        del want["val/onpolicy_reverse_kl"]
    assert comparable(summary(run_dir)["final"]) == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tp2"]  # one run dir for both ranks
    from safetensors.torch import load_file

    w1 = load_file(reference / "student_hf" / "model.safetensors")
    w2 = load_file(run_dir / "student_hf" / "model.safetensors")  # gathered from the two TP shards
    assert w1.keys() == w2.keys()
    for name in w1:
        # Adam turns float-level differences of near-zero gradients into lr-sized steps, so after 6 steps the weights
        # agree to ~0.5% (q/k norms) while the losses agree to 1e-4; a wrongly gathered shard would be off by ~100%.
        assert (w1[name] - w2[name]).norm() <= 1e-2 * w1[name].norm(), name


def test_identical_sweep_rerun_retrains_nothing(env, tmp_path):
    args = ["-m", *SMOKE, "trainer.max_steps=2", "trainer.eval_interval=2", "logger=none", "balancer.alpha=0.5,1.0"]
    first, second = tmp_path / "first", tmp_path / "second"  # a re-run goes to a new sweep dir, as by default
    kdexp_run([*args, f"hydra.sweep.dir={first}"], env, tmp_path)
    kdexp_run([*args, f"hydra.sweep.dir={second}"], env, tmp_path)
    for num in ("0", "1"):
        a, b = summary(first / num), summary(second / num)
        assert a["reused_from"] is None and b["reused_from"] == str((first / num).resolve())
        assert b["final"] == a["final"] and b["config_hash"] == a["config_hash"]
        assert not (second / num / "checkpoints").exists()  # nothing was retrained
        assert json.loads((second / num / "point.json").read_text())["status"] == "reused"
        # the reused point holds its own copy of the curves (and the W&B id, none with logger=none)
        assert (second / num / "metrics.jsonl").read_bytes() == (first / num / "metrics.jsonl").read_bytes()
        assert b["wandb_id"] is None
    first.rename(tmp_path / "moved")  # the sweep the points came from moves: they keep their curves
    from kdexp.report.rundirs import load_sweep

    for p in load_sweep(second).points:
        assert p.status == "finished" and [s for s, _ in p.curves["train/loss"]] == [1, 2]


def test_rerun_with_another_config_is_refused_unless_asked_to_start_over(env, tmp_path):
    run_dir = tmp_path / "run"
    base = [*SMOKE, "trainer.max_steps=2", "trainer.eval_interval=2", "logger=none", f"hydra.run.dir={run_dir}"]
    kdexp_run([*base, "balancer.alpha=0.9"], env, tmp_path)
    first = summary(run_dir)
    kept = {p: p.read_bytes() for p in [run_dir / "metrics.jsonl", run_dir / "summary.json",
                                         *sorted((run_dir / "checkpoints").rglob("*.pt"))]}
    refused = kdexp_run([*base, "balancer.alpha=0.5"], env, tmp_path, check=False)
    assert refused.returncode == 2, refused.stderr[-3000:]
    other = json.loads((run_dir / "run.json").read_text())["config_hash"]
    assert other == first["config_hash"]
    [line] = refused.stderr.splitlines()
    assert line.startswith(f"kdexp: error: {run_dir} holds the run of another config ({other}; this config is ")
    assert line.endswith("use another run dir (hydra.run.dir=...), or trainer.overwrite=true to delete that run and "
                         "start over")
    assert all(p.read_bytes() == data for p, data in kept.items())  # nothing of the first run was touched
    kdexp_run([*base, "balancer.alpha=0.5", "trainer.overwrite=true"], env, tmp_path)
    second = summary(run_dir)
    assert second["config_hash"] != first["config_hash"] and "balancer.alpha=0.5" in second["overrides"]
    assert second["final"]["train/loss"] != first["final"]["train/loss"]
    assert [x["step"] for x in metrics(run_dir, "train")] == [1, 2]  # retrained from step 0, old lines dropped


def test_kd_lowers_kl_to_teacher_against_lm_only(smoke_run, env, tmp_path):
    kd_run, _ = smoke_run  # balancer.alpha=0.9 (the default)
    lm_only = tmp_path / "lm_only"
    kdexp_run([*SMOKE, f"hydra.run.dir={lm_only}", "logger=none", "balancer.alpha=0.0"], env, tmp_path)
    # same seed, same data, same initial student: the first step's LM loss is the same number in both runs
    assert metrics(lm_only, "train")[0]["train/lm_loss"] == pytest.approx(metrics(kd_run, "train")[0]["train/lm_loss"],
                                                                          rel=1e-6)
    kd_kl = [x["val/kl_to_teacher"] for x in metrics(kd_run, "val")]
    lm_kl = [x["val/kl_to_teacher"] for x in metrics(lm_only, "val")]
    # measured: KD 0.74 / 0.51 vs LM-only 1.10 / 0.94 at steps 3 / 6; a quarter lower is far outside run noise (none:
    # the runs are deterministic) yet leaves room for loss numerics to move
    assert all(k < 0.75 * m for k, m in zip(kd_kl, lm_kl)), (kd_kl, lm_kl)
    assert summary(kd_run)["final"]["val/kl_to_teacher"] < 0.75 * summary(lm_only)["final"]["val/kl_to_teacher"]


def test_a_resumed_sweep_point_holds_the_full_history(env, tmp_path):
    args = ["-m", *SMOKE, "logger=none", "trainer.checkpoint_interval=2", "balancer.alpha=0.5"]
    first, second = tmp_path / "first", tmp_path / "second"
    killed = kdexp_run([*args, f"hydra.sweep.dir={first}"], env, tmp_path, check=False, kill_at=5)
    assert killed.returncode == -9 and (first / "0" / "checkpoints" / "latest").read_text().strip() == "4"
    before = metrics(first / "0", "train")
    assert [x["step"] for x in before] == [1, 2, 3, 4, 5]
    proc = kdexp_run([*args, f"hydra.sweep.dir={second}"], env, tmp_path)  # a new sweep dir: resumes the old point
    assert "resuming from step 4" in proc.stdout + proc.stderr
    point = second / "0"
    train, val = metrics(point, "train"), metrics(point, "val")
    assert [x["step"] for x in train] == [1, 2, 3, 4, 5, 6]  # from step 1, the killed step 5 once (redone)
    assert [x["step"] for x in val] == [3, 6]
    for a, b in zip(train[:4], before[:4]):  # steps 1-4 are the earlier run's lines
        assert a == b
    assert train[4]["train/loss"] == pytest.approx(before[4]["train/loss"], rel=1e-5)  # step 5 recomputed alike
    assert summary(point)["status"] == "finished" and summary(point)["reused_from"] is None


def test_step_bench_runs_through_the_trainers_setup(env, tmp_path):
    proc = kdexp_run(["--steps", "2", "--warmup", "1", *SMOKE, "logger=none"], env, tmp_path, check=False,
                     entry="kdexp.bench.step")
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout.splitlines()
    assert out[0] == "loss=topk top_k=1024 top_p=None vocab=2048 tokens/step=128 device=cpu steps=2 teacher=online"
    times = {line[:40].strip(): float(line[40:]) for line in out[2:4]}
    assert sorted(times) == ["KD train step (teacher, student, KD+LM)", "teacher fwd + student fwd+bwd (LM)"]
    assert all(v > 0 for v in times.values()) and out[4].startswith("KD overhead: ")
    bad = kdexp_run(["--steps", "0"], env, tmp_path, check=False, timeout=300, entry="kdexp.bench.step")
    assert bad.returncode == 2 and "--steps must be >= 1" in bad.stderr


def test_torchrun_sequence_parallel_matches_tp1_and_resumes_bit_exact(smoke_run, env, tmp_path):
    """parallel.tensor=2 parallel.sequence=true: the same losses and final metrics as TP 1 (measured ~1e-7 apart:
    only the TP reductions' summation order differs), and a run SIGKILLed after step 5 (last checkpoint at step 4)
    resumes to exactly the uninterrupted SP run's losses and final metrics."""
    reference, _ = smoke_run
    sp = [*SMOKE, "logger=none", "parallel.tensor=2", "parallel.sequence=true"]
    whole = tmp_path / "sp"
    kdexp_run([*sp, f"hydra.run.dir={whole}"], env, tmp_path, torchrun=2)
    for a, b in zip(metrics(whole, "train"), metrics(reference, "train"), strict=True):
        for key in ("train/loss", "train/lm_loss", "train/kd_loss", "train/kept_mass"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (a["step"], key)
    want = comparable(summary(reference)["final"])
    del want["val/onpolicy_reverse_kl"]  # no generation under sequence parallelism: no on-policy eval metric
    assert comparable(summary(whole)["final"]) == pytest.approx(want, rel=1e-5, abs=1e-6)
    killed = tmp_path / "sp_killed"
    args = [*sp, f"hydra.run.dir={killed}", "trainer.checkpoint_interval=2"]
    proc = kdexp_run(args, env, tmp_path, check=False, torchrun=2, kill_at=5)
    assert proc.returncode != 0 and not (killed / "summary.json").exists(), proc.stderr[-3000:]
    assert (killed / "checkpoints" / "latest").read_text().strip() == "4"
    kdexp_run(args, env, tmp_path, torchrun=2)
    resumed = metrics(killed, "train")
    assert [x["step"] for x in resumed] == [1, 2, 3, 4, 5, 6]
    assert [x["train/loss"] for x in resumed] == [x["train/loss"] for x in metrics(whole, "train")]
    assert comparable(summary(killed)["final"]) == comparable(summary(whole)["final"])
