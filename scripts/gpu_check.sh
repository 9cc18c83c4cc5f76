#!/usr/bin/env bash
# Runs on the GPU machine in one call: CUDA tests, then moekit's benchmark and transformers'
# backends side by side on the same shapes (scripts/compare_transformers.py). Takes the binaries
# built on the CPU machine by scripts/make_gpu_bundle.sh (carried as gpu-bundle/).
# Usage: scripts/gpu_check.sh [tests|bench|decode|gemm|compare|vllm|model|sass|ncu|profile|kprofile|stress|ab|all]   (default all); results under $OUT if set.
# decode: batched_mm at 1 and 8 tokens with graphs, bf16 / FP8 / FP4 weights, the quantised ones through the
# tensor-core path and through the older kernels (MOEKIT_BATCHED_MM_TENSOR_CORES=0), in one lease.
# gemm: the Hopper grouped GEMM alone next to DeepGEMM's figures (moekit bench-gemm; GEMM_ARGS adds flags).
# sass: registers, stack and spills of the Hopper kernels (and batched_mm's tensor-core ones), and their count of HGMMA / QGMMA
# (wgmma), HMMA / QMMA (mma.sync: does the e4m3 mma.sync of batched_mm's FP8 kernels run as QMMA, or as HMMA after F2FP
# conversions?), F2FP and local-memory instructions (LDL/STL), from the disassembly (scripts/sass_counts.sh; on this
# machine too after scripts/fetch_sass_tools.sh).
# ncu: each kernel's GPU time in one call of each case of NCU_CASES (';'-separated `moekit bench` arguments,
# one backend and one token count each), from Nsight Compute with the clocks left alone; kernels run one
# at a time under ncu, so programmatic-launch overlap is not in these numbers. NCU_MOEKIT names the binary (default gpu-bundle/moekit).
# profile: Nsight Compute on the Hopper GEMM alone, one launch per case of PROFILE_CASES (';'-separated `moekit
# bench-gemm` arguments): throughputs and warp stalls (profile_N.txt), and stall samples per SASS instruction
# (profile_N_sass.csv) for reading where the math warps wait. NCU_MOEKIT names the binary here too.
# kprofile: the same Nsight Compute sections on one kernel of a `moekit bench` run: KPROFILE_KERNEL (a regex of the
# kernel's name, default the quantised batched_mm up kernel) in KPROFILE_CASES (';'-separated `moekit bench`
# arguments, one case each), one launch after KPROFILE_SKIP (default 2) skipped (kprofile_N.txt, kprofile_N_sass.csv). NCU_MOEKIT names the binary here too.
# stress: deepgemm at sizes with many all-padding warpgroups, STRESS_CALLS calls per case (default 5000), each
# case under `timeout STRESS_SECONDS` (default 90): a hang in the grouped GEMM's pipeline becomes a failure that
# names its case (the session-9 hang needed thousands of calls to show).
# ab: this tree's moekit against gpu-bundle/moekit_baseline.xz (make_gpu_bundle.sh with BASELINE=<revision>),
# AB_ROUNDS rounds (default 2) of baseline then new in one lease: `moekit bench-gemm` (AB_GEMM_ARGS) and `moekit
# bench` over AB_BENCH_CASES (';'-separated arguments); prints each case's times side by side with the ratio
# of the medians (ab.log). Noise between leases is larger than many changes: compare only within one.
# AB_VARIANTS (';'-separated VAR=value) adds sides: the new binary under each assignment; AB_GEMM=0 skips bench-gemm.
# AB_BASELINE_ENV (VAR=value) runs the baseline side under that assignment (a baseline binary with a switch).
# AB_BINARIES (';'-separated names) adds sides that run gpu-bundle/moekit_NAME.xz (make_gpu_bundle.sh VARIANTS);
# NAME@VAR=value runs that binary under the assignment (a variant's switch).
# ab_raw.log (under $OUT) is written as the sides run, so a run cut short still leaves its times there;
# clocks.log holds the SM clock and power sampled meanwhile, summarised at the end of ab.log.
# backward: the backward harness and the backward's CUDA-graph test on CUDA (BACKWARD_FILTER: a gtest filter within
# them, default every backend), then `moekit bench --backward` (BACKWARD_BENCH_ARGS, default the Qwen3-30B-A3B and
# DeepSeek-V3 shapes at 4,096 and 16,384 tokens, grouped_mm beside the Hopper backends).
# vllm: vLLM's Triton fused_moe kernel (gpu-bundle/vllm/, from scripts/fetch_vllm_kernel.sh) next to `moekit bench
# --graphs` on issue 37's shapes and serving token counts (scripts/compare_vllm.py; VLLM_ARGS adds its flags).
# model: the built-in model generating on the GPU, then scripts/bench_model.py (moekit's model runtime
# next to transformers on one random Qwen3-30B-A3B-shaped checkpoint).
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
out=${OUT:-gpu-results}
mkdir -p "$out"
[[ -d gpu-bundle/lib ]] || tar -C gpu-bundle -xJf gpu-bundle/lib.tar.xz  # see make_gpu_bundle.sh
if [[ ! -f gpu-bundle/moekit_tests && -f gpu-bundle/moekit_tests.xz ]]; then
  xz -dc gpu-bundle/moekit_tests.xz >gpu-bundle/moekit_tests && chmod +x gpu-bundle/moekit_tests
