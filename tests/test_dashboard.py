"""The live sweep dashboard in a real browser: a real tiny sweep (experiment=smoke, 2 points) regenerates
report/index.html as points finish, `python -m kdexp.report SWEEP --watch` follows it to the end, and headless
Chromium renders the pages: one table row per point, every <img> decoded at its PNG's size, the live page's refresh
tag, and a screenshot kept under the test's tmp dir (and $KDEXP_ARTIFACTS when set).

Without Chromium the browser test is skipped with the reason; under CI=true it fails (.ci/run installs chromium).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kdexp.report import load_sweep, write_report
from kdexp.report.live import refresh, refresh_quietly, watch
from _launch import kdexp_popen, run_env
from sweeps import REPO, tiny_config, write_run_dir
from test_report import png_size

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
# Replaces nothing on the page: appended to a copy, it reports what the browser decoded once everything loaded.
PROBE = """<script>window.addEventListener("load", () => {
  const rows = [...document.querySelectorAll("table.points tbody tr")].map(r => [r.className, r.cells[0].textContent]);
  const imgs = [...document.images].map(i => [i.getAttribute("src"), i.complete, i.naturalWidth, i.naturalHeight]);
  const refresh = [...document.querySelectorAll('meta[http-equiv="refresh"]')].map(m => m.content);
  const live = document.getElementById("live");
  const out = document.createElement("pre");
  out.id = "kdexp-probe";
  out.textContent = JSON.stringify({rows, imgs, refresh, live: live ? live.textContent : null});
  document.body.appendChild(out);
});</script>"""


def under_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def chromium() -> str:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    reason = "Chromium is not installed (apt-get install -y chromium; .ci/run installs it)"
    if under_ci():
        pytest.fail(reason + " - under CI=true the browser test must run")
    pytest.skip(reason)


def browser(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
           f"--user-data-dir={tmp_path / 'chromium-profile'}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180)


def rendered(page: Path, tmp_path: Path) -> dict:
    """What Chromium rendered for ``page``: the probe's JSON (rows, images, refresh tags) from --dump-dom."""
    probe = page.with_name(f"_probe_{page.name}")
    probe.write_text(page.read_text().replace("</body>", PROBE + "</body>"))
    r = browser(["--virtual-time-budget=8000", "--run-all-compositor-stages-before-draw", "--dump-dom",
                 probe.as_uri()], tmp_path)
    probe.unlink()
    m = re.search(r'<pre id="kdexp-probe">(.*?)</pre>', r.stdout, re.S)
    assert m, f"no probe output (rc={r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    return json.loads(m.group(1).replace("&quot;", '"').replace("&lt;", "<").replace("&gt;", ">")
                      .replace("&amp;", "&"))


def screenshot(page: Path, tmp_path: Path, name: str) -> Path:
    shot = tmp_path / name
    r = browser(["--window-size=1280,2000", "--virtual-time-budget=8000", f"--screenshot={shot}", page.as_uri()],
                tmp_path)
    assert shot.is_file(), r.stderr[-2000:]
    assert png_size(shot) == (1280, 2000)
    if os.environ.get("KDEXP_ARTIFACTS"):
        dest = Path(os.environ["KDEXP_ARTIFACTS"])
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, dest / name)
    return shot


def sweep_args(sweep_dir: Path) -> list[str]:
    return ["-m", "experiment=smoke", "logger=none", "trainer.max_steps=2", "trainer.eval_interval=2",
            "trainer.eval_iters=1", "trainer.checkpoint_interval=2", "balancer.alpha=0.0,1.0",
            f"hydra.sweep.dir={sweep_dir}"]


