"""Builder modules that lm-polygraph's ``polygraph_eval`` imports by name.

An estimator whose ``name`` is not built into lm-polygraph is imported as a module and built with
its ``load_estimator(config)``; a stat calculator's ``builder`` module is imported and built with
``load_stat_calculator(config, environment)``. The wheel installs only ``uhead_vllm``, so this
package is found from the repository's root: run polygraph_eval with ``PYTHONPATH`` naming it
(``PYTHONPATH=$PWD polygraph_eval ...``, as ``experiments/polygraph/run_polygraph.py`` does). Each
module only forwards to :mod:`uhead_vllm.polygraph.builders`, where the logic lives.
"""
