"""kdexp.track.wandb_logger: W&B online without a reachable server falls back to offline within seconds (never the
~97 s block of wandb's own init timeout), and the offline run holds the logged data for a later `wandb sync`.

The servers are local sockets: a port where nothing listens, one that accepts connections and never answers, and a
tiny HTTP server that does answer (so a live server is not mistaken for a dead one).
"""
from __future__ import annotations

import http.server
import logging
import os
import socket
import threading
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from kdexp.config import KdexpConfig
from kdexp.distributed.testing import free_port
from kdexp.track import records, wandb_logger, wandb_read
from kdexp.track.wandb_logger import WandbLogger, unreachable
from _launch import kdexp_run


def _dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # bound then closed: nothing listens there


@pytest.fixture
def silent_url():
    """A server that accepts every connection and never sends a byte."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held, stop = [], threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    server.close()


@pytest.fixture
def answering_url():
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):  # noqa: N802 (the stdlib's name)
            self.send_response(401)  # what a real W&B server says to an anonymous HEAD: still an answer
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_probe_tells_dead_silent_and_live_servers_apart(silent_url, answering_url):
    assert "refused" in unreachable(_dead_url()).lower()
    started = time.perf_counter()
    assert unreachable(silent_url, timeout=1.0) is not None
    assert time.perf_counter() - started < 10  # bounded by the probe timeout, not by the server
    assert unreachable(answering_url) is None
    assert unreachable("not a url") is not None


def test_base_url_follows_wandb_base_url(monkeypatch):
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    assert wandb_logger.base_url() == "http://127.0.0.1:9"


def _start_online(url, tmp_path, monkeypatch, caplog):
    """A WandbLogger in online mode against ``url``: (logger, run dir, seconds it took to be ready)."""
    monkeypatch.setenv("WANDB_BASE_URL", url)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = OmegaConf.merge(OmegaConf.structured(KdexpConfig), {"logger": {"wandb": {"mode": "online"}}})
    cfg.paths.cache = cfg.paths.index = str(tmp_path / "cache")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    started = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="kdexp"):
        logger = WandbLogger(cfg, run_dir, enabled=True, name="point", group=None, job_type="train")
    return logger, run_dir, time.perf_counter() - started


@pytest.mark.parametrize("server", ["nothing listening", "accepts, never answers"])
def test_online_without_server_falls_back_to_offline(server, silent_url, tmp_path, monkeypatch, caplog):
    url = _dead_url() if server == "nothing listening" else silent_url
    logger, run_dir, seconds = _start_online(url, tmp_path, monkeypatch, caplog)
    print(f"{server}: W&B logger ready (offline fallback) after {seconds:.1f} s")
    try:
        assert logger.mode == "offline" and logger.run is not None
        assert url in caplog.text and "offline" in caplog.text and "wandb sync" in caplog.text
        assert seconds < 60  # generous: wandb's own online init blocks ~97 s here
        logger.log({"train/loss": 1.5, "step": 1, "kind": "train"}, step=1)
        logger.summary({"val/lm_loss": 2.0})
    finally:
        logger.finish()
    offline = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 1 and list(offline[0].glob("*.wandb")), "no offline run to `wandb sync` later"
    assert (run_dir / "wandb_id").read_text().strip() in offline[0].name  # resumable under the same id


def test_reachable_server_that_fails_init_falls_back_too(answering_url, tmp_path, monkeypatch, caplog):
    """The server answers the probe but wandb.init cannot start an online run there (no W&B API behind it)."""
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)  # no login prompt: init talks to the server and fails
    monkeypatch.delenv("WANDB_INIT_TIMEOUT", raising=False)
    monkeypatch.setattr(wandb_logger, "INIT_TIMEOUT_S", 5.0)  # the bound under test, shortened to keep tests quick
    logger, run_dir, seconds = _start_online(answering_url, tmp_path, monkeypatch, caplog)
    print(f"reachable, init fails: W&B logger ready (offline fallback) after {seconds:.1f} s")
    try:
        assert logger.mode == "offline" and "online init failed" in caplog.text
        assert seconds < 60  # bounded by INIT_TIMEOUT_S plus wandb's grace, not 90 s
    finally:
        logger.finish()
    assert list((run_dir / "wandb").glob("offline-run-*/*.wandb"))


# ---------------------------------------------------------------------------------------------------------------------
# read-back: what the offline run file holds (kdexp.track.wandb_read, wandb's own Record proto) is what was logged


def _offline_logger(tmp_path, monkeypatch, *, overrides, tags=("a", "b")):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = OmegaConf.merge(OmegaConf.structured(KdexpConfig),
                          {"logger": {"wandb": {"mode": "offline", "tags": list(tags)}}})
    cfg.paths.cache = cfg.paths.index = str(tmp_path / "cache")
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    logger = WandbLogger(cfg, run_dir, enabled=True, name="point-a", group="grp", job_type="sweep",
                         overrides=overrides)
    return cfg, run_dir, logger


def test_read_back_of_a_logger_run_with_records_across_blocks(tmp_path, monkeypatch):
    # an override of 70 KB makes the run record span three 32 KiB blocks (FIRST, MIDDLE, LAST framing)
    big = "trainer.note=" + "x" * 70_000
    cfg, run_dir, logger = _offline_logger(tmp_path, monkeypatch, overrides=["balancer.alpha=0.5", big])
    rows = [{"step": s, "kind": "train", "train/loss": 1.0 / s, "train/kept_mass": 0.9 + s / 1000} for s in (1, 2, 3)]
    rows.append({"step": 3, "kind": "eval", "val/lm_loss": 2.718281828459045})  # same step: one W&B row
    try:
        for row in rows:
            logger.log(row, row["step"])
        logger.summary({"val/lm_loss": 2.718281828459045})
    finally:
        logger.finish()
    run = wandb_read.read_run(run_dir)
    assert run.id == (run_dir / "wandb_id").read_text().strip() and run.exit_code == 0
    assert (run.name, run.group, run.job_type, run.project, run.tags) == ("point-a", "grp", "sweep", "kdexp",
                                                                         ["a", "b"])  # no tags asked: the user's
    assert run.metrics() == [
        {"step": 1, "train/loss": 1.0, "train/kept_mass": 0.901},
        {"step": 2, "train/loss": 0.5, "train/kept_mass": 0.902},
        {"step": 3, "train/loss": 1 / 3, "train/kept_mass": 0.903, "val/lm_loss": 2.718281828459045}]
    config = {k: v for k, v in run.config.items() if k != "_wandb"}
    expected = OmegaConf.to_container(cfg, resolve=True)
    expected["logger"]["wandb"]["group"] = "grp"  # the group the run is in, not null
    assert config == {**expected, "overrides": ["balancer.alpha=0.5", big]}
    assert run.summary["val/lm_loss"] == 2.718281828459045
    raw = list(wandb_read.record_bytes(run.files[0]))
    assert max(map(len, raw)) > 2 * wandb_read.BLOCK  # the chain really was exercised


def test_read_back_rejects_corruption_and_stops_at_a_cut(tmp_path, monkeypatch):
    _, run_dir, logger = _offline_logger(tmp_path, monkeypatch, overrides=[])
    try:
        for s in range(1, 6):
            logger.log({"train/loss": float(s)}, s)
    finally:
        logger.finish()
    (path,) = wandb_read.wandb_files(run_dir)
    data = path.read_bytes()
    n = len(list(wandb_read.record_bytes(path)))
    cut = tmp_path / "cut.wandb"
    cut.write_bytes(data[:len(data) - 5])  # a crash mid-record: the complete records before it are still read
    assert len(list(wandb_read.record_bytes(cut))) == n - 1
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF
    bad = tmp_path / "bad.wandb"
    bad.write_bytes(bytes(flipped))
    with pytest.raises(wandb_read.WandbFileError, match="corrupt record"):
        list(wandb_read.record_bytes(bad))
    (tmp_path / "notwandb.wandb").write_bytes(b"PK\x03\x04" + bytes(20))
    with pytest.raises(wandb_read.WandbFileError, match="header"):
        list(wandb_read.record_bytes(tmp_path / "notwandb.wandb"))
    with pytest.raises(FileNotFoundError, match="no W&B run file"):
        wandb_read.read_run(tmp_path / "cache")


@pytest.mark.slow
def test_a_sweeps_offline_wandb_runs_hold_what_the_points_logged(tmp_path):
    """A real 2-point sweep (experiment=smoke, W&B offline, no network): each point's .wandb file, read with
    wandb's Record proto, holds metrics.jsonl's rows, the resolved config with the overrides, the sweep's group and
    the point's name by its swept override."""
    repo = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_") and k not in ("WORLD_SIZE", "RANK")}
    env.update(WANDB_SILENT="true", PYTHONUNBUFFERED="1", WANDB_MODE="offline",
               PYTHONPATH=os.pathsep.join([str(repo), *filter(None, [os.environ.get("PYTHONPATH")])]))
    sweep_dir = tmp_path / "sweeps" / "ab"
    args = ["-m", "experiment=smoke", "balancer.alpha=0.5,0.9", "logger.wandb.project=readback",
            "logger.wandb.tags=[t1]", f"hydra.sweep.dir={sweep_dir}",
            # W&B settings are not part of a run's identity: without this a point another test of the session
            # finished with the same config is reused, and a reused point logs nothing to W&B
            "trainer.reuse_finished=false"]
    r = kdexp_run(args, env, tmp_path, check=False)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-6000:])
    sweep = records.read_json(sweep_dir / records.SWEEP)
    points = sorted(sweep["points"], key=lambda p: p["num"])
    assert len(points) == 2 and [p["status"] for p in points] == ["finished"] * 2
    for p, alpha in zip(points, ("0.5", "0.9")):
        run_dir = Path(p["run_dir"])
        run = wandb_read.read_run(run_dir)
        assert run.exit_code == 0 and run.project == "readback"
        assert run.tags == ["t1", "loss:topk", "teacher:online", "experiment:smoke", "swept:balancer.alpha"]
        assert run.group == "ab" == sweep_dir.name  # the sweep's directory name
        assert run.name == f"balancer.alpha={alpha}" and f"balancer.alpha={alpha}" in p["overrides"]
        assert run.job_type == "sweep"
        # history: metrics.jsonl's rows of one step merged (train and eval rows share a step), step and kind aside
        logged: dict[int, dict] = {}
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            row = records.loads(line)
            logged.setdefault(row.pop("step"), {}).update({k: v for k, v in row.items() if k != "kind"})
        assert [row["step"] for row in run.metrics()] == sorted(logged) == list(range(1, 7))
        for row in run.metrics():
            expected = logged[row.pop("step")]
            assert row.keys() == expected.keys()
            for key, value in expected.items():
                assert row[key] == pytest.approx(value, rel=1e-12, abs=0), key
        final = records.read_json(run_dir / records.SUMMARY)["final"]
        assert "val/kl_to_teacher" in final
        for key, value in final.items():  # the W&B summary holds the run's final metrics
            assert run.summary[key] == pytest.approx(value, rel=1e-12, abs=0), key
        # config: the point's composed config (.hydra/config.yaml) resolved, plus Hydra's overrides of the point
        composed = OmegaConf.to_container(OmegaConf.load(run_dir / ".hydra" / "config.yaml"), resolve=True)
        composed["logger"]["wandb"]["group"] = "ab"  # logged as the group the run is in
        overrides = list(OmegaConf.load(run_dir / ".hydra" / "overrides.yaml"))
        assert {k: v for k, v in run.config.items() if k != "_wandb"} == {**composed, "overrides": overrides}
        assert run.config["balancer"]["alpha"] == float(alpha) and run.config["trainer"]["max_steps"] == 6


