#!/usr/bin/env bash
# collect -> train -> evaluate on the embedded SmolLM2-135M-Instruct, CPU only.
# Writes experiments/results/study/{results.md,results.json,*.png} (data/ and heads/ are ignored by git).
# Extra arguments go to the study command, e.g. --quick for a smoke run or --reuse-data.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-.venv/bin/python}"
exec "$PY" -m uhead_vllm.study study --out experiments/results/study --threads 1 "$@"
