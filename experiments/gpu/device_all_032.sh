#!/usr/bin/env bash
# On the GPU machine, after the CUDA vLLM 0.32 carry is installed into $W/site313 (17 parts) and
# the serving part p18 into $W/p18/site313 (experiments/gpu/README_carry.md has the exact calls):
# the server's GPU work, step by step; a failing step does not stop the next.
#   bash experiments/gpu/device_all_032.sh [STEP ...]      # default: tests faults bench grid
# Steps (their own time limits; the sums fit a 600 s call as split in README_carry.md):
#   tests   tests/gpu/test_serving_gpu.py: uhead-vllm serve and the plugin form on the GPU (~4 min)
#   capture tests/gpu's other capture cases (windows, shared prompt rows, reduced inputs, kernels)
#   tp      tests/gpu's TP=2 parity case, alone (two GPUs: a multi-GPU kind; ~2.5 min)
#   faults  tests/test_serving_faults.py against GPU servers (eager: the session server steers and
#           captures points, which only hook eager engines; ~3 min)
#   bench   experiments.serving.bench_gpu --quick: vanilla vLLM vs uhead-vllm serve (~4.5 min)
#   held    experiments.bench.held_takes: the server's held rows on the engine thread (~30 s)
#   churn   experiments.bench.record_churn: the recorder per step under a server's changing batches (~30 s)
#   grid    experiments.bench.grid --quick: capture / plain over prompt length, n, windows (~4.5 min)
#   bench-full, grid-full: the same without --quick (grid-full: one shape and layer count a call,
#           e.g. GRID_ARGS="--shape llama8b --layers 1")
# Extra arguments: BENCH_ARGS, GRID_ARGS (appended), CAPTURE_K (the capture step's -k); each step's limit: TESTS_LIMIT (300 s),
# FAULTS_LIMIT (220), CAPTURE_LIMIT (520), TP_LIMIT (300), BENCH_LIMIT (540), GRID_LIMIT (540). UHEAD_COMMIT names the commit (the machine gets
# a working tree). $OUT gets at most 8 files (the device tool's limit): steps.txt (one line per
# step: name, exit code, seconds), versions.json, each benchmark's .json and .md, and
# logs-<steps>.tgz with every log and the tests' result files.
set -uo pipefail
W=$(python3 -c "import tempfile; print(tempfile.gettempdir())")/w
export OUT=${OUT:-/tmp/out}
SITE=$W/site313
LOGS=$W/logs/$(date +%H%M%S)
mkdir -p "$OUT" "$LOGS"
[ -d "$SITE/vllm" ] || { echo "no vLLM in $SITE: carry and install the 17 parts first (README_carry.md)"; exit 3; }
if [ -d "$W/p18/site313" ]; then  # the serving part: python-multipart, anthropic (no package of the 17 parts)
  cp -rn "$W/p18/site313/." "$SITE/"
else
  echo "note: no $W/p18/site313 (part p18 not installed): form bodies and the anthropic client tests will fail"
fi
export PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1 VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
# uhead_vllm installed behind the checkout (only its entry points matter: the plugin test)
rm -rf "$W/uhead" && python3 -m pip install -q --no-deps --no-index --no-build-isolation --target "$W/uhead" . \
  > "$LOGS/uhead-install.log" 2>&1 || echo "uhead_vllm not installed: the plugin test will skip"
export PYTHONPATH=$SITE:$PWD:$W/uhead
if [ ! -s "$W/versions.json" ]; then  # once per warm machine: the carry imports, the GPU, the versions
  if ! python3 -m experiments.gpu.preflight_313 --out "$W/versions.json" > "$LOGS/preflight.log" 2>&1; then
    echo "preflight failed (nothing else ran):"; tail -n 40 "$LOGS/preflight.log"; rm -f "$W/versions.json"
    tar czf "$OUT/logs-preflight.tgz" -C "$LOGS" . ; exit 3
  fi
fi
cp "$W/versions.json" "$OUT/versions.json"
steps=${*:-tests faults bench grid}
: > "$OUT/steps.txt"

run_step() {  # run_step NAME LIMIT_S COMMAND...: log to $LOGS/NAME.log, one line in steps.txt
  local name=$1 limit=$2 t0 rc
  shift 2
  t0=$(date +%s)
  echo "[$(date +%H:%M:%S)] step $name (limit ${limit} s)"
  timeout -k 5 "$limit" "$@" > "$LOGS/$name.log" 2>&1
  rc=$?
  echo "$name rc=$rc $(( $(date +%s) - t0 ))s" | tee -a "$OUT/steps.txt"
  tail -n 6 "$LOGS/$name.log"
}

