#!/usr/bin/env bash
# On the GPU machine (one call per part, back to back, from the project root): store this call's
# carried part in DEVTMP/parts; once all parts are there, check the stream's sha256, unpack the stored
# wheels and pip-install them into DEVTMP/site313 (experiments/gpu/carry_newer_torch.sh built them).
#   W=$(python3 -c "import tempfile; print(tempfile.gettempdir())")/w
#   bash .gpunew/pK/carry_install.sh $W .gpunew/pK
# DEVTMP survives only while the machine stays warm: if a call prints fewer stored parts than its
# number, the machine went cold and the parts must be carried again from p1.
set -euo pipefail
D=$1; P=$2
n=$(awk '$1 == "parts" {print $2}' "$P/manifest")
sum=$(awk '$1 == "sha256" {print $2}' "$P/manifest")
mkdir -p "$D/parts"
cp "$P"/part_* "$D/parts/"
have=$(ls "$D/parts" | wc -l)
echo "$(date -u +%FT%TZ) part $(basename "$P") stored ($have of $n)"
[ "$have" -lt "$n" ] && exit 0
t0=$(date +%s)
got=$(cat "$D"/parts/part_* | sha256sum | cut -d' ' -f1)
[ "$got" = "$sum" ] || { echo "sha256 mismatch: $got != $sum"; exit 2; }
rm -rf "$D/wheels" "$D/site313"; mkdir -p "$D/wheels"
unxz() { if command -v xz > /dev/null; then xz -d -T0; else python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer, 1 << 24)"; fi; }
cat "$D"/parts/part_* | unxz | tar -xif - -C "$D/wheels"  # -i: past each stream's end-of-archive
t1=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$D/site313" "$D"/wheels/*.whl
t2=$(date +%s)
echo "unpacked in $((t1 - t0)) s, installed in $((t2 - t1)) s: $(ls "$D/wheels" | tr '\n' ' ')"
echo "use: PYTHONPATH=$D/site313 python3 ..."
