#!/usr/bin/env bash
# Downloads one pinned wheel from PyPI into a directory and checks it against its pinned sha256; prints the
# wheel's path. With pip: `pip download` for this platform; without: PyPI's JSON API, taking the file whose
# published sha256 is the pinned one. Used by fetch_cutlass.sh and fetch_sass_tools.sh.
# Usage: scripts/pypi_wheel.sh PROJECT VERSION SHA256 DIR
set -euo pipefail
project=$1 version=$2 sha256=$3 dir=$4
mkdir -p "$dir"
if python3 -m pip --version >/dev/null 2>&1; then
  python3 -m pip download -q --no-deps --only-binary=:all: "$project==$version" -d "$dir" >&2
  wheel=$(ls "$dir"/*.whl)
else
  url="$(curl -fsSL "https://pypi.org/pypi/$project/$version/json" | python3 -c '
import json, sys
print(next(u["url"] for u in json.load(sys.stdin)["urls"] if u["digests"]["sha256"] == sys.argv[1]))' "$sha256")"
  wheel="$dir/${url##*/}"
  curl -fsSL -o "$wheel" "$url"
fi
echo "$sha256  $wheel" | sha256sum -c --quiet - >&2 || {
  echo "checksum mismatch for $wheel" >&2
  exit 1
}
echo "$wheel"
