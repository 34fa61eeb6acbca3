"""kdexp.bench.attention at a tiny size: the table, the last stdout line's JSON and the ratios it reports."""
from __future__ import annotations

import json

import pytest

from _lone_process import lone_process
from kdexp.bench import attention


def test_tiny_attention_bench_prints_its_json_last(capsys):
    with lone_process():
        attention.main(["--seq", "64", "--batch", "2", "--repeats", "1", "--size", "tiny-student"])
    lines = capsys.readouterr().out.strip().splitlines()
    r = json.loads(lines[-1])
    assert (r["seq"], r["batch"], r["heads"], r["kv_heads"], r["head_dim"]) == (64, 2, 4, 2, 32)
    for name in ("sdpa", "megatron"):
        assert r[name]["peak_bytes"] > 0 and len(r[name]["ms"]) == 1 and r[name]["median_ms"] > 0
    assert r["memory_ratio"] == r["sdpa"]["peak_bytes"] / r["megatron"]["peak_bytes"]
    assert r["time_ratio"] == r["sdpa"]["median_ms"] / r["megatron"]["median_ms"]
    # even at 64 tokens megatron's [b x heads, s, s] scores (buffer, fp32 softmax, its gradient) outweigh SDPA's
    # log-sum-exp
    assert r["memory_ratio"] < 1
    assert r["meets_goals"] == (r["memory_ratio"] <= 0.25 and r["time_ratio"] <= 1.0)
    assert any(line.strip().startswith("ratio sdpa/megatron") for line in lines[:-1])


def test_bad_arguments_exit_2():
    with pytest.raises(SystemExit) as e:
        attention.main(["--seq", "0"])
    assert e.value.code == 2
