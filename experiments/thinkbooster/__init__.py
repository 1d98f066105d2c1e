"""thinkbooster study: head-scored step strategies vs baselines (run_study.py)."""
