"""The cost of every configuration: a run's cost record (kdexp.track.cost, FLOPs from kdexp.plan's formulas) and the
report's cost metrics, cache builds shared out over the points that used them, the cost table and the quality-vs-cost
plot. Numbers checked by hand."""
from __future__ import annotations

import math

import pytest

from kdexp.report import load_sweep, write_report
from kdexp.report.cost import TABLE_COST_METRICS, cost_table
from kdexp.report.replicates import is_timing, metric_label
from kdexp.track import cost as track_cost
from sweeps import tiny_config, write_run_dir


def compose(*overrides: str):
    from hydra import compose as hydra_compose, initialize_config_module

    import kdexp.conf  # noqa: F401

    with initialize_config_module(config_module="kdexp.conf", version_base="1.3"):
        return hydra_compose(config_name="config", overrides=["experiment=smoke", *overrides])


@pytest.mark.parametrize("teacher", ["online", "cached"])
def test_run_cost_record(teacher, tmp_path):
    from kdexp.plan import flops_per_token, make_plan, model_spec, sizing

    cfg = compose(f"teacher={teacher}", "trainer.max_steps=10")
    t = cfg.trainer
    # one process: the whole global batch on it (no trainer.global_batch_size: one micro-batch per step)
    tokens = 10 * (t.global_batch_size or t.micro_batch_size) * t.seq_length
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "manifest.json").write_text('{"build": {"wall_s": 36.0, "device_count": 1, "device_kind": "cpu (x)", '
                                         '"device_hours": 0.01, "tokens": 4096}}')
    track_cost.note_cache(cache)
    c = track_cost.run_cost(cfg, wall_s=72.0, flops_per_token=flops_per_token)
    plan = make_plan(cfg)
    assert c["tokens"] == tokens and c["device_count"] == 1 and c["device_kind"].startswith("cpu")
    assert c["device_hours"] == pytest.approx(72.0 / 3600)
    assert c["student_flops"] == pytest.approx(plan.flops["student"] * tokens, rel=1e-12)
    teacher_fwd = sizing.flops_per_token(model_spec(cfg, "teacher"), t.seq_length, backward=False)
    if teacher == "online":
        assert c["teacher_forward_flops"] == pytest.approx(plan.flops["teacher"] * tokens, rel=1e-12)
        assert c["cache"] is None
    else:  # the step runs no teacher; the cache build's teacher pass is recorded once, with the build
        assert c["teacher_forward_flops"] == 0.0 and plan.flops["teacher"] == 0.0
        assert c["cache"]["path"] == str(cache) and c["cache"]["build"]["device_hours"] == 0.01
        assert c["cache"]["teacher_forward_flops"] == pytest.approx(teacher_fwd * 4096, rel=1e-12)
    assert track_cost.run_cost(cfg, wall_s=1.0, flops_per_token=flops_per_token)["cache"] is None  # noted once: the next run opens its own


def test_an_on_policy_run_counts_its_rollouts_tokens_and_the_students_generation():
    """rollout.warmup_steps 2 then a fraction 0.5 of 6 steps: steps 3 and 5 train on rollouts of 8 + 16 tokens (23
    positions through the training forward, 24 generated per sample) instead of seq_length; by hand."""
    from kdexp.plan import flops_per_token, make_plan

    cfg = compose("rollout=on_policy", "rollout.on_policy_fraction=0.5", "rollout.warmup_steps=2",
                  "rollout.prompt_tokens=8", "rollout.max_new_tokens=16", "trainer.max_steps=6")
    t, per = cfg.trainer, cfg.trainer.global_batch_size or cfg.trainer.micro_batch_size
    trained = per * (4 * t.seq_length + 2 * 23)
    generated = per * 2 * 24
    assert track_cost.trained_tokens(cfg, 1, 6) == (trained, generated)
    assert track_cost.trained_tokens(cfg, 1, 2) == (per * (t.seq_length + 23), per * 24)  # resumed after step 4
    c = track_cost.run_cost(cfg, wall_s=10.0, flops_per_token=flops_per_token)
    plan = make_plan(cfg)
    assert c["tokens"] == trained
    assert c["student_flops"] == pytest.approx(plan.flops["student"] * (trained + generated / 3), rel=1e-12)
    assert c["teacher_forward_flops"] == pytest.approx(plan.flops["teacher"] * trained, rel=1e-12)


