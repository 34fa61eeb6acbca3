"""kdexp.bench.rollout at a tiny size: the last stdout line's JSON, its rates and speedup, identical tokens."""
from __future__ import annotations

import json
import statistics

import pytest

from _lone_process import lone_process
from kdexp.bench import rollout


def test_tiny_rollout_bench_prints_its_json_last(capsys):
    with lone_process():
        rollout.main(["--batch", "2", "--prompt-tokens", "4", "--new-tokens", "3", "--vocab", "256", "--top-p", "0.9",
                      "--repeats", "2", "--threads", "0"])
    lines = capsys.readouterr().out.strip().splitlines()
    r = json.loads(lines[-1])
    assert (r["batch"], r["prompt_tokens"], r["new_tokens"], r["vocab"], r["top_p"]) == (2, 4, 3, 256, 0.9)
    for path in ("kv_cache", "recompute"):
        assert len(r[f"{path}_s"]) == 2
        assert r[f"{path}_tokens_per_s"] == pytest.approx(2 * 3 / statistics.median(r[f"{path}_s"]), rel=1e-12)
    assert r["kv_cache_speedup"] == r["kv_cache_tokens_per_s"] / r["recompute_tokens_per_s"]
    assert r["identical"] is True
    assert any("kv_cache_speedup" in line for line in lines[:-1])


@pytest.mark.parametrize("argv", [["--batch", "0"], ["--new-tokens", "0"], ["--top-p", "1.5"],
                                  ["--temperature", "0"], ["--threads", "-1"]])
def test_bad_arguments_exit_2(argv):
    with pytest.raises(SystemExit) as e:
        rollout.main(argv)
    assert e.value.code == 2
