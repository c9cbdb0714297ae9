"""Research scripts of past issues, run from the repository root as `python -m dev.experiments.<name>`;
each module docstring names the BENCHMARKS.md (or dev/LOG.md) section it produced."""