# ---------------------------------------------------------------------------------------------------------------------
def test_live_page_then_final_page(tmp_path, monkeypatch, capsys):
    """Hand-made points: refresh tag and banner while one is running, none once every point ended."""
    root = tmp_path / "sw"
    write_run_dir(root / "0", overrides=["balancer.alpha=0.0"], config=tiny_config(0.0, "topk"), num=0,
                  final={"val/lm_loss": 3.0}, steps=4, val=[{"step": 4, "val/lm_loss": 3.0}])
    write_run_dir(root / "1", overrides=["balancer.alpha=1.0"], config=tiny_config(1.0, "topk"), num=1,
                  train=[{"step": 1, "train/loss": 4.0}])  # running: metrics, no summary
    files = refresh(root)
    page = files.html.read_text()
    assert files.live and '<meta http-equiv="refresh" content="10">' in page and 'id="live"' in page
    assert "2 points: 1 finished, 1 running" in page
    write_run_dir(root / "1", overrides=["balancer.alpha=1.0"], config=tiny_config(1.0, "topk"), num=1,
                  final={"val/lm_loss": 2.5}, steps=4, val=[{"step": 4, "val/lm_loss": 2.5}])
    files = watch(root, interval=0.01, max_polls=3, echo=lambda line: None)
    assert files is not None and not files.live
    assert "http-equiv" not in files.html.read_text() and 'id="live"' not in files.html.read_text()
    # A forced final page even while a point would still run (the multirun ended), and errors never raise:
    assert "http-equiv" not in write_report(load_sweep(root), tmp_path / "f", live=False).html.read_text()
    import kdexp.report.live as live

    def broken(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(live, "write_report", broken)
    refresh_quietly(root)  # what the sweep callback calls: one line on stderr, no exception
    assert "[sweep] report not updated (RuntimeError: disk full); the sweep goes on" in capsys.readouterr().err


@pytest.mark.slow
def test_dashboard_of_a_real_sweep_in_chromium(tmp_path, seeded_cache):
    chromium()  # skip (or fail under CI) before spending a sweep
    sweep_dir = tmp_path / "sweep"
    env = run_env(seeded_cache(tmp_path / "cache"), WANDB_MODE="disabled")
    sweep = kdexp_popen(sweep_args(sweep_dir), env, tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        text=True)
    page = sweep_dir / "report" / "index.html"
    deadline = time.monotonic() + 600
    while not page.exists() and sweep.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    watcher = subprocess.Popen([sys.executable, "-m", "kdexp.report", str(sweep_dir), "--watch", "--interval", "1"],
                               cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    snapshots: list[str] = []  # the live pages seen while the sweep ran
    while sweep.poll() is None and time.monotonic() < deadline:
        text = page.read_text() if page.exists() else ""
        if "http-equiv" in text and (not snapshots or text != snapshots[-1]):
            snapshots.append(text)
        time.sleep(0.1)
    out = sweep.communicate(timeout=60)[0]
    watched = watcher.communicate(timeout=120)[0]
    assert sweep.returncode == 0, out[-4000:]
    assert watcher.returncode == 0, watched[-4000:]
    assert "[watch]" in watched and "final report:" in watched and "2 points: 2 finished" in watched
    assert f"[sweep] live dashboard: {page}" in out
    assert snapshots, "the page never carried its refresh tag while the sweep ran"
    assert any("1 finished" in s for s in snapshots)  # regenerated when the first point finished
    final = page.read_text()
    assert "http-equiv" not in final and "2 points: 2 finished" in final

    # The live page as the browser saw it while point 1 was still to come.
    live_page = page.with_name("live_snapshot.html")
    live_page.write_text(next(s for s in snapshots if "1 finished" in s))
    live = rendered(live_page, tmp_path)
    assert live["refresh"] == ["10"] and "reloads every 10 s" in live["live"]
    assert [c for c, _ in live["rows"]][0] == "finished" and live["rows"][1][0] in ("pending", "running")
    screenshot(live_page, tmp_path, "dashboard_live.png")

    dom = rendered(page, tmp_path)
    assert dom["refresh"] == [] and dom["live"] is None
    assert [c for c, _ in dom["rows"]] == ["finished", "finished"]  # one row per point
    assert [name for _, name in dom["rows"]] == ["0", "1"]
    srcs = {src for src, *_ in dom["imgs"]}
    assert {"curves.png", "vs_balancer.alpha.png"} <= srcs
    for src, complete, width, height in dom["imgs"]:  # decoded, at the size the PNG says
        assert complete and (width, height) == png_size(page.parent / src), src
    shot = screenshot(page, tmp_path, "dashboard_final.png")
    assert shot.stat().st_size > 10_000  # a rendered page, not a blank one
