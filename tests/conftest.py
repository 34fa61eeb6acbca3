"""Session-wide test setup: no test reads or writes the user's kdexp cache.

KDEXP_CACHE (the tokenizer, token files, dataset indices, the embedded teacher, the finished-points index) is set to a
fresh temporary directory for the whole session, whatever the shell had, and removed at the end; subprocesses the
tests start inherit it. Tests that need a cache of their own still set KDEXP_CACHE themselves; the `env` fixture
below is that, per test module, for the modules that run `python -m kdexp.run` in subprocesses.
"""
from __future__ import annotations

import os
import shutil
import tempfile

import pytest

_SESSION_CACHE: list[str] = []


def pytest_configure(config):
    cache = tempfile.mkdtemp(prefix="kdexp-test-cache-")
    _SESSION_CACHE.append(cache)
    os.environ["KDEXP_CACHE"] = cache


def pytest_unconfigure(config):
    while _SESSION_CACHE:
        shutil.rmtree(_SESSION_CACHE.pop(), ignore_errors=True)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """The environment of a module's kdexp.run subprocesses: a KDEXP_CACHE of the module's own (tokenizer, dataset,
    the embedded teacher: trained once for the module), W&B offline, unbuffered output, no inherited run stamp.
    A module that needs another environment defines its own `env`."""
    e = dict(os.environ)
    e["KDEXP_CACHE"] = str(tmp_path_factory.mktemp("kdexp_cache"))
    e["WANDB_MODE"] = "offline"
    e["PYTHONUNBUFFERED"] = "1"
    e.pop("KDEXP_RUN_STAMP", None)
    return e