fi
export LD_LIBRARY_PATH="$PWD/gpu-bundle/lib:${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
status=0
if [[ $what == tests || $what == all ]]; then
  ./gpu-bundle/moekit_tests --gtest_filter='Cuda*:*Cuda*:*Graph*' --gtest_brief=1 2>&1 | tee "$out/cuda_tests.log" | tail -40
  status=${PIPESTATUS[0]}
fi
if [[ $what == bench || $what == all ]]; then
  ./gpu-bundle/moekit bench --device cuda ${BENCH_ARGS:-} --json "$out/bench_cuda.json" --plot "$out/bench_cuda.svg" 2>&1 | tee "$out/bench_cuda.log"
fi
if [[ $what == decode || $what == all ]]; then
  decode() {
    ./gpu-bundle/moekit bench --device cuda --shape qwen3-30b-a3b,deepseek-v3 --tokens 1,8 --backends batched_mm \
      --graphs --max-seconds-per-case 0.5 "$@" 2>&1 | grep -E '^(qwen3|deepseek)-.* batched'
  }
  for weights in bf16 fp8 fp4; do
    echo "== $weights"
    decode --weights "$weights"
    if [[ $weights != bf16 ]]; then
      echo "== $weights, older kernels"
      MOEKIT_BATCHED_MM_TENSOR_CORES=0 decode --weights "$weights"
    fi
  done 2>&1 | tee "$out/decode.log"
fi
if [[ $what == backward ]]; then
  ./gpu-bundle/moekit_tests --gtest_filter="${BACKWARD_FILTER:-Cuda/ExpertsBackwardHarness.*:*BackwardCudaGraph*}" \
    --gtest_brief=1 2>&1 | tee "$out/backward_tests.log" | tail -40
  status=${PIPESTATUS[0]}
  # shellcheck disable=SC2086
  ./gpu-bundle/moekit bench --device cuda --backward ${BACKWARD_BENCH_ARGS:---shape qwen3-30b-a3b,deepseek-v3 \
    --tokens 4096,16384 --backends grouped_mm,deepgemm,sonicmoe --max-seconds-per-case 2} \
    --json "$out/bench_backward.json" 2>&1 | tee "$out/bench_backward.log"
fi
if [[ $what == gemm || $what == all ]]; then
  ./gpu-bundle/moekit bench-gemm --device cuda ${GEMM_ARGS:-} --json "$out/bench_gemm.json" 2>&1 | tee "$out/bench_gemm.log"
fi
if [[ $what == compare || $what == all ]]; then
  PYTHONUNBUFFERED=1 python3 scripts/compare_transformers.py --moekit ./gpu-bundle/moekit --out "$out" ${COMPARE_ARGS:-} 2>&1 | tee "$out/compare.log"
fi
if [[ $what == vllm ]]; then
  # shellcheck disable=SC2086
  PYTHONUNBUFFERED=1 python3 scripts/compare_vllm.py --vllm-kernel gpu-bundle/vllm/fused_moe.py \
    --moekit ./gpu-bundle/moekit --out "$out" ${VLLM_ARGS:-} 2>&1 | tee "$out/compare_vllm.log"