for s in $steps; do
  case $s in
    tests)
      mkdir -p "$LOGS/serving-tests"
      UHEAD_GPU_TOKENIZER=.gpu/tok UHEAD_GPU_RESULTS=$LOGS/serving-tests \
        run_step tests "${TESTS_LIMIT:-300}" python3 -m pytest tests/gpu/test_serving_gpu.py -q -rfE -p no:cacheprovider ;;
    capture)
      # tests/gpu's capture cases beyond the 0.32 parity run (which passed): windows and shared prompt
      # rows, reduced head inputs, the scatter kernel and step graphs; TP=2 needs two GPUs
      mkdir -p "$LOGS/capture-tests"
      UHEAD_GPU_TOKENIZER=.gpu/tok UHEAD_GPU_RESULTS=$LOGS/capture-tests VLLM_ENABLE_V1_MULTIPROCESSING=1 \
        run_step capture "${CAPTURE_LIMIT:-520}" python3 -m pytest tests/gpu -n 4 -q -rfE -p no:cacheprovider \
        --ignore=tests/gpu/test_serving_gpu.py -k "${CAPTURE_K:-not rows_equal_hf_on_gpu and not tensor_parallel}" ;;
    tp)
      mkdir -p "$LOGS/capture-tests"
      UHEAD_GPU_TOKENIZER=.gpu/tok UHEAD_GPU_RESULTS=$LOGS/capture-tests \
        run_step tp "${TP_LIMIT:-300}" python3 -m pytest tests/gpu/test_capture_gpu.py -q -rfE -p no:cacheprovider \
        -k tensor_parallel ;;
    faults)
      # every test server eager (points and steering need it) and at 0.2 of the card (two live at once)
      # and on the V1 runner: points and steering refuse Model Runner V2 (measured: every server start failed)
      UHEAD_TEST_SERVER_ARGS="--enforce-eager --gpu-memory-utilization 0.2" VLLM_USE_V2_MODEL_RUNNER=0 \
        run_step faults "${FAULTS_LIMIT:-220}" python3 -m pytest tests/test_serving_faults.py -q -rfE -p no:cacheprovider ;;
    bench|bench-full)  # bench-full: without --quick (the whole serving grid)
      quick=$([ "$s" = bench ] && echo --quick)
      # shellcheck disable=SC2086
      run_step "$s" "${BENCH_LIMIT:-540}" python3 -m experiments.serving.bench_gpu --tokenizer .gpu/tok \
        --out "$LOGS/bench" $quick ${BENCH_ARGS:-}
      cp "$LOGS"/bench/serving-bench-*.json "$LOGS"/bench/serving-bench-*.md "$OUT/" 2>/dev/null
      cat "$LOGS"/bench/serving-bench-*.md 2>/dev/null ;;
    held)  # what a server's held rows cost the engine thread, recorded from the device (~30 s)
      run_step held "${HELD_LIMIT:-120}" python3 -m experiments.bench.held_takes
      cp experiments/results/bench/held_takes-cuda.json experiments/results/bench/held_takes-cuda.md "$OUT/" 2>/dev/null
      cat experiments/results/bench/held_takes-cuda.md 2>/dev/null ;;
    churn)  # the recorder per step as a server drives it (batches that change every step), from the device
      run_step churn "${CHURN_LIMIT:-120}" python3 -m experiments.bench.record_churn
      cp experiments/results/bench/record_churn-cuda.json experiments/results/bench/record_churn-cuda.md "$OUT/" 2>/dev/null
      cat experiments/results/bench/record_churn-cuda.md 2>/dev/null ;;
    grid|grid-full)  # grid-full: without --quick; pick the shape and layer count with GRID_ARGS
      quick=$([ "$s" = grid ] && echo --quick)
      # shellcheck disable=SC2086
      VLLM_ENABLE_V1_MULTIPROCESSING=1 run_step "$s" "${GRID_LIMIT:-540}" python3 -m experiments.bench.grid \
        --tokenizer .gpu/tok --out "$LOGS/grid" $quick ${GRID_ARGS:-}
      cp "$LOGS"/grid/grid-*.json "$LOGS"/grid/grid-*.md "$OUT/" 2>/dev/null
      cat "$LOGS"/grid/grid-*.md 2>/dev/null ;;
    *) echo "unknown step: $s (tests | capture | tp | faults | bench | bench-full | held | churn | grid | grid-full)" | tee -a "$OUT/steps.txt" ;;
  esac
done
# everything else in one archive: logs, the tests' result files (the models' folders left out)
[ -f "$W/install.log" ] && cp "$W/install.log" "$LOGS/"
tar czf "$OUT/logs-$(echo "$steps" | tr ' ' '-').tgz" -C "$LOGS" --exclude='work' .
ls -la "$OUT"
