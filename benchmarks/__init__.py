"""Benchmarks and the end-to-end demo: `python -m benchmarks.demo`, `python -m benchmarks.bench_load`."""
