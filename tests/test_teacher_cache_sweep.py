"""One teacher pass per teacher and data, whatever the seed (issue 34): a seed sweep of ``experiment=smoke
teacher=cached`` on a cold cache pretrains its embedded teacher once and builds one teacher cache; a later run with
another trainer.seed and another loss.top_k <= K_max builds neither; a run at a shorter trainer.seq_length shares the
teacher. The keys themselves: the embedded teacher's directory follows its own seed and sample length, never
trainer.seed; replicates read the same windows in their own orders.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from _launch import kdexp_run, run_env
from _lone_process import lone_process

SMOKE = ["experiment=smoke", "logger=none"]
PRETRAINED = "stage teacher: pretraining the embedded teacher"
BUILT = "stage teacher_cache: one teacher pass"


def _cfg(*overrides: str):
    from test_teacher_cache_run import cfg_of

    return cfg_of(*SMOKE, *overrides)


def test_the_embedded_teacher_is_keyed_by_its_own_seed_and_length():
    """pretrained_teacher_dir: the same for any trainer.seed and any trainer.seq_length up to
    model.teacher_pretrain_seq_length (smoke: 64); another model.teacher_pretrain_seed, another data.seed or a longer
    trainer.seq_length (the teacher never trained at those positions) is another teacher."""
    from kdexp.train.teacher import pretrain_seq_length, pretrained_teacher_dir

    data = SimpleNamespace(vocab_size=2048, source="tokens")
    with lone_process(seed=0):
        def where(*o):
            return pretrained_teacher_dir(_cfg(*o), data)

        base = where()
        assert where("trainer.seed=7") == where("trainer.seed=8") == base
        assert where("trainer.seq_length=32") == base and pretrain_seq_length(_cfg("trainer.seq_length=32")) == 64
        assert where("trainer.seq_length=128") != base and pretrain_seq_length(_cfg("trainer.seq_length=128")) == 128
        assert where("model.teacher_pretrain_seed=7") != base and where("data.seed=7") != base


@pytest.fixture(scope="module")
def cold(tmp_path_factory):
    """A cold KDEXP_CACHE (nothing built: tokenizer, teacher and cache are made by the sweep below)."""
    return run_env(tmp_path_factory.mktemp("cold") / "cache")


def _caches(env) -> list[Path]:
    root = Path(env["KDEXP_CACHE"]) / "teacher_cache"
    return sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


@pytest.mark.slow
def test_a_seed_sweep_pretrains_once_and_builds_one_cache(cold, tmp_path):
    sweep = tmp_path / "sweep"
    r = kdexp_run(["-m", *SMOKE, "teacher=cached", "trainer.max_steps=3", "trainer.seed=1,2,3",
                   f"hydra.sweep.dir={sweep}"], cold, tmp_path)
    out = r.stdout + r.stderr
    assert out.count(PRETRAINED) == 1 and out.count(BUILT) == 1, out[-4000:]
    assert out.count("stage teacher_cache: reusing") == 2, out[-4000:]
    (cache,) = _caches(cold)
    manifest = json.loads((cache / "manifest.json").read_text())
    assert "training windows [0, 6)" in manifest["holds"] and manifest["key"]["data.seed"] == 1234
    assert "seed" not in {k for k in manifest["key"] if k.startswith("trainer")}
    # the replicates: the same windows, each read in its own order (so their first steps differ)
    firsts = []
    for point in sorted(p for p in sweep.iterdir() if (p / "metrics.jsonl").is_file()):
        lines = [json.loads(x) for x in (point / "metrics.jsonl").read_text().splitlines()]
        firsts.append(next(x["train/kd_loss"] for x in lines if x["kind"] == "train"))
    assert len(firsts) == 3 and len(set(firsts)) == 3, firsts

    # another seed, another K (<= K_max), fewer steps: neither a teacher nor a cache is built
    later = kdexp_run([*SMOKE, "teacher=cached", "trainer.max_steps=2", "trainer.seed=9", "loss.top_k=256",
                       f"hydra.run.dir={tmp_path / 'later'}"], cold, tmp_path)
    out = later.stdout + later.stderr
    assert PRETRAINED not in out and BUILT not in out and "extending" not in out, out[-4000:]
    assert "windows [0, 6) of which this run reads [0, 4)" in out and _caches(cold) == [cache]

    # a shorter sequence length shares the embedded teacher (pretrained at 64 tokens, serving every length up to it)
    short = kdexp_run([*SMOKE, "trainer.max_steps=2", "trainer.seq_length=32", "trainer.seed=5",
                       f"hydra.run.dir={tmp_path / 'short'}"], cold, tmp_path)
    assert PRETRAINED not in short.stdout + short.stderr
