"""Divergence: a non-finite loss or gradient norm stops the run before the update (exit 1, one line naming the step,
summary.json status "diverged", strict JSON, the last finite checkpoint kept), or is skipped up to
trainer.skip_nonfinite times and counted; a rerun of a diverged config is refused.

Unit tests drive kdexp.train.step.NonFiniteGuard on tiny tensors; the end-to-end tests run `experiment=smoke` in a
subprocess, either with trainer.lr=1e6 or through tests/_nan_run.py, which poisons the backward pass of chosen steps.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from kdexp.train.errors import Diverged
from _launch import NAN_RUN, kdexp_run
from kdexp.train.step import NonFiniteGuard, apply_update, state_finite

SMOKE = ["experiment=smoke", "logger=none"]


# ---------------------------------------------------------------------------------------------------------------------
# the guard on tiny tensors

def _t(x):
    return torch.tensor(x, dtype=torch.float32)


def test_guard_applies_finite_steps_and_skips_up_to_its_limit():
    guard = NonFiniteGuard(2)
    assert guard.check_step(1, _t(1.0), _t(0.5)) is True
    assert guard.check_step(2, _t(math.nan), _t(0.5)) is False  # a non-finite loss alone is enough
    assert guard.check_step(3, _t(1.0), _t(math.inf)) is False  # so is a non-finite gradient norm alone
    assert guard.skipped == 2
    with pytest.raises(Diverged) as info:
        guard.check_step(4, _t(1.0), _t(-math.inf), metrics={"train/loss": 1.5}, checkpoint=3)
    err = info.value
    assert (err.step, err.skipped, err.checkpoint, err.metrics) == (4, 2, 3, {"train/loss": 1.5})
    assert str(err).startswith("diverged at step 4: non-finite train/grad_norm")
    assert "last finite checkpoint: step 3" in str(err) and "2 non-finite step(s) skipped before" in str(err)


def test_guard_without_budget_stops_at_the_first_bad_step_and_says_how_to_skip():
    with pytest.raises(Diverged) as info:
        NonFiniteGuard(0).check_step(7, _t(math.nan), _t(math.nan))
    assert info.value.step == 7 and info.value.checkpoint is None
    assert "non-finite train/loss and train/grad_norm" in str(info.value)
    assert "no checkpoint was saved" in str(info.value) and "trainer.skip_nonfinite=N" in str(info.value)
    with pytest.raises(ValueError, match="trainer.skip_nonfinite=-1"):
        NonFiniteGuard(-1)


def test_guard_eval_and_state_checks_are_not_skippable_and_say_the_update_happened():
    guard = NonFiniteGuard(5)  # a skip budget does not cover bad weights: there is nothing left to skip
    guard.check_values(3, {"val/lm_loss": 2.0}, "eval metrics")
    with pytest.raises(Diverged, match=r"step 3: non-finite eval metrics \{'val/lm_loss': nan\}; stopped after"):
        guard.check_values(3, {"val/lm_loss": math.nan, "val/kl": 1.0}, "eval metrics")
    good, bad = torch.ones(3), torch.tensor([1.0, math.inf])
    guard.check_state(3, [good, torch.arange(3)])  # integer tensors are not checked
    with pytest.raises(Diverged, match="non-finite weights or optimizer state; stopped before saving them"):
        guard.check_state(3, [good, bad], checkpoint=2)
    assert state_finite([good]) and not state_finite([bad])


def test_a_skipped_update_leaves_weights_and_optimizer_state_untouched():
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(layer.parameters(), lr=0.1)
    layer(torch.randn(4, 3)).sum().backward()
    apply_update(opt, True)
    before = [p.detach().clone() for p in layer.parameters()]
    moments = [s["exp_avg"].clone() for s in opt.state.values()]
    layer(torch.randn(4, 3)).sum().backward()
    apply_update(opt, False)
    assert all(p.grad is None for p in layer.parameters())  # nothing of the bad step reaches a later step
    opt.step()  # even a later step without gradients changes nothing
    assert all(torch.equal(a, p) for a, p in zip(before, layer.parameters()))
    assert all(torch.equal(m, s["exp_avg"]) for m, s in zip(moments, opt.state.values()))


# ---------------------------------------------------------------------------------------------------------------------
# end to end


def _raise(token):
    raise ValueError(f"bare {token} in JSON")


def strict(text: str):
    return json.loads(text, parse_constant=_raise)


def assert_strict_json_everywhere(run_dir: Path) -> None:
    """summary.json, metrics.jsonl, point files: parseable by a strict reader, no bare NaN/Infinity."""
    files = [p for p in run_dir.rglob("*.json")] + [run_dir / "metrics.jsonl"]
    assert run_dir / "summary.json" in files
    for path in files:
        for line in (path.read_text().splitlines() if path.suffix == ".jsonl" else [path.read_text()]):
            strict(line)


def checkpoint_states(run_dir: Path) -> dict[int, dict]:
    ckpt = run_dir / "checkpoints"
    return {int(p.name[5:]): torch.load(p / "tp0.pt", weights_only=False) for p in sorted(ckpt.glob("step_*"))}


def all_finite(state: dict) -> bool:
    tensors = [*state["model"].values(), *(v for s in state["optimizer"]["state"].values() for v in s.values())]
    return all(torch.isfinite(t).all() for t in tensors if torch.is_tensor(t) and t.is_floating_point())


def train_lines(run_dir: Path) -> list[dict]:
    lines = [strict(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if x["kind"] == "train"]


def kdexp_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("kdexp:")]


@pytest.mark.slow
def test_lr_1e6_diverges_keeps_finite_checkpoints_and_a_rerun_is_refused(env, tmp_path):
    run_dir = tmp_path / "run"
    args = [*SMOKE, "trainer.lr=1e6", "trainer.checkpoint_interval=1", f"hydra.run.dir={run_dir}"]
    r = kdexp_run(args, env, tmp_path, check=False)
    assert r.returncode == 1, r.stderr[-4000:]
    summary = strict((run_dir / "summary.json").read_text())
    step = summary["step"]
    assert summary["status"] == "diverged" and 1 < step <= 6
    (line,) = kdexp_lines(r.stderr)
    assert line.startswith(f"kdexp: diverged at step {step}: non-finite ") and r.stderr.splitlines()[-1] == line
    assert "Traceback" not in r.stdout + r.stderr
    assert_strict_json_everywhere(run_dir)
    assert f"diverged at step {step}" in (run_dir / "error.log").read_text()
    assert f"diverged at step {step}" in (run_dir / "run.log").read_text()
    # every step before the bad one was saved (interval 1, keep 2): the last two, finite, the newest one kept
    states = checkpoint_states(run_dir)
    assert sorted(states) == [s for s in (step - 2, step - 1) if s >= 1]
    assert all(all_finite(s) for s in states.values())
    assert summary["checkpoint"] == step - 1 == int((run_dir / "checkpoints" / "latest").read_text())
    assert all(math.isfinite(v) for v in summary["final"].values())
    assert [x["step"] for x in train_lines(run_dir)] == list(range(1, step))  # nothing logged for the bad step

    again = kdexp_run(args, env, tmp_path, check=False)
    assert again.returncode == 1
    (refused,) = kdexp_lines(again.stderr)
    assert "this config diverged before" in refused and f"at step {step}" in refused and line[7:] in refused
    assert strict((run_dir / "summary.json").read_text()) == summary  # not retrained
    assert checkpoint_states(run_dir).keys() == states.keys()


@pytest.mark.slow
def test_injected_nan_stops_before_the_update_and_the_last_finite_checkpoint_is_kept(env, tmp_path):
    run_dir = tmp_path / "run"
    r = kdexp_run([*SMOKE, "trainer.checkpoint_interval=1", f"hydra.run.dir={run_dir}"], env, tmp_path, check=False,
                  entry=NAN_RUN, entry_args=["5"])
    assert r.returncode == 1, r.stderr[-4000:]
    (line,) = kdexp_lines(r.stderr)
    assert line.startswith("kdexp: diverged at step 5: non-finite train/loss and train/grad_norm (train/loss=inf, "
                           "train/grad_norm=nan); stopped before the weights changed (last finite checkpoint: step 4)")
    summary = strict((run_dir / "summary.json").read_text())
    assert (summary["status"], summary["step"], summary["checkpoint"], summary["skipped_steps"]) == (
        "diverged", 5, 4, 0)
    assert_strict_json_everywhere(run_dir)
    states = checkpoint_states(run_dir)
    assert sorted(states) == [3, 4] and all(all_finite(s) for s in states.values())
    assert summary["final"]["train/loss"] == pytest.approx(train_lines(run_dir)[-1]["train/loss"])
    assert summary["final"]["val/lm_loss"] > 0  # the last finite eval (step 3) is part of it


@pytest.mark.slow
def test_skip_nonfinite_skips_and_counts_bad_steps_and_the_run_finishes(env, tmp_path):
    run_dir = tmp_path / "run"
    args = [*SMOKE, "trainer.skip_nonfinite=2", "trainer.checkpoint_interval=1", f"hydra.run.dir={run_dir}"]
    r = kdexp_run(args, env, tmp_path, check=False, entry=NAN_RUN, entry_args=["2,6"])
    assert r.returncode == 0, r.stderr[-4000:]
    summary = strict((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["skipped_steps"] == 2
    assert summary["final"]["train/skipped_steps"] == 2
    assert_strict_json_everywhere(run_dir)
    lines = train_lines(run_dir)
    assert [x["step"] for x in lines] == [1, 2, 3, 4, 5, 6]
    assert [x["train/skipped_steps"] for x in lines] == [0, 1, 1, 1, 1, 2]
    assert ["train/loss" in x for x in lines] == [True, False, True, True, True, False]  # a skipped step has no loss
    assert all(math.isfinite(v) for x in lines for v in x.values() if isinstance(v, float))
    # the skipped step 6 changed nothing: its checkpoint holds step 5's weights and optimizer moments exactly
    states = checkpoint_states(run_dir)
    assert sorted(states) == [5, 6] and all(all_finite(s) for s in states.values())
    for name, w in states[5]["model"].items():
        if torch.is_tensor(w):
            assert torch.equal(w, states[6]["model"][name]), name
    for k, s5 in states[5]["optimizer"]["state"].items():
        assert torch.equal(s5["exp_avg"], states[6]["optimizer"]["state"][k]["exp_avg"])
    log = r.stdout + r.stderr
    assert "step 2: non-finite train/loss and train/grad_norm" in log and "skipped (1/2 of trainer.skip_nonfinite)" in log


@pytest.mark.slow
def test_more_bad_steps_than_skip_nonfinite_diverge(env, tmp_path):
    run_dir = tmp_path / "run"
    r = kdexp_run([*SMOKE, "trainer.skip_nonfinite=2", f"hydra.run.dir={run_dir}"], env, tmp_path, check=False,
                  entry=NAN_RUN, entry_args=["2,4,5"])
    assert r.returncode == 1, r.stderr[-4000:]
    (line,) = kdexp_lines(r.stderr)
    assert line.startswith("kdexp: diverged at step 5: ")
    assert "(last finite checkpoint: step 3); 2 non-finite step(s) skipped before (trainer.skip_nonfinite=2)" in line
    summary = strict((run_dir / "summary.json").read_text())
    assert (summary["status"], summary["step"], summary["skipped_steps"], summary["checkpoint"]) == (
        "diverged", 5, 2, 3)
    assert_strict_json_everywhere(run_dir)
    assert sorted(checkpoint_states(run_dir)) == [3]