fi
if [[ $what == model || $what == all ]]; then
  ./gpu-bundle/moekit generate --device cuda --max-new-tokens 16 --ignore-eos 2>&1 | tee "$out/generate_cuda.log"
  PYTHONUNBUFFERED=1 python3 scripts/bench_model.py --moekit ./gpu-bundle/moekit --device cuda ${MODEL_ARGS:-} \
    --json "$out/bench_model_cuda.json" 2>&1 | grep -v "Loading weights" | tee "$out/bench_model_cuda.log"
fi
if [[ $what == ncu ]]; then
  IFS=';' read -ra cases <<<"${NCU_CASES:---shape qwen3-30b-a3b --tokens 1 --backends batched_mm}"
  for i in "${!cases[@]}"; do
    echo "== ${cases[$i]}"
    # shellcheck disable=SC2086
    ncu --clock-control none --print-kernel-base function --metrics gpu__time_duration.sum --csv ${NCU_MOEKIT:-./gpu-bundle/moekit} bench --device cuda \
      --warmup 0 --repeats 1 --json '' --plot '' --memory-bandwidth-gbs 4200 ${cases[$i]} >"$out/ncu_$i.csv" 2>"$out/ncu_$i.err"
    python3 - "$out/ncu_$i.csv" <<'PY'
import csv, sys
rows = [r for r in csv.reader(l for l in open(sys.argv[1]) if l.startswith('"'))]
head, body = rows[0], rows[1:]
name, value = head.index("Kernel Name"), head.index("Metric Value")
total = 0.0
for r in body:
    us = float(r[value].replace(",", "")) / 1000.0
    total += us
    print(f"{us:10.1f} us  {r[name][:70]}")
print(f"{total:10.1f} us  total")
PY
  done 2>&1 | tee "$out/ncu.log"
fi
if [[ $what == profile ]]; then
  IFS=';' read -ra cases <<<"${PROFILE_CASES:---shapes deepseek-v3 --projections down --rows-per-expert 512 --format fp8 --epilogue store}"
  for i in "${!cases[@]}"; do
    echo "== ${cases[$i]}"
    # shellcheck disable=SC2086
    ncu --clock-control none -k regex:grouped_gemm_kernel --launch-skip 1 --launch-count 1 \
      --section SpeedOfLight --section WarpStateStats --section SourceCounters --section MemoryWorkloadAnalysis \
      --section ComputeWorkloadAnalysis --metrics sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active \
      -f -o "$out/profile_$i" "${NCU_MOEKIT:-./gpu-bundle/moekit}" bench-gemm --device cuda --warmup 1 --repeats 1 --json '' ${cases[$i]} \
      >"$out/profile_$i.log" 2>&1
    tail -3 "$out/profile_$i.log"; rm -f "$out/profile_$i.log"
    ncu -i "$out/profile_$i.ncu-rep" --page details >"$out/profile_$i.txt" 2>&1
    ncu -i "$out/profile_$i.ncu-rep" --page source --csv --print-source sass >"$out/profile_${i}_sass.csv" 2>&1
    grep -E "Duration|Throughput|gmma|Issue Slots|Warp Cycles Per Issued|No Eligible|Active Warps" "$out/profile_$i.txt" | head -30
    rm -f "$out/profile_$i.ncu-rep"
  done 2>&1 | tee "$out/profile.log"
