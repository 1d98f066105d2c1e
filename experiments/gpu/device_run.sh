#!/usr/bin/env bash
# On the GPU machine, after vLLM's wheel parts are installed into $W/site (../shared/gpu/README.md;
# device_run_313.sh runs the same modes against torch 2.13 + vLLM 0.32 in $W/site313):
# the GPU tests or the throughput benchmark, everything a reader needs written under $OUT.
#   bash experiments/gpu/device_run.sh pytest                    # tests/gpu, parity files as one tgz
#   bash experiments/gpu/device_run.sh bench SHAPE [bench args]  # SHAPE: smollm2 | llama8b
#   ENGINE_PROCESS=1 bash experiments/gpu/device_run.sh bench ...  # vLLM's default separate engine process
#   ENGINE_PROCESS=1 bash experiments/gpu/device_run.sh pytest     # the GPU tests that way (rows via shared memory)
#   ENGINE_PROCESS=1 bash experiments/gpu/device_run.sh ablate SHAPE  # capture's cost inside generate, split
#   ENGINE_PROCESS=1 bash experiments/gpu/device_run.sh trace SHAPE   # placed vs untagged on the GPU timeline
#   bash experiments/gpu/device_run.sh words   # the device's row-file writer by copy word, beside matmuls (~30 s)
#   bash experiments/gpu/device_run.sh probe   # how busy the host's cores are (~5 s; bench and ablate run it first)
# The carried tokenizer folder is .gpu/tok (tokenizer.json, tokenizer_config.json, chat_template.jinja);
# UHEAD_COMMIT names the commit (the machine gets a working tree, not the repository).
set -uo pipefail
W=$(python3 -c "import tempfile; print(tempfile.gettempdir())")/w
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# uhead_vllm itself is installed (metadata only matters: vLLM finds its plugin entry points) behind $PWD
rm -rf "$W/uhead" && python3 -m pip install -q --no-deps --no-index --no-build-isolation --target "$W/uhead" . \
  >/dev/null 2>&1 || echo "uhead_vllm not installed: the plugin test will skip"
# SITE: where the carried vLLM is installed ($W/site: vLLM 0.26 on the image's torch; device_run_313.sh
# sets $W/site313: torch 2.13 + vLLM 0.32)
SITE=${SITE:-$W/site}
export PYTHONPATH=$SITE:$PWD:$W/uhead VLLM_ENABLE_V1_MULTIPROCESSING=${ENGINE_PROCESS:-0} VLLM_USE_FLASHINFER_SAMPLER=0 \
  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1
what=$1; shift
probe() {  # the host's cores before a measurement (experiments/gpu/host_probe.py): a busy host shows here in ~5 s
  python3 -m experiments.gpu.host_probe --out "$1" 2>&1 | tail -n 1
}
case $what in
  pytest)
    rm -rf "$W/parity"; mkdir -p "$W/parity"
    # tests/gpu ran 276-330 s on lent H100s: the limit leaves room for the install before it
    UHEAD_GPU_TOKENIZER=.gpu/tok UHEAD_GPU_RESULTS=$W/parity timeout "${TIMEOUT:-480}" \
      python3 -m pytest tests/gpu -n 5 -q -p no:cacheprovider > "$OUT/pytest-gpu.log" 2>&1
    echo "pytest exit $?"; tail -n 3 "$OUT/pytest-gpu.log"
    tar czf "$OUT/parity.tgz" -C "$W/parity" . ;;
  bench)
    shape=$1; shift
    dir=$OUT/bench-$shape$([ "${ENGINE_PROCESS:-0}" = 1 ] && echo -engine-process)
    mkdir -p "$dir"
    probe "$dir"
    timeout "${TIMEOUT:-540}" python3 -m experiments.gpu.bench_gpu --shape "$shape" --tokenizer .gpu/tok \
      --out "$dir" "$@" 2>&1 | grep -E "^\[bench\]|Error|Warning: uhead_vllm" | tail -n 20
    cat "$dir"/bench-*.md 2>/dev/null | tail -n 16 ;;
  ablate)  # with ENGINE_PROCESS=1: capture's cost inside generate, split (experiments/gpu/ablate_capture.py)
    shape=$1; shift
    probe "$OUT/ablate"
    timeout "${TIMEOUT:-300}" python3 -m experiments.gpu.ablate_capture --shape "$shape" --tokenizer .gpu/tok \
      --out "$OUT/ablate" "$@" 2>&1 | grep -E "^\||Error" | tail -n 12 ;;
  trace)  # with ENGINE_PROCESS=1: placed vs untagged decode steps on the GPU timeline (experiments/gpu/trace_steps.py)
    shape=$1; shift
    timeout "${TIMEOUT:-300}" python3 -m experiments.gpu.trace_steps --shape "$shape" --tokenizer .gpu/tok \
      --out "$OUT/trace" "$@" 2>&1 | grep -E "^\[trace\]|Error" | tail -n 20
    cat "$OUT/trace/trace-steps.md" 2>/dev/null | head -n 60 ;;
  words)  # experiments/gpu/writer_words.py
    timeout "${TIMEOUT:-120}" python3 -m experiments.gpu.writer_words --out "$OUT/words" 2>&1 | tail -n 40 ;;
  probe) probe "$OUT" ;;
  *) echo "unknown: $what (pytest | bench SHAPE | ablate SHAPE | trace SHAPE | words | probe)"; exit 2 ;;
esac
