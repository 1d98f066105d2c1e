#!/usr/bin/env bash
# Re-split built carry parts into smaller ones without rebuilding the stream: when the working tree
# grows, a part plus the tree must still fit the 64 MiB a device call carries.
#   bash experiments/gpu/resplit_parts.sh SRC_PREFIX DEST_PREFIX MIB
#   bash experiments/gpu/resplit_parts.sh .gpunew/p .gpunew/r 38     # p1..p17 (47 MiB) -> r1..r21
# The stream (all part files in name order) and its sha256 stay the same; each new part gets
# carry_install.sh and the manifest with its new count.
set -euo pipefail
SRC=$1; DEST=$2; MIB=$3
HERE=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
manifest=$(ls "$SRC"1/manifest)
sum=$(awk '$1 == "sha256" {print $2}' "$manifest")
# the folders of this stream only (another stream, e.g. an extra part, has its own checksum)
dirs=$(grep -l "^sha256 $sum" "$SRC"*/manifest | xargs -n1 dirname)
cat $(for d in $dirs; do ls "$d"/part_*; done | awk -F/ '{print $NF, $0}' | sort | cut -d' ' -f2) > "$tmp/carry.xz"
got=$(sha256sum "$tmp/carry.xz" | cut -d' ' -f1)
[ "$got" = "$sum" ] || { echo "the parts under ${SRC}* do not make their stream: $got != $sum"; exit 2; }
(cd "$tmp" && split -b "${MIB}m" -d -a 2 carry.xz part_ && rm carry.xz)
n=$(ls "$tmp" | wc -l)
i=1
for p in "$tmp"/part_*; do
  rm -rf "$DEST$i"; mkdir -p "$DEST$i"; mv "$p" "$DEST$i/"
  cp "$HERE/carry_install.sh" "$DEST$i/"
  sed "s/^parts .*/parts $n/" "$manifest" > "$DEST$i/manifest"
  i=$((i + 1))
done
echo "parts: $n of <= $MIB MiB in ${DEST}1..${DEST}$n; sha256 $sum"
