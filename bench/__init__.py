"""fastbert's benchmarks: `pytest bench/` (pytest-benchmark suites), the summary printer, the one-shot GPU check.

A package so that `python -m bench.summarize` and `python -m bench.gpu_check` work from the repository root and the
test files share `bench.harness`.
"""
