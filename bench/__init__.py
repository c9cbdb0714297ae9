"""Timing benchmarks, run from the repository root as `python -m bench.<name>`: each prints ratios
against a baseline measured in the same run (BENCHMARKS.md has the current figures)."""
