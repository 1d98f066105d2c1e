"""Builder modules that lm-polygraph's ``polygraph_eval`` imports by name.

An estimator whose ``name`` is not built into lm-polygraph is imported as a module and built with
its ``load_estimator(config)``; a stat calculator's ``builder`` module is imported and built with
``load_stat_calculator(config, environment)``. This package is installed with ``uhead_vllm``
(``pip install -e .``), so ``name: estimators.uhead_sequence`` resolves from any directory.
Each module only forwards to :mod:`uhead_vllm.polygraph.builders`, where the logic lives.
"""
