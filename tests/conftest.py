"""Session-wide test setup: no test reads or writes the user's kdexp cache.

KDEXP_CACHE (the tokenizer, token files, dataset indices, the embedded teacher, the finished-points index) is set to a
fresh temporary directory for the whole session, whatever the shell had, and removed at the end; subprocesses the
tests start inherit it. Tests that need a cache of their own still set KDEXP_CACHE themselves.
"""
from __future__ import annotations

import os
import shutil
import tempfile

_SESSION_CACHE: list[str] = []


def pytest_configure(config):
    cache = tempfile.mkdtemp(prefix="kdexp-test-cache-")
    _SESSION_CACHE.append(cache)
    os.environ["KDEXP_CACHE"] = cache


def pytest_unconfigure(config):
    while _SESSION_CACHE:
        shutil.rmtree(_SESSION_CACHE.pop(), ignore_errors=True)
