#!/usr/bin/env bash
# python3 with torch 2.11 and transformers 5.17 (.refenv/, from scripts/setup_reference_env.sh, which
# scripts/setup.sh runs) and this build's moekit package: the wheel that the build installs into
# BUILD/python-site (BUILD is build/, or the directory given with --build DIR). For the Python tests and for
# trying moekit from Python:  scripts/python.sh -c 'import moekit.torch; print(moekit.torch.backends("cpu"))'
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="$root/build"
if [[ ${1:-} == --build ]]; then
  build="$(cd "$2" && pwd)"
  shift 2
fi
site="$build/python-site"
if [[ ! -d $site/moekit ]]; then
  echo "python.sh: no moekit package in $site; build first (./scripts/build.sh)" >&2
  exit 1
fi
if [[ ! -d $root/.refenv/torch ]]; then
  echo "python.sh: torch is not installed in $root/.refenv; run ./scripts/setup.sh" >&2
  exit 1
fi
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
exec "$root/scripts/reference_python.sh" "$@"
