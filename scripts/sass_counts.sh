#!/usr/bin/env bash
# Counts, per kernel of a CUDA binary or object whose name matches a regex, the tensor-core instructions
# (HGMMA / QGMMA: wgmma; HMMA / QMMA: mma.sync), the F2FP conversions, the wgmma batches opened
# (WARPGROUP.ARRIVE) and the local-memory accesses (LDL / STL) in its sm_90a SASS.
# Usage: scripts/sass_counts.sh BINARY [NAME_REGEX]   (default regex: hopper|tensor_core)
# Uses .deps/sass-tools (scripts/fetch_sass_tools.sh) where present, else cuobjdump from PATH (the GPU machine).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
[[ -x "$root/.deps/sass-tools/bin/cuobjdump" ]] && export PATH="$root/.deps/sass-tools/bin:$PATH"
cuobjdump -sass -arch sm_90a "$1" | awk -v pattern="${2:-hopper|tensor_core}" '
  /Function :/ { f = ($3 ~ pattern) ? $3 : "" }
  f != "" { seen[f] = 1 }
  f != "" && /HGMMA/ { hg[f]++ } f != "" && /QGMMA/ { qg[f]++ } f != "" && / HMMA/ { hm[f]++ }
  f != "" && / QMMA/ { qm[f]++ } f != "" && / F2FP/ { cv[f]++ } f != "" && /WARPGROUP.ARRIVE/ { wa[f]++ }
  f != "" && /(LDL|STL)/ { l[f]++ }
  END {
    for (k in seen)
      printf "%s HGMMA=%d QGMMA=%d HMMA=%d QMMA=%d F2FP=%d ARRIVE=%d LDL/STL=%d\n", k, hg[k], qg[k], hm[k], qm[k], cv[k],
             wa[k], l[k]
  }'