# ---------------------------------------------------------------------------------------------------------------------
# tags, the group in the config, a reused point in the new sweep's group (kdexp.track.loggers)


def _hydra(sweep_dir: Path, overrides: list[str], planned: list[list[str]], choices: dict) -> dict:
    """What HydraConfig.get() holds for a point of a multirun (the parts the loggers read), and its sweep.json."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    records.write_json(sweep_dir / records.SWEEP, {"points": [{"num": i, "overrides": o} for i, o in enumerate(planned)]})
    return OmegaConf.create({"mode": "MULTIRUN", "sweep": {"dir": str(sweep_dir)}, "overrides": {"task": overrides},
                             "runtime": {"choices": {"hydra/launcher": "basic", **choices}}})


def test_tags_and_group_in_the_logged_config(tmp_path, monkeypatch):
    from kdexp.track.loggers import open_loggers

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = OmegaConf.merge(OmegaConf.structured(KdexpConfig), {"logger": {"wandb": {"tags": ["mine"]}},
                                                              "teacher": {"name": "cached"}})
    cfg.paths.cache = cfg.paths.index = str(tmp_path / "cache")
    planned = [[f"arm={a}", f"trainer.seed={s}"] for a in ("before", "after") for s in (1, 2)]
    hc = _hydra(tmp_path / "2026-12-05" / "10-00-00-ab", planned[3], planned,
                {"experiment": "qwen3_before_after", "arm": "after"})
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    loggers = open_loggers(cfg, run_dir, hc, enabled=True)
    try:
        loggers.log({"step": 1, "kind": "train", "train/loss": 2.0}, 1)
    finally:
        loggers.finish()
    run = wandb_read.read_run(run_dir)
    assert run.tags == ["mine", "loss:topk", "teacher:cached", "experiment:qwen3_before_after", "arm:after",
                        "swept:arm", "swept:trainer.seed"]
    assert run.group == "2026-12-05_10-00-00-ab" == run.config["logger"]["wandb"]["group"]
    assert run.name == "arm=after,trainer.seed=2" and run.job_type == "sweep"


def test_a_reused_point_is_a_run_of_the_new_group(tmp_path, monkeypatch):
    from kdexp.track.loggers import log_reused

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = OmegaConf.structured(KdexpConfig)
    cfg.paths.cache = cfg.paths.index = str(tmp_path / "cache")
    original = tmp_path / "old" / "0"
    original.mkdir(parents=True)
    rows = [{"step": 1, "kind": "train", "train/loss": 3.0}, {"step": 2, "kind": "train", "train/loss": 2.5},
            {"step": 2, "kind": "val", "val/lm_loss": 2.75}]
    (original / records.METRICS).write_text("".join(records.dumps(r) + "\n" for r in rows))
    final = {"train/loss": 2.5, "val/lm_loss": 2.75}
    summary = {"status": "finished", "final": final, "reused_from": str(original), "overrides": ["balancer.alpha=0.5"]}
    hc = _hydra(tmp_path / "new", ["balancer.alpha=0.5"], [["balancer.alpha=0.5"], ["balancer.alpha=1.0"]], {})
    run_dir = tmp_path / "new" / "0"
    run_dir.mkdir()
    assert log_reused(cfg, run_dir, hc, summary, enabled=False) is None  # not rank 0: nothing
    log_reused(cfg, run_dir, hc, summary, enabled=True)
    run = wandb_read.read_run(run_dir)
    assert run.group == "new" and run.name == "balancer.alpha=0.5" and run.exit_code == 0
    assert run.config["reused_from"] == str(original) and "reused" in run.tags
    assert run.summary["reused_from"] == str(original)
    assert {k: run.summary[k] for k in final} == final  # the original's final metrics
    assert run.metrics() == [{"step": 1, "train/loss": 3.0}, {"step": 2, "train/loss": 2.5, "val/lm_loss": 2.75}]
