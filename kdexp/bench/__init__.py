"""Benchmarks (python -m kdexp.bench.losses)."""
