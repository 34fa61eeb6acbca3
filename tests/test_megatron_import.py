"""Importing megatron through kdexp compiles nothing: megatron's jit_fuser (torch.compile on its fused kernels) hands a
kernel to torch.compile on the kernel's first call, not at import (kdexp/__init__.py), so that a process that calls
none of them never imports torch's compiler stack, and one that calls one compiles it as torch.compile would."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import kdexp

REPO = Path(__file__).resolve().parents[1]


def test_importing_megatron_after_kdexp_imports_no_compiler_and_keeps_the_kernels():
    code = ("import sys, kdexp, torch, megatron.core, megatron.core.jit as jit\n"
            "from megatron.core.fusions.fused_bias_geglu import geglu\n"
            "assert jit.jit_fuser is not torch.compile, jit.jit_fuser\n"
            "assert 'torch._inductor.compile_fx' not in sys.modules\n"
            "assert geglu.__wrapped__.__name__ == 'geglu' and callable(geglu)\n"
            "print('ok')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and r.stdout == "ok\n", r.stderr[-3000:]


def test_a_kernel_is_compiled_once_on_its_first_call_with_its_options():
    compiled = []

    def fake_compile(fn, **options):
        compiled.append((fn.__name__, options))
        return lambda *a, **k: ("compiled", fn(*a, **k))

    jit_fuser = kdexp._compile_on_first_call(fake_compile)

    @jit_fuser
    def double(x):
        return 2 * x

    @jit_fuser(fullgraph=True)
    def plus(x, y=1):
        return x + y

    assert compiled == [] and double.__name__ == "double" and plus.__name__ == "plus"
    assert double(3) == ("compiled", 6) and double(4) == ("compiled", 8)
    assert plus(1, y=2) == ("compiled", 3)
    assert compiled == [("double", {}), ("plus", {"fullgraph": True})]  # once each, with the decorator's options
