"""TensorBoard for a sweep (kdexp.track.tensorboard): each point's scalars and HParams session, the sweep's one
HParams experiment config, read back with TensorBoard's own event reader; and, on the real tiny sweep, TensorBoard
itself serving the sweep dir (127.0.0.1, a free port) with its HParams view rendered in headless Chromium (Python's
playwright driving the system chromium: it downloads no browser).

Without Chromium or playwright the browser test is skipped with the reason; under CI=true it fails (.ci/run installs
chromium; the dev extra holds playwright).
"""
from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import struct
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path
from urllib.parse import quote

import pytest

from kdexp.distributed.testing import free_port
from kdexp.track import records
from kdexp.track.tensorboard import (EXPERIMENT_DIR, HPARAMS_METRICS, TensorBoardLogger, planned_hparams,
                                     session_hparams, write_experiment)
from sweeps import REPO, checked_real_points, real_tiny_sweep

# The events are written with tensorboardX; they are read back here with TensorBoard's own loader and served by its
# own server (the `tensorboard` package is in the dev extra: a missing viewer fails these tests, it never skips them).


def _events(path: Path) -> list:
    """The events as written (TensorBoard's raw reader: its EventFileLoader would migrate simple values to tensors)."""
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    return [e for f in sorted(path.glob("events.out.tfevents.*")) for e in LegacyEventFileLoader(str(f)).Load()]


def _f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


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
        # float32 simple values, as add_scalar writes them (the default loader serves nothing else): each is the
        # logged float64 rounded to float32, computed here with struct (IEEE 754 single, round to nearest even)
        assert all(v.WhichOneof("value") == "simple_value" for e in events for v in e.summary.value
                   if v.tag.startswith(("train/", "val/")))
        scalars = {(v.tag, e.step): v.simple_value for e in events for v in e.summary.value
                   if v.tag.startswith(("train/", "val/"))}
        assert scalars == {("train/loss", 1): _f32(3.0 + i), ("train/kept_mass", 1): _f32(0.9),
                           ("val/lm_loss", 2): _f32(2.123456789012345 + i),
                           ("val/top1_agreement", 2): 0.25}  # NaN not written; a final-only metric at the last step
        assert scalars[("val/lm_loss", 2)] != 2.123456789012345 + i  # the precision float32 gives up ...
        assert abs(scalars[("val/lm_loss", 2)] / (2.123456789012345 + i) - 1) < 2.0**-24  # ... within half an ulp


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


# Every text of the page, shadow roots included (TensorBoard's HParams dashboard is Polymer: shadow DOM), styles not.
DEEP_TEXT = """() => { const out = []; const walk = (n) => {
  if (n.nodeType === 3) { const t = n.textContent.trim();
    if (t && !['STYLE', 'SCRIPT'].includes(n.parentNode.nodeName)) out.push(t); }
  if (n.shadowRoot) walk(n.shadowRoot);
  for (const c of n.childNodes) walk(c); };
  walk(document.body); return out; }"""
# The Time Series cards on the page: [card title, rows of its data table (run, smoothed, value, step, relative)]. A
# filtered tag's card shows under "Tags matching filter" and again in its group below: any card of the tag will do.
CARDS = """() => Array.from(document.querySelectorAll('scalar-card-component')).map(c => [
  c.innerText.replace(/\\n/g, '').split('Alt + Scroll to Zoom')[0].trim(),
  Array.from(c.querySelectorAll('tb-data-table-content-row')).map(r => Array.from(
    r.querySelectorAll('tb-data-table-content-cell')).map(x => x.innerText.trim()).filter(x => x))])"""
CARD_FILLED = f"""([tag, runs]) => ({CARDS})().some(c => c[0] === tag && runs.every(r => c[1].some(row => row[0] === r)))"""
DOCS_TENSORBOARD = "tests/test_tensorboard.py::test_tensorboard_serves_the_sweep_and_renders_its_hparams"


