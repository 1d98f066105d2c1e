#!/usr/bin/env bash
# Value study on the GPU machine (vLLM 0.26 installed from wheel parts into $W/site, see
# ../shared/gpu/README.md; the embedded model's wheel, gguf and scikit-learn are among the parts).
#   STUDY_TIMEOUT=480 bash experiments/value/gpu_run.sh STAGES [extra run_value_study args...]
# One process runs all STAGES (one engine start). Questions come from .cache/value_study/questions
# (carried; written here by --stages questions). Work files stay in $W/value between calls (the
# machine keeps its temp dir while warm); what a later reader needs is copied to $OUT at the end,
# also after a time-out (search units are whole files, written as they finish).
set -uo pipefail
W=$(python3 -c "import tempfile; print(tempfile.gettempdir())")/w
export PYTHONPATH=$W/site:$PWD VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_FLASHINFER_SAMPLER=0 NCCL_NVLS_ENABLE=0 \
  TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1 UHEAD_VLLM_MODEL_CACHE=$W/models
STAGES=$1; shift
WORK=$W/value
OUT=${OUT:-/tmp/out}
mkdir -p "$WORK" "$OUT/value"
# Carried results of an earlier call (questions, ranking_head, search files, ...) join the work dir.
[ -d .cache/value_study ] && cp -r .cache/value_study/. "$WORK/"
pack() { (cd "$WORK" && tar czf "$OUT/value/results.tmp" search step_metrics.json ranking_head steps/summary.json 2>/dev/null;
          mv "$OUT/value/results.tmp" "$OUT/value/results.tgz"); }
(while sleep 15; do pack; done) &  # a call cut off by its time limit still returns finished units
python3 - <<'PY'
from uhead_vllm.models import embedded_model_path, model_identity
import json
ident = model_identity(embedded_model_path())
want = json.load(open("uhead_vllm/heads/default/config.json"))["model_identity"]["weights_fingerprint"]
print("model", ident, "matches the default head's fingerprint:", ident["weights_fingerprint"] == want, flush=True)
PY
echo "=== stages $STAGES $(date +%T)"
timeout "${STUDY_TIMEOUT:-3000}" python3 -u -m experiments.value.run_value_study --stages "$STAGES" --work "$WORK" "$@" \
  > "$OUT/value/run.$(date +%H%M%S).log" 2>&1
echo "exit $? $(date +%T)"
grep -h -E "^\[|Error|error:" "$OUT"/value/run.*.log | tail -n 60
kill %1 2>/dev/null; pack
ls -la "$OUT/value"
