"""kdexp.train.checkpoint: atomic save, the ``latest`` pointer, sha256 manifests, rotation, fallback to the newest
intact step (with a warning naming the bad file), clear errors instead of a silent restart, config-hash refusal.

Unit tests run save/load in this process (a one-process gloo group); one subprocess test truncates the latest
checkpoint of a real smoke run and resumes it.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re

import pytest
import torch

from _launch import kdexp_run, run_env
from _lone_process import lone_process as _lone_process
from kdexp.track import faults
from kdexp.train import checkpoint as ck



@pytest.fixture(scope="module", autouse=True)
def lone_process():
    with _lone_process(seed=1):
        yield


@pytest.fixture
def caplog_kdexp(caplog):
    caplog.set_level(logging.INFO, logger="kdexp")
    return caplog


def state(step: int, config_hash: str = "abc") -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(4, 3, generator=g)}, "step": step, "config_hash": config_hash}


def save_steps(ckpt, steps, **kw):
    for s in steps:
        ck.save(ckpt, s, state(s), **kw)


def test_save_writes_the_file_its_manifest_and_latest(tmp_path):
    ckpt = tmp_path / "checkpoints"
    ck.save(ckpt, 3, state(3))
    f = ckpt / "step_3" / "tp0.pt"
    manifest = json.loads((ckpt / "step_3" / "tp0.json").read_text())
    assert manifest == {"file": "tp0.pt", "bytes": f.stat().st_size, "step": 3,
                        "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
    assert (ckpt / "latest").read_text() == "3\n"
    assert sorted(p.name for p in ckpt.rglob("*")) == ["latest", "step_3", "tp0.json", "tp0.pt"]  # no temp files
    loaded = ck.load(ckpt, config_hash="abc")
    assert loaded["step"] == 3 and torch.equal(loaded["model"]["w"], state(3)["model"]["w"])


def test_rotation_keeps_the_newest_steps_and_drops_an_abandoned_timeline(tmp_path):
    ckpt = tmp_path / "checkpoints"
    save_steps(ckpt, [1, 2, 3, 4])
    assert ck.steps_on_disk(ckpt) == [3, 4]
    save_steps(ckpt, [5, 6], keep=3)
    assert ck.steps_on_disk(ckpt) == [4, 5, 6]
    ck.save(ckpt, 2, state(2))  # a run that fell back: steps after the one written belong to no timeline now
    assert ck.steps_on_disk(ckpt) == [2] and ck.latest_step(ckpt) == 2
    with pytest.raises(ValueError, match="keep=0"):
        ck.save(ckpt, 3, state(3), keep=0)


def test_a_crash_while_writing_leaves_no_partial_file_and_the_previous_step_loads(tmp_path, monkeypatch,
                                                                                caplog_kdexp):
    ckpt = tmp_path / "checkpoints"
    save_steps(ckpt, [3])
    real_save = torch.save

    def crash_midway(obj, f, *a, **k):
        f.write(b"\x80half a pickle")  # some bytes reach the temp file, then the process dies
        raise KeyboardInterrupt("killed mid-save")

    monkeypatch.setattr(torch, "save", crash_midway)
    with pytest.raises(KeyboardInterrupt):
        ck.save(ckpt, 6, state(6))
    monkeypatch.setattr(torch, "save", real_save)
    assert list((ckpt / "step_6").iterdir()) == []  # neither tp0.pt nor its temp file
    assert ck.latest_step(ckpt) == 3
    assert ck.load(ckpt)["step"] == 3
    assert "step_6: their save never completed" in caplog_kdexp.text


def test_a_file_without_its_manifest_is_never_trusted(tmp_path, monkeypatch):
    ckpt = tmp_path / "checkpoints"
    save_steps(ckpt, [3])

    def killed(*a, **k):
        raise KeyboardInterrupt("killed between the file and its manifest")

    monkeypatch.setattr(ck.records, "write_json", killed)
    with pytest.raises(KeyboardInterrupt):
        ck.save(ckpt, 6, state(6))
    monkeypatch.undo()
    assert (ckpt / "step_6" / "tp0.pt").is_file() and not (ckpt / "step_6" / "tp0.json").exists()
    assert "no readable checksum manifest" in ck.verify(ckpt / "step_6" / "tp0.pt")
    assert ck.load(ckpt)["step"] == 3


def test_an_interrupted_first_save_starts_over_instead_of_failing_forever(tmp_path):
    ckpt = tmp_path / "checkpoints"
    (ckpt / "step_3").mkdir(parents=True)
    (ckpt / "step_3" / ".tp0.pt.tmp").write_bytes(b"\x80torn")  # SIGKILL during the very first save
    assert ck.load(ckpt) is None


def test_verify_names_the_file_and_what_is_wrong(tmp_path):
    ckpt = tmp_path / "checkpoints"
    save_steps(ckpt, [3])
    f = ckpt / "step_3" / "tp0.pt"
    assert ck.verify(f) is None
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one bit flipped
    f.write_bytes(bytes(data))
    assert ck.verify(f).startswith(f"{f} fails its checksum (sha256 ")
    f.write_bytes(bytes(data[:100]))
    assert ck.verify(f) == f"{f} is 100 bytes, its manifest says {len(data)} (truncated or overwritten)"
    f.unlink()
    assert ck.verify(f) == f"{f} is missing"


def test_a_truncated_latest_falls_back_to_the_previous_intact_step_with_a_warning(tmp_path, caplog_kdexp):
    ckpt = tmp_path / "checkpoints"
    save_steps(ckpt, [3, 6])
    bad = ckpt / "step_6" / "tp0.pt"
    bad.write_bytes(bad.read_bytes()[:-7])
    loaded = ck.load(ckpt, config_hash="abc")
    assert loaded["step"] == 3 and torch.equal(loaded["model"]["w"], state(3)["model"]["w"])
    assert f"checkpoint step 6 is not intact: {bad} is " in caplog_kdexp.text
    assert "trying step 3" in caplog_kdexp.text and "resuming from the intact step 3 instead" in caplog_kdexp.text


def test_a_checksummed_file_that_does_not_unpickle_is_skipped_too(tmp_path, caplog_kdexp):
    ckpt = tmp_path / "checkpoints"
    save_steps(ckpt, [3, 6])
    bad = ckpt / "step_6" / "tp0.pt"
    bad.write_bytes(b"not a torch file")  # and a manifest that matches it: written so, e.g. by a foreign tool
    ck.records.write_json(bad.with_suffix(".json"), {"file": "tp0.pt", "bytes": bad.stat().st_size,
                                                     "sha256": ck.sha256_file(bad), "step": 6})
    assert ck.load(ckpt)["step"] == 3
    assert f"{bad} does not load: " in caplog_kdexp.text


def test_a_step_dir_holding_another_step_is_rejected(tmp_path, caplog_kdexp):
    ckpt = tmp_path / "checkpoints"
    save_steps(ckpt, [3, 6])
    for name in ("tp0.pt", "tp0.json"):  # step_6 overwritten with step 3's files
        (ckpt / "step_6" / name).write_bytes((ckpt / "step_3" / name).read_bytes())
    assert ck.load(ckpt)["step"] == 3
    assert "tp0.pt holds step 3" in caplog_kdexp.text


@pytest.mark.parametrize("pointer", [b"garbage\n", b"\xff\xfe\x00", b"99\n", None])
def test_a_garbage_or_missing_latest_falls_back_to_the_newest_step_dir(tmp_path, caplog_kdexp, pointer):
    ckpt = tmp_path / "checkpoints"
    save_steps(ckpt, [3, 6])
    if pointer is None:
        (ckpt / "latest").unlink()
    else:
        (ckpt / "latest").write_bytes(pointer)
    assert ck.load(ckpt)["step"] == 6  # never a silent restart from 0
    assert "falling back to the newest intact step dir of [3, 6]" in caplog_kdexp.text
    assert ("latest is missing" if pointer is None else "latest holds ") in caplog_kdexp.text


def test_a_latest_pointer_without_any_step_is_an_error(tmp_path):
    ckpt = tmp_path / "checkpoints"
    save_steps(ckpt, [3])
    ck.shutil.rmtree(ckpt / "step_3")
    with pytest.raises(RuntimeError, match=r"latest holds '3', not a step on disk, and no checkpoint step is left"):
        ck.load(ckpt)
    (ckpt / "latest").write_text("garbage")
    with pytest.raises(RuntimeError, match="remove the directory to start over"):
        ck.load(ckpt)


def test_no_checkpoint_directory_is_a_fresh_start(tmp_path):
    assert ck.load(tmp_path / "checkpoints") is None


def test_all_steps_corrupt_is_an_error_naming_every_file(tmp_path):
    ckpt = tmp_path / "checkpoints"
    save_steps(ckpt, [3, 6])
    for s in (3, 6):
        f = ckpt / f"step_{s}" / "tp0.pt"
        f.write_bytes(f.read_bytes()[:50])
    with pytest.raises(RuntimeError) as info:
        ck.load(ckpt)
    msg = str(info.value)
    assert msg.startswith(f"no intact checkpoint in {ckpt} (steps [6, 3] all failed: ")
    assert str(ckpt / "step_6" / "tp0.pt") in msg and str(ckpt / "step_3" / "tp0.pt") in msg
    assert "remove the directory to start over" in msg
    # a damaged file: a single run ends with the message as one line, exit 1, not a traceback
    assert faults.ending(info.value) == faults.Ending(1, f"kdexp: error: {msg}", None)


def test_a_checkpoint_of_another_config_is_not_resumed(tmp_path, caplog_kdexp):
    ckpt = tmp_path / "checkpoints"
    save_steps(ckpt, [3])
    assert ck.load(ckpt, config_hash="other") is None
    assert "it was written by another config" in caplog_kdexp.text
    assert ck.load(ckpt, config_hash="abc")["step"] == 3
    assert ck.load(ckpt)["step"] == 3  # no hash given: no check


# ---------------------------------------------------------------------------------------------------------------------
# a real run resumed after its latest checkpoint was truncated

@pytest.mark.slow
def test_a_run_whose_latest_checkpoint_is_truncated_resumes_from_the_previous_step(tmp_path, seeded_cache):
    env = run_env(seeded_cache(tmp_path / "cache"), WANDB_MODE="disabled")

    def run(run_dir):
        return kdexp_run(["experiment=smoke", "logger=none", f"hydra.run.dir={run_dir}"], env, tmp_path)

    run_dir = tmp_path / "run"
    run(run_dir)
    # the reference: this run's own summary before the damage, an uninterrupted run of the same config and seed
    ref = json.loads((run_dir / "summary.json").read_text())
    bad = run_dir / "checkpoints" / "step_6" / "tp0.pt"  # checkpoints at 3 and 6 (smoke: every 3 steps)
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    (run_dir / "summary.json").unlink()  # as if the run died between its last checkpoint and its summary
    proc = run(run_dir)
    log = proc.stdout + proc.stderr
    assert f"checkpoint step 6 is not intact: {bad} is " in log and "resuming from step 3" in log
    summary = json.loads((run_dir / "summary.json").read_text())
    final = {k: v for k, v in summary["final"].items() if not k.startswith("perf/")}
    assert final == pytest.approx({k: v for k, v in ref["final"].items() if not k.startswith("perf/")}, rel=1e-5)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if x["kind"] == "train"] == [1, 2, 3, 4, 5, 6]  # steps 4-6 redone once
    assert ck.verify(bad) is None and ck.load(run_dir / "checkpoints")["step"] == 6  # rewritten intact


# ---------------------------------------------------------------------------------------------------------------------
# nothing read back runs code (issue 26)

MARKER_CODE = "open({marker!r}, 'w').write('ran')"


class _RunsCode:
    """A pickle payload that calls exec(...) when unpickled (what a crafted checkpoint does)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (MARKER_CODE.format(marker=self.marker),)