def _point(root, num, alpha, seed, wall_s, cache=None, kl=1.0):
    config = tiny_config(alpha, "topk")
    config["trainer"]["seed"] = seed
    cost = {"wall_s": wall_s, "device_count": 2, "device_kind": "cpu (x86_64)", "device_hours": wall_s * 2 / 3600,
            "tokens": 36_000, "student_flops": 3e12, "teacher_forward_flops": 0.0 if cache else 1e12,
            "cache": None if cache is None else {"path": cache, "build": {"device_hours": 0.5, "tokens": 1000},
                                                 "teacher_forward_flops": 4e12}}
    return write_run_dir(root / str(num), overrides=[f"balancer.alpha={alpha}", f"trainer.seed={seed}"],
                         config=config, num=num, steps=4, final={"val/kl_to_teacher": kl}, summary={"cost": cost})


def test_cost_metrics_table_and_plot(tmp_path):
    root = tmp_path / "s"
    # alpha 0.5: two seeds from one cache (its 0.5 device-hour build shared by the 2 points that used it)
    _point(root, 0, 0.5, 1, 360.0, cache="/c/1", kl=0.8)
    _point(root, 1, 0.5, 2, 720.0, cache="/c/1", kl=0.9)
    # alpha 1.0: two seeds, online teacher
    _point(root, 2, 1.0, 1, 1800.0, kl=1.0)
    _point(root, 3, 1.0, 2, 1800.0, kl=1.2)
    sweep = load_sweep(root)
    p0, p2 = sweep.points[0].final, sweep.points[2].final
    assert p0["cost/device_hours"] == pytest.approx(0.2) and p0["cost/one_time_device_hours"] == pytest.approx(0.25)
    assert p0["cost/total_device_hours"] == pytest.approx(0.45)
    assert p0["cost/tflop"] == pytest.approx((3e12 + 0 + 4e12 / 2) / 1e12)
    assert p0["cost/tokens_per_s"] == pytest.approx(100.0) and p0["cost/tokens"] == 36_000
    assert p2["cost/one_time_device_hours"] == 0.0 and p2["cost/total_device_hours"] == pytest.approx(1.0)
    assert p2["cost/tflop"] == pytest.approx(4.0)
    for m in ("cost/total_device_hours", "cost/device_hours", "cost/tokens_per_s"):
        assert is_timing(m) and metric_label(m).endswith("(machine-dependent)")
    assert not is_timing("cost/tflop") and not is_timing("cost/tokens")

    table = cost_table(sweep)  # every point on the same devices with the same tokens: a note, not two columns
    assert table.columns == ["configuration", "n", *TABLE_COST_METRICS, "val/kl_to_teacher"]
    rows = [dict(zip(table.columns, r)) for r in table.rows]
    text = [dict(zip(table.columns, r)) for r in table.text]
    assert [r["configuration"] for r in text] == ["balancer.alpha=0.5", "balancer.alpha=1.0"]
    assert rows[0]["cost/device_hours"].mean == pytest.approx((0.2 + 0.4) / 2)
    assert rows[0]["cost/one_time_device_hours"].mean == pytest.approx(0.25)
    assert "Every point: devices 2 x cpu (x86_64), 36,000 tokens trained." in table.notes
    assert "teacher-cache build: 1 build used by 2 points, 0.5000 device-hours in all" in " ".join(table.notes)
    assert text[1]["cost/tflop"].startswith("4.0000 ± 0.0000")
    assert any("machine" in n for n in table.notes) and any("t(0.975, 1)" in n for n in table.notes)

    files = write_report(sweep, tmp_path / "out", quality="val/kl_to_teacher")
    md = files.markdown.read_text()
    assert "## Cost per configuration" in md and "cost/device_hours (machine-dependent)" in md
    assert "quality vs cost" in files.plots and files.plots["quality vs cost"].name == "cost.png"
    from kdexp.report.__main__ import main  # the CLI: --quality picks the metric beside the cost

    assert main([str(root), "--out", str(tmp_path / "cli"), "--quality", "val/kl_to_teacher"]) == 0
    assert (tmp_path / "cli" / "cost.png").is_file() and "## Cost per configuration" in (
        tmp_path / "cli" / "report.md").read_text()


def test_points_without_cost_records_have_no_cost_section(tmp_path):
    write_run_dir(tmp_path / "s" / "0", overrides=["balancer.alpha=0.5"], config=tiny_config(0.5, "topk"), num=0,
                  final={"val/kl_to_teacher": 1.0}, steps=4)
    sweep = load_sweep(tmp_path / "s")
    assert cost_table(sweep) is None and not any(k.startswith("cost/") for k in sweep.points[0].final)
    assert math.isfinite(sweep.points[0].final["val/kl_to_teacher"])


