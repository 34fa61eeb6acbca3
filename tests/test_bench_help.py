"""Every benchmark's --help as a user sees it: a usage line naming the command (``python -m kdexp.bench.X``, not a
file), every flag's default, and nothing else on stderr (megatron's Transformer Engine / Apex import warnings are
filtered where kdexp is imported, kdexp/__init__.py)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCHES = sorted(p.stem for p in (REPO / "kdexp" / "bench").glob("*.py")
                 if p.stem != "__init__" and 'if __name__ == "__main__"' in p.read_text())


def test_every_benchmark_with_a_command_line_is_listed():
    assert {"attention", "gpu", "head", "losses", "step", "teacher"} <= set(BENCHES)


@pytest.mark.parametrize("bench", BENCHES)
def test_help_has_a_usage_line_defaults_and_no_warnings(bench):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    r = subprocess.run([sys.executable, "-m", f"kdexp.bench.{bench}", "--help"], capture_output=True, text=True,
                       env=env, cwd=REPO, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr == ""  # no megatron warnings, nothing else
    assert r.stdout.startswith(f"usage: python -m kdexp.bench.{bench} "), r.stdout[:200]
    options = r.stdout.split("\noptions:\n", 1)[1]
    entries = re.split(r"\n  (?=-)", "\n" + options.strip("\n"))  # one entry per flag, its wrapped help joined
    flags = [e for e in entries if e.strip() and not e.strip().startswith("-h, --help")]
    assert flags, r.stdout
    for entry in flags:
        assert "(default:" in " ".join(entry.split()), entry