def _plant(path, obj):
    """Replace a checkpoint file with `obj` and a manifest that matches it (the sha256 guards against damage only)."""
    torch.save(obj, path)
    ck.records.write_json(path.with_suffix(".json"), {"file": path.name, "bytes": path.stat().st_size,
                                                      "sha256": ck.sha256_file(path), "step": 6})


def test_a_crafted_checkpoint_that_would_run_code_is_refused_and_never_runs(tmp_path):
    ckpt = tmp_path / "checkpoints"
    save_steps(ckpt, [3, 6])
    marker = tmp_path / "marker"
    crafted = ckpt / "step_6" / "tp0.pt"
    _plant(crafted, {**state(6), "model": {"w": _RunsCode(marker)}})
    # the payload does run under the unpickler torch used before (so this test would catch its return)
    torch.load(crafted, weights_only=False)
    assert marker.read_text() == "ran"
    marker.unlink()
    with pytest.raises(ck.UnsafeCheckpoint) as err:
        ck.load(ckpt, config_hash="abc")
    assert not marker.exists()
    # one line naming the file, what it asked for, and the fix; no fallback to step 3 of a tampered run dir
    assert str(err.value).splitlines() == [
        f"{crafted} is not a kdexp checkpoint: it asks the unpickler for exec, not only tensors and plain values, so "
        f"it could run code and was not loaded; kdexp never writes such a file: remove {crafted.parent} (or the run "
        "dir) if you did not put it there"]
    _plant(crafted, {**state(6), "model": {"w": _OsSystem(marker)}})  # a module function (posix.system)
    with pytest.raises(ck.UnsafeCheckpoint, match=r"asks the unpickler for posix.system, not only"):
        ck.load(ckpt, config_hash="abc")
    assert not marker.exists()


