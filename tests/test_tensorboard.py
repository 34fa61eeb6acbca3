"""TensorBoard for a sweep (kdexp.track.tensorboard): each point's scalars and HParams session, the sweep's one
HParams experiment config, read back with TensorBoard's own event reader; and, on the real tiny sweep, TensorBoard
itself serving the sweep dir (127.0.0.1, a free port) with its HParams view rendered in headless Chromium (Python's
playwright driving the system chromium: it downloads no browser).

Without Chromium or playwright the browser test is skipped with the reason; under CI=true it fails (.ci/run installs
chromium; the dev extra holds playwright).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from kdexp.distributed.testing import free_port
from kdexp.track import records
from kdexp.track.tensorboard import (EXPERIMENT_DIR, HPARAMS_METRICS, TensorBoardLogger, planned_hparams,
                                     session_hparams, write_experiment)
from sweeps import checked_real_points, real_tiny_sweep

# The events are written with tensorboardX; they are read back here with TensorBoard's own loader and served by its
# own server (the `tensorboard` package is in the dev extra: a missing viewer fails these tests, it never skips them).


def _events(path: Path) -> list:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    return [e for f in sorted(path.glob("events.out.tfevents.*")) for e in EventFileLoader(str(f)).Load()]


def _plugin(event, tag) -> bytes:
    """The hparams plugin content of ``tag`` in an event."""
    (content,) = [v.metadata.plugin_data.content for v in event.summary.value if v.tag == tag]
    return content


def _write_plan(sweep_dir: Path, planned: list[list[str]]) -> None:
    sweep_dir.mkdir(parents=True, exist_ok=True)
    records.write_json(sweep_dir / records.SWEEP, {"points": [{"num": i, "overrides": o}
                                                              for i, o in enumerate(planned)]})


def test_hparams_are_typed_per_column(tmp_path):
    planned = [["balancer.alpha=0.5", "loss=topk", "trainer.seed=1"], ["balancer.alpha=1", "loss=top_p",
                                                                        "trainer.seed=2"],
               ["balancer.alpha=1.0", "loss=topk", "trainer.seed=null"]]
    _write_plan(tmp_path, planned)
    plan = planned_hparams(tmp_path)
    # numbers are one float column (1 and 1.0 are one value), text stays text, a key mixing both is text
    assert plan == {"balancer.alpha": [0.5, 1.0], "loss": ["topk", "top_p"], "trainer.seed": ["1", "2", "null"]}
    assert session_hparams(planned[1], plan) == {"balancer.alpha": 1.0, "loss": "top_p", "trainer.seed": "2"}
    assert session_hparams(["loss=topk"], plan)["balancer.alpha"] == "default"
    assert session_hparams(["balancer.alpha=0.5", "hydra.job.chdir=true"], {}) == {"balancer.alpha": 0.5}


def test_points_sessions_and_one_experiment(tmp_path):
    from tensorboard.plugins.hparams import api_pb2, metadata

    sweep = tmp_path / "sweep"
    planned = [["balancer.alpha=0.5"], ["balancer.alpha=1.0"]]
    _write_plan(sweep, planned)
    for i, overrides in enumerate(planned):
        tb = TensorBoardLogger(sweep / str(i), name=overrides[0], overrides=overrides, sweep_dir=sweep)
        tb.log({"step": 1, "kind": "train", "train/loss": 3.0 + i, "train/kept_mass": 0.9}, 1)
        tb.log({"step": 2, "kind": "val", "val/lm_loss": 2.123456789012345 + i, "val/kl_to_teacher": float("nan")}, 2)
        tb.summary({"val/lm_loss": 2.0, "val/top1_agreement": 0.25})  # logged keys keep their logged value
        tb.close(exit_code=0 if i == 0 else 1)
    assert write_experiment(sweep, planned_hparams(sweep)) is False  # written once, by the first point
    (exp_event,) = [e for e in _events(sweep / EXPERIMENT_DIR) if e.summary.value]
    experiment = metadata.parse_experiment_plugin_data(_plugin(exp_event, metadata.EXPERIMENT_TAG))
    assert [h.name for h in experiment.hparam_infos] == ["balancer.alpha"]
    assert [v.number_value for v in experiment.hparam_infos[0].domain_discrete.values] == [0.5, 1.0]
    assert [m.name.tag for m in experiment.metric_infos] == list(HPARAMS_METRICS)
    for i in (0, 1):
        events = [e for e in _events(sweep / str(i)) if e.summary.value]
        tags = [v.tag for e in events for v in e.summary.value]
        assert tags[0] == metadata.SESSION_START_INFO_TAG and tags[-1] == metadata.SESSION_END_INFO_TAG
        start = metadata.parse_session_start_info_plugin_data(_plugin(events[0], metadata.SESSION_START_INFO_TAG))
        assert start.hparams["balancer.alpha"].number_value == [0.5, 1.0][i]
        assert start.group_name == planned[i][0]
        end = metadata.parse_session_end_info_plugin_data(_plugin(events[-1], metadata.SESSION_END_INFO_TAG))
        assert end.status == (api_pb2.STATUS_SUCCESS if i == 0 else api_pb2.STATUS_FAILURE)
        from tensorboard.util import tensor_util

        scalars = {(v.tag, e.step): tensor_util.make_ndarray(v.tensor).item() for e in events for v in e.summary.value
                   if v.tag.startswith(("train/", "val/"))}
        assert scalars == {("train/loss", 1): 3.0 + i, ("train/kept_mass", 1): 0.9,
                           ("val/lm_loss", 2): 2.123456789012345 + i,  # float64: as logged, to the last digit
                           ("val/top1_agreement", 2): 0.25}  # NaN not written; a final-only metric at the last step


# ---------------------------------------------------------------------------------------------------------------------
def under_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def _need(reason: str):
    if under_ci():
        pytest.fail(reason + " - under CI=true the TensorBoard browser test must run")
    pytest.skip(reason)


def _get(url: str, body: dict | None = None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


# Every text of the page, shadow roots included (TensorBoard's HParams dashboard is Polymer: shadow DOM).
DEEP_TEXT = """() => { const out = []; const walk = (n) => {
  if (n.nodeType === 3) { const t = n.textContent.trim(); if (t) out.push(t); }
  if (n.shadowRoot) walk(n.shadowRoot);
  for (const c of n.childNodes) walk(c); };
  walk(document.body); return out; }"""


@pytest.mark.slow
def test_tensorboard_serves_the_sweep_and_renders_its_hparams(tmp_path_factory, tmp_path, seeded_cache):
    sweep_dir, proc = real_tiny_sweep(tmp_path_factory, seeded_cache)
    points = checked_real_points(sweep_dir, proc)
    finished = {a: p for a, p in points.items() if p["status"] == "finished"}
    runs = {Path(os.path.relpath(p["run_dir"], sweep_dir)).as_posix(): a for a, p in finished.items()}
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        _need("Chromium is not installed (apt-get install -y chromium; .ci/run installs it)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _need("playwright is not installed (pip install -e '.[dev]')")

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "tensorboard.log"
    with log.open("w") as out:
        server = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(sweep_dir),
                                   "--host", "127.0.0.1", "--port", str(port), "--load_fast=false",
                                   "--reload_interval", "1"], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while True:  # until TensorBoard answers and has read every finished point's run
            try:
                if set(runs) <= set(_get(f"{url}/data/runs")):
                    break
            except OSError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(1)
        # the data API: one experiment (the swept key, the metric columns), one session group per finished point
        experiment = _get(f"{url}/data/plugin/hparams/experiment", {"experimentName": ""})
        assert [h["name"] for h in experiment["hparamInfos"]] == ["balancer.alpha"]
        assert sorted(experiment["hparamInfos"][0]["domainDiscrete"]) == [0.0, 1.0, 1.5]
        groups = _get(f"{url}/data/plugin/hparams/session_groups", {
            "experimentName": "", "startIndex": 0, "sliceSize": 100, "colParams": [],
            "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE", "STATUS_RUNNING"]})
        by_alpha = {g["hparams"]["balancer.alpha"]: g for g in groups["sessionGroups"]}
        assert set(by_alpha) == set(finished)  # alpha=1.5 failed validation before it trained: no session
        for alpha, point in finished.items():
            values = {m["name"]["tag"]: m["value"] for m in by_alpha[alpha]["metricValues"]}
            for metric in ("val/lm_loss", "val/kl_to_teacher", "train/loss"):
                assert values[metric] == pytest.approx(point["final"][metric], rel=1e-12), metric
        # the browser: the HParams table lists every point (its name and swept value), then the parallel coordinates
        with sync_playwright() as pw:
            chrome = pw.chromium.launch(executable_path=browser, headless=True,
                                        args=["--no-sandbox", "--disable-gpu"])
            try:
                page = chrome.new_page(viewport={"width": 1400, "height": 1000})
                page.goto(f"{url}/#hparams", wait_until="networkidle")
                names = [f"balancer.alpha={a}" for a in ("0.0", "1.0")]
                page.wait_for_function(f"() => ({DEEP_TEXT})().join('|').includes({json.dumps(names[-1])})",
                                       timeout=120_000)
                texts = page.evaluate(DEEP_TEXT)
                for name in names:
                    assert any(t.startswith(name) for t in texts), (name, texts[:80])
                assert "balancer.alpha" in texts and "val/kl_to_teacher" in texts
                page.screenshot(path=str(tmp_path / "hparams_table.png"))
                page.get_by_text("Parallel Coordinates View", exact=False).first.click()
                page.wait_for_function("() => { const f = (n) => { if (n.tagName === 'svg' && "
                                       "n.querySelectorAll('path').length > 2) return true; "
                                       "if (n.shadowRoot && f(n.shadowRoot)) return true; "
                                       "for (const c of n.children || []) if (f(c)) return true; return false; }; "
                                       "return f(document.body); }", timeout=60_000)
                page.screenshot(path=str(tmp_path / "hparams_parallel.png"))
                if os.environ.get("KDEXP_ARTIFACTS"):
                    for shot in ("hparams_table.png", "hparams_parallel.png"):
                        shutil.copy(tmp_path / shot, Path(os.environ["KDEXP_ARTIFACTS"]) / shot)
            finally:
                chrome.close()
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
