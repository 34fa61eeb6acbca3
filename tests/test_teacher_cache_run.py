"""teacher=cached end to end: config errors before any model (exit 2), and a smoke run that builds the cache then
trains from it to the online run's numbers; bench.step from the cache."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from kdexp.config import validate

SMOKE = ["experiment=smoke", "logger=none"]


def cfg_of(*overrides: str):
    with initialize_config_module(config_module="kdexp.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.mark.parametrize("overrides,message", [
    (["loss.top_k=2000"], r"loss.top_k=2000 is invalid: must be in \[1, teacher.k_max=1024\] with teacher=cached"),
    (["loss=dense"], r"loss.top_k=None is invalid: .* so dense KD cannot be served"),
    (["loss=top_p"], r"loss.top_k=None is invalid: .* a nucleus \(loss.top_p\) not bounded by loss.top_k"),
    (["loss.temperature=2"], r"loss.temperature=2.0 is invalid: must be one of the cached teacher.temperatures \[1.0\]"),
    (["teacher.k_max=5000"], r"teacher.k_max=5000 is invalid: must be in \[1, the vocabulary size 2048\]"),
    (["loss=sampled", "loss.temperature=2"], r"loss.temperature=2.0 is invalid: must be one of the cached "
                                             r"teacher.temperatures \[1.0\]"),
    (["teacher.temperatures=[1.0,1.0]"], "teacher.temperatures=.* must not repeat a temperature"),
    (["teacher.dtype=int8"], "teacher.dtype='int8' is invalid: must be one of float32, bfloat16, float16"),
    (["teacher.shard_samples=0"], r"teacher.shard_samples=0 is invalid: must be an integer >= 1"),
])
def test_what_a_cache_cannot_serve_is_a_config_error(overrides, message):
    with pytest.raises(ValueError, match=message):
        validate(cfg_of("teacher=cached", *overrides))


def test_served_options_validate():
    validate(cfg_of("teacher=cached", "loss.top_k=512", "loss.top_p=0.9", "loss.min_k=4", "loss.divergence=jsd",
                    "teacher.temperatures=[1.0,2.0]", "loss.temperature=2.0", "teacher.dtype=bfloat16"))
    validate(cfg_of("loss=dense"))  # the online teacher serves everything
    # sampled KD from a cache of the draws: top_k is null there and teacher.k_max plays no part
    validate(cfg_of("teacher=cached", "loss=sampled", "loss.proposal_temperature=1.5", "loss.normalize_weights=false",
                    "teacher.temperatures=[1.0,2.0]", "loss.temperature=2.0", "teacher.k_max=1"))



def _run(args, env, cwd, module="kdexp.run"):
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=900)


def _train(run_dir: Path) -> list[dict]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if x["kind"] in ("train", "val")]


def test_cli_config_error_exits_2(env, tmp_path):
    proc = _run(["teacher=cached", "loss=dense", *SMOKE], env, tmp_path)
    assert proc.returncode == 2 and "kdexp: error: loss.top_k=None is invalid" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not (Path(env["KDEXP_CACHE"]) / "teacher_cache").exists()


@pytest.mark.slow
def test_cached_run_builds_the_cache_and_matches_the_online_run(env, tmp_path):
    online = _run([*SMOKE, f"hydra.run.dir={tmp_path / 'online'}"], env, tmp_path)
    assert online.returncode == 0, online.stderr[-4000:]
    cached = _run([*SMOKE, "teacher=cached", "teacher.shard_samples=5", f"hydra.run.dir={tmp_path / 'cached'}"],
                  env, tmp_path)
    assert cached.returncode == 0, cached.stderr[-4000:]
    assert "stage teacher_cache: one teacher pass over 12 samples x 64 tokens" in cached.stdout + cached.stderr
    a, b = _train(tmp_path / "online"), _train(tmp_path / "cached")
    assert [x["step"] for x in a] == [x["step"] for x in b] and len(a) >= 8
    for x, y in zip(a, b):
        for k, v in x.items():
            if k.startswith(("train/", "val/")) and k != "train/lr":
                assert y[k] == pytest.approx(v, rel=1e-4, abs=1e-6), (x["step"], k)
    (cache_dir,) = [p for p in (Path(env["KDEXP_CACHE"]) / "teacher_cache").iterdir() if p.is_dir()]
    assert len(list(cache_dir.glob("shard-*.json"))) == 3 and (cache_dir / "manifest.json").is_file()

    bench = _run(["--steps", "2", "--warmup", "1", *SMOKE, "teacher=cached", "teacher.shard_samples=5"], env,
                 tmp_path, module="kdexp.bench.step")
    assert bench.returncode == 0, bench.stderr[-4000:]
    out = bench.stdout.splitlines()
    assert out[0].endswith("teacher=cached") and "one teacher pass" not in bench.stdout + bench.stderr  # reused, not rebuilt
    times = {line[:40].strip(): float(line[40:]) for line in out[2:4]}
    assert sorted(times) == ["KD train step from the teacher cache", "student fwd+bwd (LM only, no teacher)"]
    assert all(v > 0 for v in times.values()) and out[4].startswith("KD overhead: ")
