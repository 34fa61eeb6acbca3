"""python -m kdexp.bench.cache: its JSON last line holds every store's bytes per token, equal to the hand-computed
record sizes (top-K: K x (value bytes + id bytes) + 8 per temperature; hidden: H x value bytes), and one timed build
of each store on the smoke teacher."""
from __future__ import annotations

import json

import pytest

from _launch import kdexp_run


@pytest.mark.slow
def test_bench_cache_prints_every_store(env, tmp_path):
    r = kdexp_run(["--samples", "2", "experiment=smoke", "logger=none"], env, tmp_path, entry="kdexp.bench.cache")
    result = json.loads(r.stdout.strip().splitlines()[-1])
    b = result["bytes_per_token"]
    # smoke vocabulary 2,048: 2-byte ids; Qwen3's 151,936: 3-byte ids
    assert b["topk K_max 1024 float32"] == 1024 * (4 + 2) + 8 and b["topk K_max 32 bfloat16"] == 32 * (2 + 2) + 8
    assert b["qwen3 topk K_max 128 bfloat16"] == 128 * (2 + 3) + 8 == 648
    assert b["hidden embedded teacher (H 256) float32"] == 256 * 4
    assert b["hidden Qwen3-1.7B (H 2048) bfloat16"] == 4096 and b["hidden Qwen3-32B (H 5120) bfloat16"] == 10240
    assert b["sampled 64 draws bfloat16"] == 64 * (2 + 2 + 1) + 8
    built = result["build_s_per_1k_tokens"]
    assert [k.split(" ")[0] for k in built] == ["topk", "sampled", "hidden"] and all(v > 0 for v in built.values())