def docs_command() -> list[str]:
    """The command docs/reports.md prints under the marker naming this test."""
    text = (REPO / "docs" / "reports.md").read_text()
    m = re.search(rf"<!-- covered: {re.escape(DOCS_TENSORBOARD)} -->\n```bash\n(.+?)\n```", text)
    assert m, "docs/reports.md lost its TensorBoard command"
    return shlex.split(m.group(1))


def _curves(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Tag -> [(step, value as float32)] of every finite metrics.jsonl value: what TensorBoard must serve."""
    out: dict = {}
    for line in (run_dir / records.METRICS).read_text().splitlines():
        row = json.loads(line)
        for key, value in row.items():
            if key not in ("step", "kind") and isinstance(value, (int, float)) and not isinstance(value, bool) \
                    and math.isfinite(value):
                out.setdefault(key, []).append((row["step"], _f32(value)))
    return out


@pytest.mark.slow
def test_tensorboard_serves_the_sweep_and_renders_its_hparams(tmp_path_factory, tmp_path, seeded_cache):
    """TensorBoard started exactly as docs/reports.md prints it (its default, fast loader), only told where to listen:
    through its data API every finished point's curves hold every metrics.jsonl row (float32) and every HParams
    metric column is filled with the point's last value; in Chromium the Time Series card of every tag shows each
    point, and the HParams table every metric column of every point."""
    sweep_dir, proc = real_tiny_sweep(tmp_path_factory, seeded_cache)
    points = checked_real_points(sweep_dir, proc)
    finished = {a: p for a, p in points.items() if p["status"] == "finished"}
    runs = {Path(os.path.relpath(p["run_dir"], sweep_dir)).as_posix(): a for a, p in finished.items()}
    curves = {run: _curves(finished[a]["run_dir"]) for run, a in runs.items()}
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        _need("Chromium is not installed (apt-get install -y chromium; .ci/run installs it)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _need("playwright is not installed (pip install -e '.[dev]')")

    argv = docs_command()
    assert argv[:2] == ["tensorboard", "--logdir"] and not any("load_fast" in a for a in argv), argv
    tensorboard = Path(sys.executable).with_name("tensorboard")  # the console script pip installed beside python
    argv = [str(tensorboard if tensorboard.is_file() else shutil.which("tensorboard")),
            *(str(sweep_dir) if a == "multirun/<date>/<time-id>" else a for a in argv[1:])]
    assert str(sweep_dir) in argv
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "tensorboard.log"
    with log.open("w") as out:
        server = subprocess.Popen([*argv, "--host", "127.0.0.1", "--port", str(port)], stdout=out,
                                  stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while True:  # until TensorBoard answers and serves every finished point's every tag
            try:
                tags = _get(f"{url}/data/plugin/scalars/tags")
                if all(set(curves[run]) <= set(tags.get(run, {})) for run in runs):
                    break
            except OSError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(1)
        assert "fast data loading" in log.read_text()  # the default loader (tensorboard-data-server) serves them
        # the data API: each curve as metrics.jsonl has it, in float32
        for run, by_tag in curves.items():
            for tag, rows in by_tag.items():
                served = _get(f"{url}/data/plugin/scalars/scalars?run={quote(run)}&tag={quote(tag)}")
                assert [(step, value) for _, step, value in served] == rows, (run, tag)
        # one experiment (the swept key, the metric columns), one session group per finished point, every metric
        # column filled with the last value of its curve
        experiment = _get(f"{url}/data/plugin/hparams/experiment", {"experimentName": ""})
        assert [h["name"] for h in experiment["hparamInfos"]] == ["balancer.alpha"]
        assert sorted(experiment["hparamInfos"][0]["domainDiscrete"]) == [0.0, 1.0, 1.5]
        assert [m["name"]["tag"] for m in experiment["metricInfos"]] == list(HPARAMS_METRICS)
        groups = _get(f"{url}/data/plugin/hparams/session_groups", {
            "experimentName": "", "startIndex": 0, "sliceSize": 100, "colParams": [],
            "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE", "STATUS_RUNNING"]})
        by_alpha = {g["hparams"]["balancer.alpha"]: g for g in groups["sessionGroups"]}
        assert set(by_alpha) == set(finished)  # alpha=1.5 failed validation before it trained: no session
        expected_cells: list[float] = []
        for run, alpha in runs.items():
            values = {m["name"]["tag"]: m["value"] for m in by_alpha[alpha]["metricValues"]}
            last = {tag: rows[-1][1] for tag, rows in curves[run].items()}
            assert values == {m: last[m] for m in HPARAMS_METRICS}, run
            expected_cells += [alpha, *values.values()]
        # the browser: a Time Series card per tag showing every point; the HParams table with every metric column
        with sync_playwright() as pw:
            chrome = pw.chromium.launch(executable_path=browser, headless=True,
                                        args=["--no-sandbox", "--disable-gpu"])
            try:
                page = chrome.new_page(viewport={"width": 1400, "height": 1000})
                page.goto(f"{url}/#timeseries", wait_until="networkidle")
                # a loaded, busy machine renders slowly: wait for the first cards, then the visible filter box
                page.wait_for_function("() => document.querySelectorAll('scalar-card-component').length > 0",
                                       timeout=180_000)
                search = page.locator('input[placeholder="Filter tags (regex)"]:visible').first
                for tag in sorted(set().union(*map(set, curves.values()))):
                    search.fill(f"^{re.escape(tag)}$", timeout=180_000)  # what a user types to find a curve
                    holders = sorted(run for run in runs if tag in curves[run])
                    page.wait_for_function(CARD_FILLED, arg=[tag, holders], timeout=180_000)
                    rows = next(c[1] for c in page.evaluate(CARDS)
                                if c[0] == tag and all(any(r[0] == run for r in c[1]) for run in holders))
                    for run in holders:  # the data table: the run's value at its last step
                        (row,) = [r for r in rows if r[0] == run]
                        assert int(row[3]) == curves[run][tag][-1][0], (tag, row)
                page.screenshot(path=str(tmp_path / "time_series.png"))
                page.goto(f"{url}/#hparams", wait_until="networkidle")
                names = [f"balancer.alpha={a}" for a in ("0.0", "1.0")]
                page.wait_for_function(f"() => ({DEEP_TEXT})().join('|').includes({json.dumps(names[-1])})",
                                       timeout=120_000)
                for metric in HPARAMS_METRICS:  # the sidebar shows the first five metric columns; tick the rest
                    box = page.get_by_role("checkbox", name=metric, exact=True)
                    if box.get_attribute("aria-checked") != "true":
                        box.click()
                page.wait_for_function(f"() => ({DEEP_TEXT})().filter(t => t === {json.dumps(HPARAMS_METRICS[-1])})"
                                       ".length >= 3", timeout=60_000)  # sidebar, color-by and the table header
                texts = page.evaluate(DEEP_TEXT)
                table = texts[texts.index("Trial ID"):texts.index("Color by")]
                for name in names:
                    assert any(t.startswith(name) for t in table), (name, table)
                assert all(m in table for m in HPARAMS_METRICS), table
                # every cell: the value as the table prints it (JavaScript's toPrecision(5), asked of the page)
                cells = page.evaluate("vs => vs.map(v => v.toPrecision(5))", expected_cells)
                assert not Counter(cells) - Counter(table), (cells, table)
                page.screenshot(path=str(tmp_path / "hparams_table.png"))
                page.get_by_text("Parallel Coordinates View", exact=False).first.click()
                page.wait_for_function("() => { const f = (n) => { if (n.tagName === 'svg' && "
                                       "n.querySelectorAll('path').length > 2) return true; "
                                       "if (n.shadowRoot && f(n.shadowRoot)) return true; "
                                       "for (const c of n.children || []) if (f(c)) return true; return false; }; "
                                       "return f(document.body); }", timeout=60_000)
                page.screenshot(path=str(tmp_path / "hparams_parallel.png"))
                if os.environ.get("KDEXP_ARTIFACTS"):
                    for shot in ("time_series.png", "hparams_table.png", "hparams_parallel.png"):
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
