#!/usr/bin/env bash
# Value study on the GPU machine (vLLM 0.26 installed from wheel parts into $W/site, see
# ../shared/gpu/README.md; the embedded model's wheel and gguf/accelerate are among the parts).
#   bash experiments/value/gpu_run.sh STAGES [extra run_value_study args...]
# Questions come from .cache/value_study/questions (carried; written here by --stages questions).
# Work files stay in $W/value between calls (the machine keeps its temp dir while warm); what a
# later reader needs is copied to $OUT after every stage, so a time-out still returns it.
set -uo pipefail
W=$(python3 -c "import tempfile; print(tempfile.gettempdir())")/w
export PYTHONPATH=$W/site:$PWD VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_FLASHINFER_SAMPLER=0 NCCL_NVLS_ENABLE=0 \
  TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1 UHEAD_VLLM_MODEL_CACHE=$W/models
STAGES=$1; shift
WORK=$W/value
mkdir -p "$WORK" "${OUT:-/tmp/out}"
if [ -d .cache/value_study/questions ]; then rm -rf "$WORK/questions"; cp -r .cache/value_study/questions "$WORK/"; fi
python3 - <<'EOF'
from uhead_vllm.models import embedded_model_path, model_identity
import json, os
ident = model_identity(embedded_model_path())
want = json.load(open("uhead_vllm/heads/default/config.json"))["model_identity"]["weights_fingerprint"]
print("model", ident, "matches the default head's fingerprint:", ident["weights_fingerprint"] == want, flush=True)
EOF
for stage in ${STAGES//,/ }; do
  echo "=== stage $stage $(date +%T)"
  mkdir -p "$OUT/value"
  timeout "${STAGE_TIMEOUT:-3000}" python3 -u -m experiments.value.run_value_study --stages "$stage" --work "$WORK" "$@" \
    > "$OUT/value/$stage.log" 2>&1
  grep -E "^\[|Error|error:" "$OUT/value/$stage.log" | tail -n 40
  cp -r "$WORK/search" "$WORK/step_metrics.json" "$WORK/ranking_head" "$OUT/value/" 2>/dev/null
  [ -f "$WORK/steps/summary.json" ] && cp "$WORK/steps/summary.json" "$OUT/value/steps_summary.json"
done
ls -la "$OUT/value" 2>/dev/null
