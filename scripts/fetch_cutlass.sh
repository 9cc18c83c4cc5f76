#!/usr/bin/env bash
# Fetches the CUTLASS/CuTe headers (Hopper building blocks: TMA copies, wgmma, mbarriers) from PyPI's
# nvidia-cutlass wheel, pinned by version and checksum, into .deps/ (git-ignored). Headers only:
# nothing is built or installed system-wide. Idempotent; called by setup.sh.
set -euo pipefail

version=4.2.0.0
sha256=f9599ada45c7bcb6bf53f7d3f0a7d154183e53451c01bfa59eecd37dd4a693f6
root="$(cd "$(dirname "$0")/.." && pwd)"
dest="$root/.deps/cutlass-$version"

if [ -f "$dest/include/cute/arch/mma_sm90_gmma.hpp" ]; then
  echo "setup: CUTLASS $version headers present"
  exit 0
fi

echo "setup: fetching CUTLASS $version headers (nvidia-cutlass wheel from PyPI)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
wheel=$("$root/scripts/pypi_wheel.sh" nvidia-cutlass "$version" "$sha256" "$tmp")
python3 - "$wheel" "$tmp/unpacked" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith("cutlass_library/source/include/")])
PY
mkdir -p "$dest"
rm -rf "$dest/include"
mv "$tmp/unpacked/cutlass_library/source/include" "$dest/include"
echo "setup: CUTLASS headers in $dest/include"
