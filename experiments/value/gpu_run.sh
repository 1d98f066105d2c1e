#!/usr/bin/env bash
# Value study on the GPU machine (vLLM 0.26 installed from wheel parts into $W/site, see
# ../shared/gpu/README.md; the embedded model's wheel, gguf and scikit-learn are among the parts).
#   STUDY_TIMEOUT=480 bash experiments/value/gpu_run.sh STAGES [extra run_value_study args...]
#   UNITS="basic_arithmetic:0 chain_sum_3x1:1" STUDY_TIMEOUT=560 bash experiments/value/gpu_run.sh search
#   UNITS="chain_sum_3x1:0:0/4 chain_sum_3x1:0:1/4 ..." ... one unit's questions in K shard processes
#   STACKS=1 ... each process samples its threads' stacks into $OUT/value/stacks.NAME.txt
#   (experiments/value/stack_sampler.py: collapsed stacks, rewritten every 20 s)
# One process runs all STAGES (one engine start); with UNITS, one search process per task:seed
# runs at once on the same GPU (a 135M model leaves the H100 mostly idle: the tree walk, not the
# GPU, bounds one process), each engine with a share of the GPU memory. Questions come from .cache/value_study/questions
# (carried; written here by --stages questions). Work files stay in $W/value between calls (the
# machine keeps its temp dir while warm); what a later reader needs is copied to $OUT at the end,
# also after a time-out (search units are whole files, written as they finish; a unit's parts
# and step tree, search/*.partial and search/trees, let the next call resume at the cut step).
set -uo pipefail
W=$(python3 -c "import tempfile; print(tempfile.gettempdir())")/w
export PYTHONPATH=$W/site:$PWD VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_FLASHINFER_SAMPLER=0 NCCL_NVLS_ENABLE=0 \
  TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1 UHEAD_VLLM_MODEL_CACHE=$W/models
STAGES=$1; shift
WORK=$W/value
OUT=${OUT:-/tmp/out}
mkdir -p "$WORK" "$OUT/value"
# Carried results of an earlier call (questions, ranking_head, search files, ...) join the work dir;
# files the work dir already has (a warm machine's later call) are newer and stay (-n).
[ -d .cache/value_study ] && cp -rn .cache/value_study/. "$WORK/"
for p in "$WORK"/search/*.partial; do  # a unit finished in an earlier call: its carried parts are stale
  [ -f "${p%.partial}.json" ] && rm -f "$p"
done
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
echo "=== stages $STAGES units ${UNITS:-all} $(date +%T)"
T=$(date +%H%M%S)
run() {  # run NAME ARGS...: one study process, its own log and its own vLLM compile cache (seeded
  local name=$1; shift  # from the first run's, so concurrent engines never write one cache dir)
  [ -d "$W/vcache.main" ] && [ ! -d "$W/vcache.$name" ] && cp -r "$W/vcache.main" "$W/vcache.$name"
  UHEAD_STACK_SAMPLES=$([ "${STACKS:-0}" = 1 ] && echo "$OUT/value/stacks.$name.txt") \
    VLLM_CACHE_ROOT=$W/vcache.$name timeout "${STUDY_TIMEOUT:-3000}" python3 -u "$@" > "$OUT/value/run.$T.$name.log" 2>&1
  echo "$name exit $? $(date +%T)"
}
# Processes go round-robin over the GPUs. Eight processes on one H100 ran slower in total than
# two (docs/value_study.md, "Reproduce"): shards of a unit are meant for several GPUs.
N_PROCS=$(wc -w <<< "${UNITS:-x}")
N_GPUS=$(nvidia-smi -L 2>/dev/null | wc -l); [ "$N_GPUS" -ge 1 ] || N_GPUS=1
PER_GPU=$(( (N_PROCS + N_GPUS - 1) / N_GPUS ))
MEM=$(python3 -c "print(round(0.85 / $PER_GPU, 2))")
KV=(); [ "$PER_GPU" -gt 1 ] && KV=(--kv-cache-gib "$(python3 -c "print(round(48 / $PER_GPU, 1))")")
# Each study process its share of the host's cores for torch's own threads (head features and
# scoring run on the host): two processes with one thread per core each oversubscribe the machine.
THREADS=(--threads $(( $(nproc) / N_PROCS > 0 ? $(nproc) / N_PROCS : 1 )))
K=0
PIDS=()
if [ -n "${UNITS:-}" ]; then
  for u in $UNITS; do  # task:seed or task:seed:I/K (the I-th of K question shards)
    IFS=: read -r task seed shard <<< "$u"
    GPU=$((K % N_GPUS)); K=$((K + 1))
    CUDA_VISIBLE_DEVICES=$GPU run "$task.s$seed${shard:+.${shard/\//of}}" -m experiments.value.run_value_study --stages "$STAGES" --work "$WORK" \
      --tasks "$task" --seeds "$seed" ${shard:+--shard "$shard"} --gpu-memory-utilization "$MEM" "${KV[@]}" "${THREADS[@]}" "$@" & PIDS+=($!)
  done
else
  CUDA_VISIBLE_DEVICES=0 run main -m experiments.value.run_value_study --stages "$STAGES" --work "$WORK" --gpu-memory-utilization "$MEM" "${KV[@]}" "${THREADS[@]}" "$@" & PIDS+=($!)
fi
wait "${PIDS[@]}"
grep -h -E "^\[|Error|error:" "$OUT"/value/run.*.log | tail -n 60
kill %1 2>/dev/null; pack
ls -la "$OUT/value"