fi
if [[ $what == kprofile ]]; then
  IFS=';' read -ra cases <<<"${KPROFILE_CASES:---shape deepseek-v3 --tokens 1 --backends batched_mm --weights fp8}"
  for i in "${!cases[@]}"; do
    echo "== ${cases[$i]} (kernel ${KPROFILE_KERNEL:-up_kernel})"
    # shellcheck disable=SC2086
    ncu --clock-control none -k "regex:${KPROFILE_KERNEL:-up_kernel}" --launch-skip "${KPROFILE_SKIP:-2}" --launch-count 1 \
      --section SpeedOfLight --section WarpStateStats --section SourceCounters --section MemoryWorkloadAnalysis \
      --section Occupancy --section LaunchStats -f -o "$out/kprofile_$i" ${NCU_MOEKIT:-./gpu-bundle/moekit} bench --device cuda \
      --warmup 1 --repeats 2 --json '' --plot '' --memory-bandwidth-gbs 4200 ${cases[$i]} >"$out/kprofile_$i.log" 2>&1
    tail -3 "$out/kprofile_$i.log"; rm -f "$out/kprofile_$i.log"
    ncu -i "$out/kprofile_$i.ncu-rep" --page details >"$out/kprofile_$i.txt" 2>&1
    ncu -i "$out/kprofile_$i.ncu-rep" --page source --csv --print-source sass >"$out/kprofile_${i}_sass.csv" 2>&1
    grep -E "Duration|Throughput|Issue Slots|Warp Cycles Per Issued|No Eligible|Active Warps|Registers|Stall" \
      "$out/kprofile_$i.txt" | head -40
    rm -f "$out/kprofile_$i.ncu-rep"
  done 2>&1 | tee "$out/kprofile.log"
fi
if [[ $what == stress ]]; then
  for weights in bf16 fp8; do
    for tokens in 64 512 4096; do
      timeout "${STRESS_SECONDS:-90}" ./gpu-bundle/moekit bench --device cuda --shape qwen3-30b-a3b --tokens "$tokens" \
        --backends deepgemm --weights "$weights" --warmup 3 --repeats "${STRESS_CALLS:-5000}" --json '' --plot '' \
        --memory-bandwidth-gbs 4200 >"$out/stress_${weights}_$tokens.log" 2>&1
      rc=$?
      if [[ $rc == 0 ]]; then
        echo "ok: $weights, $tokens tokens, ${STRESS_CALLS:-5000} calls"
      elif [[ $rc == 124 ]]; then
        echo "FAILED: $weights, $tokens tokens did not finish in ${STRESS_SECONDS:-90} s (a hang?)"
      else
        echo "FAILED: $weights, $tokens tokens, exit status $rc (see stress_${weights}_$tokens.log)"
      fi
    done
  done 2>&1 | tee "$out/stress.log"
  grep -q FAILED "$out/stress.log" && status=1
fi
if [[ $what == ab ]]; then
  if [[ ! -f gpu-bundle/moekit_baseline.xz ]]; then
    echo "ab: no gpu-bundle/moekit_baseline.xz; build the bundle with BASELINE=<git revision>" >&2
    exit 2
  fi
  xz -dc gpu-bundle/moekit_baseline.xz >"$out/moekit_baseline" && chmod +x "$out/moekit_baseline"
  echo "baseline: $(cat gpu-bundle/baseline_revision 2>/dev/null)"
  IFS=';' read -ra cases <<<"${AB_BENCH_CASES:---shape qwen3-30b-a3b,deepseek-v3 --tokens 4096,16384 --backends deepgemm --weights fp8;--shape qwen3-30b-a3b,deepseek-v3 --tokens 4096,16384 --backends deepgemm --weights bf16}"
  # Sides: the baseline, the new binary, and the new binary under each of AB_VARIANTS (';'-separated
  # environment assignments such as MOEKIT_X=1, for switches kept in a tree while it is measured).
  IFS=';' read -ra variants <<<"${AB_VARIANTS:-}"
  IFS=';' read -ra binaries <<<"${AB_BINARIES:-}"
  for side in "${binaries[@]}"; do
    name=${side%%@*}
    [[ -x $out/moekit_$name ]] && continue
    if [[ ! -f gpu-bundle/moekit_$name.xz ]]; then
      echo "ab: no gpu-bundle/moekit_$name.xz; build the bundle with VARIANTS=\"$name:...\"" >&2
      exit 2
    fi
    xz -dc "gpu-bundle/moekit_$name.xz" >"$out/moekit_$name" && chmod +x "$out/moekit_$name"
  done
  [[ -f gpu-bundle/variants ]] && cat gpu-bundle/variants
  # The SM clock and the power while the sides run, sampled every 200 ms (clocks.log): sustained FP8 work may
  # run below the clock that Nsight Compute's one-kernel replays see (session 17: DeepSeek-V3 16,384 FP8's
  # kernels summed to 14.3 ms under ncu, the layer timed 15.8-16.1 ms).
  nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv,noheader,nounits -lms 200 >"$out/clocks.log" 2>/dev/null &
  sampler=$!
  for _ in $(seq "${AB_ROUNDS:-2}"); do
    for side in baseline new "${variants[@]}" "${binaries[@]}"; do
      bin=./gpu-bundle/moekit
      name=${side%%@*}
      [[ -x $out/moekit_$name ]] && bin=$out/moekit_$name  # the baseline, or an AB_BINARIES side
      env=()
      [[ $side == *=* ]] && env=("${side#*@}")
      [[ $side == baseline && -n ${AB_BASELINE_ENV:-} ]] && env=("$AB_BASELINE_ENV")
      if [[ ${AB_GEMM:-1} == 1 ]]; then
        # shellcheck disable=SC2086
        env "${env[@]}" $bin bench-gemm --device cuda ${AB_GEMM_ARGS:---rows-per-expert 512 --format fp8,bf16 --epilogue store,gated --repeats 15} \
          --json '' 2>&1 | grep -E '^(fp8|bf16|fp8-ue8m0) ' | sed "s/^/$side gemm /"
      fi
      for i in "${!cases[@]}"; do
        # shellcheck disable=SC2086
        env "${env[@]}" $bin bench --device cuda --max-seconds-per-case 0.4 --json '' --plot '' --memory-bandwidth-gbs 4200 ${cases[$i]} 2>&1 |
          grep -E '^[a-z0-9.-]+ +[0-9]+ +[a-z_]+ +[0-9.]+ ' | sed "s/^/$side case$i /"
      done
    done
  done | tee "$out/ab_raw.log" | python3 -c '
