"""Benchmarks of hidden-state capture: throughput cost, the common approach, memory, prefix reuse.

Run ``python -m experiments.bench.run`` (full, embedded model) or ``--quick`` (tiny model).
"""
