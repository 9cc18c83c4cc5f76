#!/usr/bin/env bash
# Fetches cuobjdump and nvdisasm (PyPI's nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm wheels, pinned by
# version and checksum) into .deps/sass-tools/bin (git-ignored), so that the SASS of the CUDA kernels can be
# read on this GPU-less machine (scripts/sass_counts.sh, and the SASS test scripts/check_local_memory.sh, which
# skips without them; scripts/setup.sh fetches them for CUDA builds). Idempotent.
set -euo pipefail

version=13.5.37
root="$(cd "$(dirname "$0")/.." && pwd)"
dest="$root/.deps/sass-tools"
if [ -x "$dest/bin/cuobjdump" ] && [ -x "$dest/bin/nvdisasm" ]; then
  exit 0
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$dest/bin"
for entry in cuobjdump:38780fee50863252a0b8926357faa91615ca1c8346490563f33a06100cd73f58 \
  nvdisasm:d3fdbdd49fa53e2e4aacd3db8259d052bd2b049ececdcb69e92e083c6728e7ca; do
  tool=${entry%%:*} sha256=${entry#*:}
  echo "fetching $tool $version (nvidia-cuda-$tool wheel from PyPI)"
  wheel=$("$root/scripts/pypi_wheel.sh" "nvidia-cuda-$tool" "$version" "$sha256" "$tmp/$tool")
  python3 - "$wheel" "$tool" "$dest/bin" <<'PY'
import os, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    name = next(n for n in z.namelist() if n.endswith("/bin/" + sys.argv[2]))
    target = os.path.join(sys.argv[3], sys.argv[2])
    with open(target, "wb") as out:
        out.write(z.read(name))
    os.chmod(target, 0o755)
PY
done
echo "cuobjdump and nvdisasm in $dest/bin"
