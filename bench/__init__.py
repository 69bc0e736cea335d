"""Benchmarks, load generators, workloads and reports around the crossover daemon.

Nothing in the serving packages imports this package; `crossover bench ...`
parses its flags in daemon/commands/bench.py and calls in here.
"""
