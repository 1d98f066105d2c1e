"""Runnable studies (benchmarks, data collection, training, evaluation); not part of the package."""