class _OsSystem(_RunsCode):
    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_every_state_the_loop_saves_is_plain_and_a_foreign_object_is_refused_at_the_save(tmp_path):
    ckpt = tmp_path / "checkpoints"
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    ck.save(ckpt, 1, {"model": model.state_dict(), "optimizer": opt.state_dict(), "rng": torch.get_rng_state(),
                      "meter": {"sums": {"train/loss": torch.tensor(1.0)}, "count": 1}, "last_train": {"a": 1.0},
                      "last_eval": {}, "step": 1, "skipped": 0, "config_hash": "abc"})
    loaded = ck.read_state(ckpt / "step_1" / "tp0.pt")
    assert loaded["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)
    torch.testing.assert_close(loaded["optimizer"]["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"],
                               rtol=0, atol=0)
    from collections import defaultdict

    for bad, where in (({"x": defaultdict(int)}, "state['x']"), ({"x": [object()]}, "state['x'][0]"),
                       ({"x": {(1, 2): 1}}, "state['x']")):
        with pytest.raises(TypeError, match=rf"^checkpoint {re.escape(where)} "):
            ck.save(ckpt, 2, {**state(2), **bad})
    assert ck.steps_on_disk(ckpt) == [1]  # nothing written for the refused states


def _rank0_cannot_write(rank, world_size, root):
    """TP=2 over gloo: rank 0's checkpoint file meets a full disk (torch.save turns ENOSPC into a RuntimeError whose
    context is the OSError), rank 1's write succeeds. Then both save the next step normally."""
    from pathlib import Path

    from _disk import raise_full_disk
    from kdexp import distributed
    from kdexp.track import faults

    distributed.initialize(tensor_parallel=2)
    ckpt = Path(root) / "checkpoints"
    real = ck.atomic_torch_save
    if rank == 0:
        ck.atomic_torch_save = raise_full_disk
    try:
        ck.save(ckpt, 3, state(3))
        outcome = "saved"
    except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
        fault = faults.disk_fault(exc)
        outcome = faults.describe(fault) if fault is not None else f"{type(exc).__name__}: {exc}"
    ck.atomic_torch_save = real
    mine = state(4)
    mine["model"]["w"] = mine["model"]["w"] + rank  # each TP rank its own shard
    ck.save(ckpt, 4, mine)  # the ranks are still in step: the next collective save works
    return outcome, ck.latest_step(ckpt), ck.load(ckpt)["model"]["w"]


@pytest.mark.slow
def test_a_write_that_fails_on_one_tp_rank_stops_every_rank_with_its_cause_no_hang(tmp_path):
    """Before, rank 1 waited at the save's barrier for rank 0 forever; now both raise rank 0's disk fault (the one
    line names the path and the cause on either rank), nothing of step 3 is committed, and step 4 saves and loads."""
    from kdexp.distributed.testing import run_on_processes

    results = run_on_processes(_rank0_cannot_write, 2, args=(str(tmp_path),), timeout=180)  # a hang fails here
    line = f"cannot write {tmp_path / 'checkpoints' / 'step_3'}: No space left on device (ENOSPC)"
    assert [r[0] for r in results] == [line, line]
    assert [r[1] for r in results] == [4, 4]
    for rank, (_, _, w) in enumerate(results):  # each TP rank loads its own shard of step 4
        assert torch.equal(w, state(4)["model"]["w"] + rank)
    assert not (tmp_path / "checkpoints" / "step_3").exists()  # rank 1's file of the failed step is not kept
