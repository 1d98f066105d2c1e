#!/usr/bin/env bash
# One extra wheel part for the GPU machine, installed after the CUDA vLLM 0.32 carry
# (experiments/gpu/README_carry.md): the wheels of a pins file, in the same layout as
# carry_newer_torch.sh's parts (carry_install.sh, a one-part manifest, part_00), small enough to
# travel in the last part's call. Rebuild it after carry_newer_torch.sh, which clears DEST/p*.
#   cd <checkout the device tool sends> && bash experiments/gpu/carry_extra_part.sh \
#       experiments/gpu/serving_extra_wheels.txt .gpunew/p18
# On the device (its own store, so the 17-part stream's count and checksum are untouched), then
# merged into the carried site by experiments/gpu/device_all_032.sh:
#   bash .gpunew/p18/carry_install.sh $W/p18 .gpunew/p18      # -> $W/p18/site313
set -euo pipefail
PINS=$1
DEST=$2
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(git rev-parse --show-toplevel)
EXCLUDE=$(git rev-parse --git-path info/exclude)
top=/$(realpath --relative-to="$ROOT" "$(dirname "$DEST")")/
grep -qxF "$top" "$EXCLUDE" 2>/dev/null || echo "$top" >> "$EXCLUDE"
dl=$(mktemp -d)
trap 'rm -rf "$dl"' EXIT
# cp312 / manylinux_2_28: the machine's Python and glibc (the pins are pure Python wheels today)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d "$dl" $(sed 's/#.*//' "$PINS" | tr -s ' \n' ' ')
rm -rf "$DEST"
mkdir -p "$DEST"
(cd "$dl" && tar cf - *.whl) | xz -6 > "$DEST/part_00"
sum=$(sha256sum "$DEST/part_00" | cut -d' ' -f1)
cp "$HERE/carry_install.sh" "$DEST/"
printf 'parts 1\nsha256 %s\nwheels %s\n' "$sum" "$(cd "$dl" && ls *.whl | tr '\n' ' ')" > "$DEST/manifest"
du -b "$DEST"/*
echo "part $DEST: 1 of 1, sha256 $sum"