def test_cost_from_a_wandb_group():
    """kdexp.train.point logs the cost record into the W&B summary: a report from the group has the same cost."""
    from kdexp.report import load_wandb_group
    from test_report import FakeApi, FakeRun

    runs = []
    for i, alpha in enumerate((0.5, 1.0)):
        cost = {"wall_s": 360.0 * (i + 1), "device_count": 2, "device_kind": "NVIDIA H100", "device_hours": 0.2 * (i + 1),
                "tokens": 36_000, "student_flops": 3e12, "teacher_forward_flops": 1e12, "cache": None}
        runs.append(FakeRun(f"balancer.alpha={alpha}", "finished", tiny_config(alpha, "topk"),
                            {"val/kl_to_teacher": 1.0 - i / 10, "cost": cost, "_step": 4},
                            [{"_step": 4, "val/kl_to_teacher": 1.0 - i / 10}]))
    sweep = load_wandb_group("g", api=FakeApi(runs))
    assert [p.final["cost/total_device_hours"] for p in sweep.points] == pytest.approx([0.2, 0.4])
    assert [p.final["cost/tflop"] for p in sweep.points] == pytest.approx([4.0, 4.0])
    assert "Every point: devices 2 x NVIDIA H100, 36,000 tokens trained." in cost_table(sweep).notes


def test_a_cache_build_records_its_cost_and_the_run_names_the_cache(tmp_path):
    """The build writes what it cost into the manifest; opening the cache notes it for the run's cost record."""
    import json

    import _teacher_cache_worker as w
    from _lone_process import lone_process
    from kdexp.teacher.writer import ensure_at

    lay = w.layout()
    path = tmp_path / "cache"
    with lone_process(seed=0):
        ensure_at(path, w.key(lay), lay, w.FakeTeacher(), w.dataset(), 2)
    build = json.loads((path / "manifest.json").read_text())["build"]
    assert build["tokens"] == lay.samples * lay.seq_length and build["shards_written"] == lay.shards
    assert build["shards_kept"] == 0 and build["device_count"] == 1 and build["device_kind"].startswith("cpu")
    assert build["wall_s"] > 0 and build["device_hours"] == pytest.approx(build["wall_s"] / 3600)
    assert track_cost._USED_CACHE == [str(path), "built"]  # this run built it: its wall time holds the build
    with lone_process(seed=0):  # a second run opens the finished cache: noted again, nothing rebuilt
        ensure_at(path, w.key(lay), lay, w.FakeTeacher(), w.dataset(), 2)
    assert json.loads((path / "manifest.json").read_text())["build"] == build
    assert track_cost._USED_CACHE == [str(path), ""]
    track_cost._USED_CACHE.clear()


def test_one_time_work_leaves_the_point_that_did_it_and_is_shared(tmp_path):
    """The first point of a seed pretrained the teacher (0.3 device-hours of its 0.4) and built the cache; the second
    only used them: both train for 0.1 and share the 0.3 + 0.5 one-time device-hours, and the FLOPs the same way."""
    root = tmp_path / "s"
    for num, (alpha, built) in enumerate(((0.5, True), (1.0, False))):
        cost = {"wall_s": 720.0 if built else 180.0, "device_count": 2, "device_kind": "cpu (x86_64)",
                "device_hours": 0.4 if built else 0.1, "tokens": 36_000, "student_flops": 3e12,
                "teacher_forward_flops": 0.0,
                "cache": {"path": "/c/1", "build": {"device_hours": 0.5}, "teacher_forward_flops": 4e12,
                          "built_here": built},
                "one_time": [{"what": "teacher pretraining", "path": "/t/1", "built_here": built, "flops": 6e12,
                              "build": {"wall_s": 540.0, "device_count": 2, "device_hours": 0.3, "tokens": 512}}]}
        if built:  # the cache build's 0.5 was paid by this point too
            cost.update(wall_s=2160.0, device_hours=1.2 - 0.3 + 0.3)
        write_run_dir(root / str(num), overrides=[f"balancer.alpha={alpha}"], config=tiny_config(alpha, "topk"),
                      num=num, steps=4, final={"val/kl_to_teacher": 1.0}, summary={"cost": cost})
    sweep = load_sweep(root)
    first, second = (p.final for p in sweep.points)
    assert first["cost/device_hours"] == pytest.approx(1.2 - 0.3 - 0.5)  # its own training only
    assert second["cost/device_hours"] == pytest.approx(0.1)
    for f in (first, second):
        assert f["cost/one_time_device_hours"] == pytest.approx(0.3 / 2 + 0.5 / 2)
        assert f["cost/tflop"] == pytest.approx((3e12 + 4e12 / 2 + 6e12 / 2) / 1e12)
    assert first["cost/tokens_per_s"] == pytest.approx(36_000 / (0.4 * 3600 / 2))
    note = next(n for n in cost_table(sweep).notes if n.startswith("One-time work"))
    assert note == ("One-time work, shared over the points that used it: teacher-cache build: 1 build used by 2 "
                    "points, 0.5000 device-hours in all; teacher pretraining: 1 build used by 2 points, 0.3000 "
                    "device-hours in all.")
