#!/usr/bin/env bash
# On the GPU machine, after the torch 2.13 + CUDA vLLM 0.32 parts are installed into $W/site313
# (experiments/gpu/README_carry.md): a preflight that stops early, with the reason, when the carry
# does not import, then any mode of device_run.sh against that vLLM.
#   bash experiments/gpu/device_run_313.sh pytest          # tests/gpu, results under $OUT
#   bash experiments/gpu/device_run_313.sh bench smollm2   # (every device_run.sh mode)
# $OUT/versions.json stamps the run: commit (UHEAD_COMMIT), GPU, torch, triton, vLLM, transformers.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
W=$(python3 -c "import tempfile; print(tempfile.gettempdir())")/w
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# torch 2.13 was built against cuDNN 9.20; the image's 9.19 runs once the check is skipped
# (experiments/results/gpu/carry-torch-2.13/); NVLink multicast stays off as everywhere there.
export SITE=$W/site313 PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1 NCCL_NVLS_ENABLE=0 \
  TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1
[ -d "$SITE/vllm" ] || { echo "no vLLM in $SITE: carry and install the parts first (README_carry.md)"; exit 3; }
if ! PYTHONPATH=$SITE:$PWD python3 -m experiments.gpu.preflight_313 --out "$OUT/versions.json" \
    > "$OUT/preflight.log" 2>&1; then
  echo "preflight failed (nothing else ran):"; tail -n 40 "$OUT/preflight.log"; exit 3
fi
tail -n 1 "$OUT/preflight.log"
exec bash "$HERE/device_run.sh" "$@"