import collections, statistics, sys
times = collections.defaultdict(lambda: collections.defaultdict(list))
sides = []
for line in sys.stdin:
    f = line.split()
    side, kind = f[0], f[1]
    if side not in sides:
        sides.append(side)
    if kind == "gemm":  # format shape projection epilogue groups m N K us TFLOP/s ...
        key, t = "gemm " + " ".join(f[2:6]) + " m" + f[7], float(f[10])
    else:  # shape tokens backend ms ...
        key, t = kind + " " + " ".join(f[2:5]), float(f[5])
    times[key][side].append(t)
others = [s for s in sides if s != "baseline"]
fmt = lambda xs: " ".join("{:.4g}".format(x) for x in xs)
print("{:44s} {:>18s}".format("case", "baseline") + "".join(" {:>18s} {:>7s}".format(s[:18], "b/side") for s in others))
for key, v in times.items():
    b = v["baseline"]
    row = "{:44s} {:>18s}".format(key, fmt(b))
    for s in others:
        n = v[s]
        ratio = statistics.median(b) / statistics.median(n) if b and n else float("nan")
        row += " {:>18s} {:7.3f}".format(fmt(n), ratio)
    print(row)
print("(gemm: microseconds; bench cases: ms; b/side > 1: that side is faster than the baseline)")
' | tee "$out/ab.log"
  kill "$sampler" 2>/dev/null
  python3 - "$out/clocks.log" <<'PY' | tee -a "$out/ab.log"
import statistics, sys
rows = []
for line in open(sys.argv[1]):
    try:
        clock, power = (float(x) for x in line.split(","))
    except ValueError:
        continue
    rows.append((clock, power))
if rows:
    clocks, powers = [r[0] for r in rows], [r[1] for r in rows]
    print("while timing ({} samples): SM clock min {:.0f} / median {:.0f} / max {:.0f} MHz, power median {:.0f} / "
          "max {:.0f} W".format(len(rows), min(clocks), statistics.median(clocks), max(clocks),
                                statistics.median(powers), max(powers)))
PY
fi
if [[ $what == sass || $what == all ]]; then
  cuobjdump -res-usage gpu-bundle/moekit 2>/dev/null | grep -A1 -E "hopper|tensor_core" | grep -E "Function|REG" |
    sed -E 's/^.*Function ([^ ]*):.*/\1/' | tee "$out/hopper_resources.log"
  ./scripts/sass_counts.sh gpu-bundle/moekit 2>/dev/null |
    tee "$out/hopper_sass.log"
fi
exit $status
