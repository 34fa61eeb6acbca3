"""Benchmarks, each a module with its own command line: ``python -m kdexp.bench.<name> --help`` for losses, head,
attention, step, teacher, cache (teacher-cache record sizes and builds: docs/teacher-cache.md) and gpu
(docs/benchmarks.md says what each measures and prints its numbers)."""
from __future__ import annotations

import argparse


def parser(module: str, description: str) -> argparse.ArgumentParser:
    """A benchmark's argument parser: its usage line names the command (``python -m kdexp.bench.X``, not the file)
    and --help shows every flag's default."""
    return argparse.ArgumentParser(prog=f"python -m {module}", description=description,
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
