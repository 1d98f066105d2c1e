"""Scale-out: a job's work units run on a pool of engine replicas on Ray (local or a cluster).

The jobs themselves (``study.collect``, ``scoring.answer``) define what a unit is and write its
results; this package only places units on actors, replaces dead ones and redoes their units.
Ray is the optional extra ``ray`` (``pip install 'uhead-vllm[ray]'``)."""

from .ray_pool import NAMESPACE, PoolStats, RayOptions, run_units

__all__ = ["NAMESPACE", "PoolStats", "RayOptions", "run_units"]
