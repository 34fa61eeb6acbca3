"""On-policy runs through the command line: a smoke run finishes with the rollout/* metrics on its on-policy steps and
val/onpolicy_reverse_kl at every eval (metrics.jsonl, summary.json, TensorBoard); a run stopped by SIGTERM on the step
before an on-policy one and resumed ends with every metric of the uninterrupted run (the sampler's streams are keyed
by the run seed, the step and the global sample index); a sweep over rollout.on_policy_fraction finishes."""
from __future__ import annotations

import pytest

from _launch import SIGNAL_RUN, comparable, kdexp_run, metrics, summary

pytestmark = pytest.mark.slow

# steps 1..6: warmup 1, then half the steps on-policy (0-based steps 2 and 4: logged steps 3 and 5)
ON = ["experiment=smoke", "rollout=on_policy", "rollout.on_policy_fraction=0.5", "rollout.warmup_steps=1",
      "rollout.estimator=sampled_token", "rollout.max_new_tokens=12", "rollout.prompt_tokens=8"]
ROLLOUT_KEYS = ("rollout/kd_loss", "rollout/length", "rollout/truncated_fraction", "rollout/entropy",
                "rollout/student_logprob", "rollout/teacher_logprob", "rollout/importance_ratio",
                "rollout/importance_ratio_std")


@pytest.fixture(scope="module")
def reference(env, tmp_path_factory):
    cwd = tmp_path_factory.mktemp("onpolicy")
    run_dir = cwd / "run"
    kdexp_run([*ON, f"hydra.run.dir={run_dir}"], env, cwd)
    return run_dir


def test_an_on_policy_smoke_run_logs_the_rollout_metrics(reference):
    train = metrics(reference, "train")
    on = [x["step"] for x in train if x["rollout/on_policy_fraction"] == 1.0]
    assert on == [3, 5]
    for x in train:
        if x["step"] in on:
            assert all(k in x for k in ROLLOUT_KEYS) and "train/lm_loss" not in x, x
            assert 1 <= x["rollout/length"] <= 12 and 0 <= x["rollout/truncated_fraction"] <= 1
            assert x["rollout/student_logprob"] < 0 and x["rollout/teacher_logprob"] < 0 and x["rollout/entropy"] > 0
            assert x["train/loss"] == x["rollout/kd_loss"]
        else:
            assert not any(k in x for k in ROLLOUT_KEYS) and "train/lm_loss" in x, x
    val = metrics(reference, "val")
    assert [x["step"] for x in val] == [3, 6] and all(x["val/onpolicy_reverse_kl"] > 0 for x in val)
    final = summary(reference)["final"]
    assert final["val/onpolicy_reverse_kl"] == val[-1]["val/onpolicy_reverse_kl"]
    from test_tensorboard import _events

    tags = {v.tag for e in _events(reference) for v in e.summary.value}
    assert {"rollout/kd_loss", "rollout/importance_ratio_std", "val/onpolicy_reverse_kl"} <= tags


def test_sigterm_before_an_on_policy_step_then_resume_matches_the_uninterrupted_run(reference, env, tmp_path):
    run_dir = tmp_path / "preempted"
    args = [*ON, f"hydra.run.dir={run_dir}"]
    proc = kdexp_run(args, env, tmp_path, check=False, entry=SIGNAL_RUN, entry_args=["4", "TERM"])
    assert proc.returncode == 128 + 15, (proc.stdout + proc.stderr)[-3000:]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "4"
    resumed = kdexp_run(args, env, tmp_path)
    assert "resuming from step 4" in resumed.stdout + resumed.stderr
    assert [x["step"] for x in metrics(run_dir, "train")] == [1, 2, 3, 4, 5, 6]
    assert [comparable(x) for x in metrics(run_dir, "train")] == [comparable(x) for x in metrics(reference, "train")]
    assert metrics(run_dir, "val") == metrics(reference, "val")
    assert comparable(summary(run_dir)["final"]) == comparable(summary(reference)["final"])


def test_a_sweep_over_the_on_policy_fraction_finishes(env, tmp_path):
    sweep_dir = tmp_path / "sweep"
    kdexp_run(["experiment=smoke", "rollout=on_policy", "rollout.max_new_tokens=8", "trainer.max_steps=2",
               "trainer.warmup_steps=1", "trainer.eval_interval=2", "trainer.checkpoint_interval=2", "logger=none",
               "-m", "rollout.on_policy_fraction=0,0.5,1", f"hydra.sweep.dir={sweep_dir}"], env, tmp_path)
    seen = {}
    for point in sorted(p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()):
        s = summary(point)
        assert s["status"] == "finished" and s["steps"] == 2
        steps = [x.get("rollout/on_policy_fraction") for x in metrics(point, "train")]
        seen[tuple(steps)] = s["final"]["val/onpolicy_reverse_kl"]
    assert set(seen) == {(0.0, 0.0), (0.0, 1.0), (1.0, 1.0)}


def test_the_step_benchmark_times_an_on_policy_step_in_three_parts(env, tmp_path):
    """docs/on-policy.md's `kdexp.bench.step rollout=on_policy` line at smoke sizes: generation, teacher scoring and
    update each timed, their sum printed beside the run's own (here on-policy) KD step."""
    bench = kdexp_run(["--steps", "2", "--warmup", "1", "experiment=smoke", "rollout=on_policy",
                       "rollout.max_new_tokens=8"], env, tmp_path, check=False, entry="kdexp.bench.step")
    assert bench.returncode == 0, bench.stderr[-4000:]
    rows = {line[:40].strip(): float(line[40:]) for line in bench.stdout.splitlines()[2:]
            if line.startswith(("on-policy step", "KD train step", "teacher fwd"))}
    parts = [rows[f"on-policy step: {k}"] for k in ("generation", "teacher scoring", "update")]
    assert all(v > 0 for v in parts) and rows["on-policy step (sum of the parts)"] == pytest.approx(sum(parts),
                                                                                                   abs=0.2)
    assert "KD train step (teacher, student, KD+LM)" in rows
