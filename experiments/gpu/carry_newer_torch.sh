#!/usr/bin/env bash
# Carry a newer torch + triton than the GPU machine's image (torch 2.11.0+cu130, no internet) there,
# in parts small enough for one device call each. vLLM 0.27-0.32 pin torch 2.13.0 + triton 3.7.1;
# this is the first step towards them (experiments/gpu/README_carry.md has the recipe and results).
#   cd <checkout the device tool sends> && bash <path>/experiments/gpu/carry_newer_torch.sh [DEST]
# DEST defaults to .gpunew in the current checkout and is added to its .git/info/exclude.
# Environment: TORCH_VERSION (2.13.0), TRITON_VERSION (3.7.1), EXTRA_WHEELS ("name==ver ..."; e.g.
# nvidia-cudnn-cu13==9.20.0.48 if the image's cuDNN proves too old), VLLM_WHEELS (a pins file, one
# "name==ver" a line: a CUDA vLLM and what it imports that the image lacks, e.g.
# experiments/gpu/vllm_0.32_wheels.txt; its stream comes last), PART_MIB (38: a part plus the
# ~21 MiB working tree must stay under the 64 MiB a call carries).
# What it does, and why:
# - downloads the wheels with `pip download --no-deps` for cp312 / manylinux_2_28 (the machine's Python);
#   torch's nvidia-* libraries are NOT carried: torch loads them by soname and the image has cu13 ones;
# - rewrites each wheel uncompressed (ZIP_STORED) and drops what a Hopper GPU never runs (triton's
#   ptxas-blackwell, used only for sm_100+; static CUPTI/nvperf archives; a test library; torch's
#   protoc; vLLM's FlashAttention-2 (Hopper runs FA3), stable-ABI MoE ops, Rust frontend and
#   Blackwell FMHA kernels, as ../shared/gpu/build_parts.sh does for 0.26): the wheel stays
#   installable (pip does not require every RECORD entry);
# - packs the stored wheels into xz streams (multi-block, so the device decompresses on all cores):
#   deflate leaves torch + triton at 691 MiB, xz at 492 MiB;
# - splits the stream into DEST/p1..pN (PART_MIB each), each with carry_install.sh, probe_torch.py and
#   a manifest (part count and the stream's sha256), since the device gets only the carried folder.
# On the device, one call per part, back to back, carrying .gpunew/pK:
#   W=$(python3 -c "import tempfile; print(tempfile.gettempdir())")/w; bash .gpunew/pK/carry_install.sh $W .gpunew/pK
# and on the last call append:  && python3 .gpunew/pN/probe_torch.py --site $W/site313 --out $OUT/probe.json
set -euo pipefail
TORCH=${TORCH_VERSION:-2.13.0}
TRITON=${TRITON_VERSION:-3.7.1}
PART_MIB=${PART_MIB:-38}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(git rev-parse --show-toplevel)
DEST=${1:-$ROOT/.gpunew}
EXCLUDE=$(git rev-parse --git-path info/exclude)
name=/$(realpath --relative-to="$ROOT" "$DEST")/
mkdir -p "$(dirname "$EXCLUDE")"
grep -qxF "$name" "$EXCLUDE" 2>/dev/null || echo "$name" >> "$EXCLUDE"
rm -rf "$DEST"/p[0-9]* "$DEST/stored"
mkdir -p "$DEST/cache" "$DEST/dl"
# A group's wheels are downloaded into DEST/dl/GROUP, kept between builds (pip skips a file already
# there); the folder is emptied when the group's pins change, so no stale wheel joins a stream.
dl() {  # dl GROUP_DIR PLATFORMS... -- PINS...
  local dir=$1 plat=() pins
  shift
  while [ "$1" != "--" ]; do plat+=(--platform "$1"); shift; done
  shift
  pins="$*"
  if [ "$(cat "$dir.pins" 2>/dev/null)" != "$pins" ]; then rm -rf "$dir"; fi
  mkdir -p "$dir"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${plat[@]}" -d "$dir" "$@"
  echo "$pins" > "$dir.pins"
}
TORCH_PLATFORMS="manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_18_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64"
# The image runs Ubuntu 24.04 (glibc 2.39): vLLM's dependencies may take any manylinux up to 2_35.
VLLM_PLATFORMS="manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 $TORCH_PLATFORMS manylinux_2_24_x86_64"
# One xz stream per group of wheels (torch + triton; the extras), cached in DEST/cache by the group's
# wheel names: adding an extra wheel later recompresses only the extras (xz of torch takes ~30 min on
# two busy cores here). The streams are concatenated; the device reads them with `xz -d | tar -xi`.
stream() {  # stream GROUP_DIR [TRIM_TAG] -> prints the cached stream's path
  local dir=$1 key
  # TRIM_TAG joins the key where a group's trims may change (the vLLM group); empty for the torch
  # groups, whose keys stay the wheel names alone (the cached streams of earlier builds stay valid).
  key=$( (cd "$dir" && ls *.whl; printf '%s' "${2:-}") | sha256sum | cut -c1-16)
  if [ ! -s "$DEST/cache/$key.tar.xz" ]; then
    mkdir -p "$dir/stored"
    python3 - "$dir" "$dir/stored" <<'EOF2'
"""Rewrite each wheel with stored (uncompressed) members, leaving out what a Hopper GPU never runs."""
import fnmatch, pathlib, sys, zipfile
DROP = ["triton/backends/nvidia/bin/ptxas-blackwell", "triton/backends/nvidia/lib/cupti/*_static.a",
        "triton/instrumentation/libGPUInstrumentationTestLib.so", "torch/bin/protoc*",
        # vLLM: FA2 (Hopper runs FA3), the stable-ABI MoE ops, the Rust frontend (off unless
        # VLLM_USE_RUST_FRONTEND=1), Blackwell-only FMHA kernels; each import of them is optional.
        "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/_moe_C_stable_libtorch.abi3.so", "vllm/vllm-rs",
        "vllm/third_party/fmha_sm100/*"]
src, dst = map(pathlib.Path, sys.argv[1:])
for whl in sorted(src.glob("*.whl")):
    dropped = 0
    with zipfile.ZipFile(whl) as zin, zipfile.ZipFile(dst / whl.name, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            if any(fnmatch.fnmatch(info.filename, p) for p in DROP):
                dropped += info.file_size
                continue
            data = zin.read(info)
            info.compress_type = zipfile.ZIP_STORED  # after the read: zin decompresses by this field
            zout.writestr(info, data)
    print(f"{whl.name}: {whl.stat().st_size / 2**20:.1f} MiB as downloaded, dropped {dropped / 2**20:.1f} MiB",
          file=sys.stderr)
EOF2
    (cd "$dir/stored" && tar cf - *.whl) | nice -n 10 xz -6 -T2 > "$DEST/cache/$key.tar.xz.tmp"
    mv "$DEST/cache/$key.tar.xz.tmp" "$DEST/cache/$key.tar.xz"
    rm -rf "$dir/stored"
  fi
  echo "$DEST/cache/$key.tar.xz"
}
dl "$DEST/dl/core" $TORCH_PLATFORMS -- "torch==$TORCH" "triton==$TRITON"
streams=$(stream "$DEST/dl/core")
groups="$DEST/dl/core"
if [ -n "${EXTRA_WHEELS:-}" ]; then
  dl "$DEST/dl/extra" $TORCH_PLATFORMS -- ${EXTRA_WHEELS}
  streams="$streams $(stream "$DEST/dl/extra")"
  groups="$groups $DEST/dl/extra"
fi
if [ -n "${VLLM_WHEELS:-}" ]; then
  dl "$DEST/dl/vllm" $VLLM_PLATFORMS -- $(sed 's/#.*//' "$VLLM_WHEELS" | tr -s ' \n' ' ')
  streams="$streams $(stream "$DEST/dl/vllm" "trim:vllm-fa2,moe_C,vllm-rs,fmha_sm100")"
  groups="$groups $DEST/dl/vllm"
fi
wheels=$(for g in $groups; do ls "$g"/*.whl; done | xargs -n1 basename | tr '\n' ' ')
cat $streams > "$DEST/carry.xz"
sum=$(sha256sum "$DEST/carry.xz" | cut -d' ' -f1)
(cd "$DEST" && split -b "${PART_MIB}m" -d -a 2 carry.xz part_)
n=$(ls "$DEST"/part_* | wc -l)
i=1
for p in "$DEST"/part_*; do
  mkdir -p "$DEST/p$i"; mv "$p" "$DEST/p$i/"
  cp "$HERE/carry_install.sh" "$HERE/probe_torch.py" "$DEST/p$i/"
  printf 'parts %s\nsha256 %s\nwheels %s\n' "$n" "$sum" "$wheels" > "$DEST/p$i/manifest"
  i=$((i + 1))
done
ls -l $groups $streams
rm -f "$DEST/carry.xz"
du -b "$DEST"/p*/part_* | sort -V
echo "parts: $n of <= $PART_MIB MiB; sha256 $sum"
