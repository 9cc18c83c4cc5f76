#!/usr/bin/env python3
"""Yardstick: time Hugging Face transformers' own experts implementations next to `moekit bench`.

Runs on the GPU machine (torch + transformers installed). moekit itself never imports torch; this
script is only the reference it is measured against. For each shape preset and token count it times
transformers' `eager`, `batched_mm` and `grouped_mm` experts forwards (the same code path a model takes:
a `@use_experts_implementation` experts module whose `config._experts_implementation` selects the
function from `transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS`), optionally runs
`moekit bench --device cuda` on the same shapes, token counts and backends, and prints one markdown
table per shape with both sides, the speedup and the memory-floor percentage.

See docs/compare_transformers.md for how to run it and what it measures.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time

# name: (hidden H, intermediate I, experts E, top_k K) -- the same presets as `moekit bench --shape`.
PRESETS = {
    "qwen1.5-moe-a2.7b": (2048, 1408, 60, 4),
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "mixtral-8x7b": (4096, 14336, 8, 2),
    "deepseek-v3": (7168, 2048, 256, 8),
}
DTYPE_BYTES = 2  # bf16 weights and activations
WARMUP = 3


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def csv_list(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Benchmark transformers' experts implementations (eager, batched_mm, grouped_mm) on the "
        "shapes, token counts, dtype (bf16) and routing `moekit bench` uses, side by side with moekit."
    )
    p.add_argument("--shapes", default="qwen3-30b-a3b,deepseek-v3",
                   help="comma-separated presets: " + ", ".join(PRESETS))
    p.add_argument("--tokens", default="1,8,64,512,4096,16384", help="comma-separated token counts T")
    p.add_argument("--backends", default="eager,batched_mm,grouped_mm",
                   help="comma-separated experts implementations, timed on both sides")
    p.add_argument("--moekit", default=None, metavar="PATH",
                   help="moekit binary; runs `PATH bench --device cuda ... --json FILE` once per shape")
    p.add_argument("--moekit-extra-args", default="", help='string appended to the moekit command, e.g. "--graphs"')
    p.add_argument("--moekit-timeout", type=float, default=0,
                   help="seconds one moekit run may take (0: estimated from the sweep size)")
    p.add_argument("--out", default=None, metavar="DIR", help="write compare.json and compare.md there")
    p.add_argument("--max-seconds-per-case", type=float, default=5.0,
                   help="time budget of one (shape, tokens, backend) case for the timed runs")
    p.add_argument("--max-runs", type=int, default=50,
                   help="at most this many timed runs per case (at least 20 when the budget allows, at least 3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights, inputs and routing")
    p.add_argument("--device", default="cuda", help="torch device for transformers, and moekit's --device")
    args = p.parse_args(argv)
    args.shapes = csv_list(args.shapes)
    bad = [s for s in args.shapes if s not in PRESETS]
    if bad:
        p.error(f"unknown shape(s) {bad}; valid: {', '.join(PRESETS)}")
    try:
        args.tokens = sorted({int(t) for t in csv_list(args.tokens)})
    except ValueError:
        p.error("--tokens takes comma-separated integers")
    if not args.tokens or min(args.tokens) < 1:
        p.error("--tokens needs positive integers")
    args.backends = csv_list(args.backends)
    if not args.backends:
        p.error("--backends needs at least one name")
    if args.max_seconds_per_case <= 0:
        p.error("--max-seconds-per-case must be positive")
    return args


# --------------------------------------------------------------------------------------------------
# moekit side
# --------------------------------------------------------------------------------------------------

def _has_flag(extra: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in extra)


def run_moekit(args, shape: str, bandwidth_gbs: float | None, workdir: str) -> tuple[dict | None, str | None, list[str]]:
    """Runs `moekit bench` for one shape. Returns (parsed JSON, error text, command line)."""
    path = args.moekit
    if not os.path.isfile(path):
        return None, f"moekit binary not found at {path!r}", []
    if not os.access(path, os.X_OK):
        return None, f"moekit binary {path!r} is not executable", []
    json_path = os.path.join(workdir, f"moekit-{shape}.json")
    if os.path.exists(json_path):
        os.remove(json_path)
    extra = shlex.split(args.moekit_extra_args)
    cmd = [path, "bench", "--device", args.device, "--shape", shape,
           "--tokens", ",".join(str(t) for t in args.tokens),
           "--backends", ",".join(args.backends), "--dtype", "bf16", "--json", json_path]
    # Only add what the extra args do not set themselves (a repeated single-value flag may be an error).
    if not _has_flag(extra, "--max-seconds-per-case"):
        cmd += ["--max-seconds-per-case", f"{args.max_seconds_per_case:g}"]
    if bandwidth_gbs and not _has_flag(extra, "--memory-bandwidth-gbs"):
        # Same bandwidth on both sides, so both floors agree (moekit cannot measure it on CUDA itself).
        cmd += ["--memory-bandwidth-gbs", f"{bandwidth_gbs:.1f}"]
    if not _has_flag(extra, "--plot"):
        cmd += ["--plot", os.path.join(args.out, f"moekit-{shape}.svg") if args.out else ""]
    if not _has_flag(extra, "--seed"):
        cmd += ["--seed", str(args.seed)]
    cmd += extra

    timeout = args.moekit_timeout
    if timeout <= 0:
        cases = len(args.tokens) * len(args.backends)
        timeout = 600 + cases * (2.0 * args.max_seconds_per_case + 5.0)
    log(f"[moekit] {shlex.join(cmd)}")
    t0 = time.time()
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    except OSError as e:
        return None, f"cannot start moekit: {e}", cmd
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    tail: list[str] = []
    try:
        for line in proc.stdout:  # echo moekit's table and progress to our stderr
            line = line.rstrip("\n")
            log(f"[moekit] {line}")
            tail = (tail + [line])[-15:]
        rc = proc.wait()
    finally:
        timer.cancel()
    elapsed = time.time() - t0
    if rc != 0:
        why = f"killed after {elapsed:.0f} s (timeout {timeout:.0f} s)" if elapsed >= timeout else f"exit status {rc}"
        last = next((l for l in reversed(tail) if l.strip()), "")
        return None, f"moekit bench failed ({why}): {last}", cmd
    try:
        with open(json_path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        return None, f"moekit bench exited 0 but its JSON {json_path} could not be read: {e}", cmd
    return data, None, cmd


# Accepted spellings of the fields we need, first match wins; checked against each row.
ROW_KEYS = {
    "shape": ("shape", "shape_name", "name"),
    "tokens": ("tokens", "T", "num_tokens"),
    "backend": ("backend", "implementation", "experts_implementation"),
    "median_ms": ("median_ms", "time_ms", "ms", "median"),
}


def _pick(row: dict, field: str):
    for k in ROW_KEYS[field]:
        if k in row:
            return row[k]
    return None


def parse_moekit_rows(data: dict, shape: str) -> tuple[dict, list[str]]:
    """Maps (tokens, backend) -> row summary; returns it and a list of problems found."""
    problems: list[str] = []
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        keys = list(data) if isinstance(data, dict) else type(data).__name__
        return {}, [f"moekit JSON has no 'rows' array (top-level keys: {keys}); expected the `moekit bench --json` schema"]
    if not isinstance(data.get("options"), dict):
        problems.append("moekit JSON has no 'options' object (continuing with 'rows')")
    out: dict = {}
    for i, row in enumerate(data["rows"]):
        if not isinstance(row, dict):
            problems.append(f"rows[{i}] is not an object")
            continue
        vals = {f: _pick(row, f) for f in ROW_KEYS}
        status = str(row.get("status", "ok"))
        missing = [f for f, v in vals.items() if v is None and not (f == "median_ms" and status != "ok")]
        if missing:
            problems.append(
                f"rows[{i}] lacks {missing} (looked for {[ROW_KEYS[f] for f in missing]}); its keys: {sorted(row)}")
            continue
        if vals["shape"] != shape:
            continue
        try:
            key = (int(vals["tokens"]), str(vals["backend"]))
        except (TypeError, ValueError):
            problems.append(f"rows[{i}] has a non-integer tokens value {vals['tokens']!r}")
            continue
        out[key] = {
            "status": status,
            "reason": row.get("reason"),
            "median_ms": float(vals["median_ms"]) if status == "ok" and vals["median_ms"] is not None else None,
            "min_ms": row.get("min_ms"),
            "runs": row.get("runs"),
            "experts_touched": row.get("experts_touched"),
            "floor_ms": row.get("floor_ms"),
            "floor_percent": row.get("floor_percent"),
            "flops_per_second": row.get("flops_per_second"),
            "raw": row,
        }
    return out, problems


# --------------------------------------------------------------------------------------------------
# transformers side
# --------------------------------------------------------------------------------------------------

def import_torch_side():
    import torch  # noqa: PLC0415  (the yardstick only; moekit never imports torch)
    import transformers  # noqa: PLC0415
    from transformers.integrations import moe as hf_moe  # noqa: PLC0415
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig  # noqa: PLC0415
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts  # noqa: PLC0415
    return torch, transformers, hf_moe, Qwen3MoeConfig, Qwen3MoeExperts


def measure_copy_bandwidth(torch, device) -> dict:
    """Device-to-device copy of 2 GiB; GB/s counts bytes read + bytes written (as DESIGN §7 / moekit do)."""
    nbytes = 2 << 30
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    del src, dst
    torch.cuda.empty_cache()
    med = statistics.median(times)
    return {
        "gb_per_second": 2 * nbytes / (med * 1e-3) / 1e9,
        "best_gb_per_second": 2 * nbytes / (min(times) * 1e-3) / 1e9,
        "source": f"torch copy_ of {nbytes >> 30} GiB device-to-device, median of {len(times)}, "
                  "bytes read + bytes written counted",
    }


def time_call(torch, fn, budget_s: float, max_runs: int) -> dict:
    """3 warm-ups, then timed runs: at least 20 when the budget allows, at least 3, at most max_runs.

    Each run starts on an idle GPU (synchronised first) and is bracketed by CUDA events, so its time is
    the latency of one call including its host-side launch overhead, as a model's forward sees it."""
    warm_ms, warm_wall = [], []
    t_start = time.perf_counter()
    for _ in range(WARMUP):
        torch.cuda.synchronize()
        w0 = time.perf_counter()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        warm_wall.append(time.perf_counter() - w0)
        warm_ms.append(a.elapsed_time(b))
        if time.perf_counter() - t_start > budget_s:
            break
    # The first call may carry one-off set-up (cuBLAS handles, allocator growth): estimate from the others.
    est_wall = max(min(warm_ms[1:] or warm_ms) * 1e-3, min(warm_wall[1:] or warm_wall), 1e-6)
    runs = max(3, min(max_runs, int(budget_s / est_wall)))
    times = []
    for _ in range(runs):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times),
            "runs": len(times), "warmup_runs": len(warm_ms)}


def make_routing(torch, T: int, E: int, K: int, H: int, device, seed: int):
    """Per token K distinct experts uniformly at random (top-k of i.i.d. scores), softmax-normalised weights.

    As a Qwen3-MoE router hands them to the experts: int64 ids, weights in the activation dtype."""
    g = torch.Generator(device=device)
    g.manual_seed(seed * 1_000_003 + T)
    hidden = torch.randn(T, H, generator=g, device=device, dtype=torch.float32).to(torch.bfloat16)
    logits = torch.randn(T, E, generator=g, device=device, dtype=torch.float32)
    probs = torch.softmax(logits, dim=-1)
    top_w, top_i = torch.topk(probs, K, dim=-1)
    top_w = (top_w / top_w.sum(dim=-1, keepdim=True)).to(torch.bfloat16)
    return hidden, top_i.contiguous(), top_w.contiguous()


def bench_hf_shape(args, torch_side, shape: str, bandwidth_gbs: float) -> tuple[dict, dict]:
    torch, _transformers, _hf_moe, Qwen3MoeConfig, Qwen3MoeExperts = torch_side
    H, I, E, K = PRESETS[shape]
    device = args.torch_device
    info: dict = {"experts_class": f"{Qwen3MoeExperts.__module__}.{Qwen3MoeExperts.__qualname__}"}
    results: dict = {}
    config = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K,
                            hidden_act="silu", norm_topk_prob=True)
    log(f"[hf] {shape}: allocating {E * 3 * H * I * DTYPE_BYTES / 1e9:.2f} GB of bf16 expert weights ...")
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # Parameters are created bf16 on the device, no f32 copy
    try:
        with torch.device(device):
            experts = Qwen3MoeExperts(config)
    finally:
        torch.set_default_dtype(old_dtype)
    experts.eval().requires_grad_(False)
    g = torch.Generator(device=device)
    g.manual_seed(args.seed)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0.0, 1.0 / math.sqrt(H), generator=g)  # fan_in H
        experts.down_proj.normal_(0.0, 1.0 / math.sqrt(I), generator=g)  # fan_in I

    valid = set(_hf_moe.ALL_EXPERTS_FUNCTIONS.keys()) | {"eager"}
    for T in args.tokens:
        with torch.no_grad():
            hidden, top_i, top_w = make_routing(torch, T, E, K, H, device, args.seed)
            touched = int(torch.unique(top_i).numel())
        floor_bytes = touched * 3 * H * I * DTYPE_BYTES + T * H * (DTYPE_BYTES + DTYPE_BYTES)
        floor_ms = floor_bytes / (bandwidth_gbs * 1e9) * 1e3
        flops = 6.0 * T * K * H * I
        case = {"tokens": T, "experts_touched": touched, "routed_pairs": T * K, "flops": flops,
                "floor_bytes": floor_bytes, "floor_ms": floor_ms, "backends": {}}
        reference = None
        for name in args.backends:
            r: dict
            if name not in valid:
                r = {"status": "unavailable", "reason": f"not in transformers' ExpertsInterface ({sorted(valid)})"}
            else:
                config._experts_implementation = name  # what model.set_experts_implementation(name) sets
                out = None
                try:
                    with torch.no_grad():
                        fn = lambda: experts(hidden, top_i, top_w)  # noqa: E731  decorated forward dispatches
                        out = fn()
                        r = {"status": "ok", **time_call(torch, fn, args.max_seconds_per_case, args.max_runs)}
                        r["tflops"] = flops / (r["median_ms"] * 1e-3) / 1e12
                        r["floor_percent"] = 100.0 * floor_ms / r["median_ms"]
                        r["gb_per_second_floor"] = floor_bytes / (r["median_ms"] * 1e-3) / 1e9
                        if reference is None:
                            reference = (name, out.float())
                        else:
                            d = (out.float() - reference[1]).abs().max().item()
                            scale = reference[1].abs().max().item()
                            r["max_abs_diff_vs"] = {"backend": reference[0], "max_abs_diff": d, "ref_max_abs": scale}
                except torch.OutOfMemoryError as e:
                    r = {"status": "OOM", "reason": str(e).split("\n")[0][:300]}
                except Exception as e:  # noqa: BLE001  report and go on with the sweep
                    r = {"status": "error", "reason": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
                finally:
                    out = None
                    fn = None
                if r["status"] != "ok":
                    gc.collect()
                    torch.cuda.empty_cache()
            case["backends"][name] = r
            if r["status"] == "ok":
                log(f"[hf] {shape} T={T} {name}: {r['median_ms']:.4g} ms, {r['tflops']:.3g} TFLOP/s, "
                    f"{r['floor_percent']:.3g}% of floor ({r['runs']} runs)")
            else:
                log(f"[hf] {shape} T={T} {name}: {r['status']} {r.get('reason', '')}")
        results[T] = case
        reference = None
        del hidden, top_i, top_w
        torch.cuda.empty_cache()
    del experts
    gc.collect()
    torch.cuda.empty_cache()
    return results, info


# --------------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------------

def fmt_ms(x) -> str:
    if x is None:
        return "—"
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    if x >= 1:
        return f"{x:.2f}"
    return f"{x:.3f}"


def build_table(args, shape: str, hf: dict | None, mk: dict | None, bandwidth_gbs: float) -> tuple[list[str], list[dict]]:
    H, I, E, K = PRESETS[shape]
    show_mk = mk is not None
    header = ["tokens", "floor ms"] + [f"hf {b}" for b in args.backends]
    if show_mk:
        header += [f"moekit {b}" for b in args.backends]
        header += ["best hf / best moekit", "moekit best % of floor"]
    header += ["hf best % of floor"]
    lines = [f"### {shape} (H={H}, I={I}, E={E}, K={K}), bf16, times in ms (median)", "",
             "| " + " | ".join(header) + " |", "|" + "|".join("---:" for _ in header) + "|"]
    summary = []
    for T in args.tokens:
        case = (hf or {}).get(T)
        cells = [str(T)]
        floor_ms = case["floor_ms"] if case else None
        cells.append(fmt_ms(floor_ms))
        hf_best = None
        for b in args.backends:
            r = case["backends"].get(b) if case else None
            if r is None:
                cells.append("—")
            elif r["status"] == "ok":
                cells.append(fmt_ms(r["median_ms"]))
                if hf_best is None or r["median_ms"] < hf_best[1]:
                    hf_best = (b, r["median_ms"])
            else:
                cells.append(r["status"])
        mk_best = None
        mk_floor_pct = None
        if show_mk:
            for b in args.backends:
                r = mk.get((T, b))
                if r is None:
                    cells.append("—")
                elif r["status"] == "ok" and r["median_ms"] is not None:
                    cells.append(fmt_ms(r["median_ms"]))
                    if mk_best is None or r["median_ms"] < mk_best[1]:
                        mk_best = (b, r["median_ms"], r)
                else:
                    cells.append(r["status"])
            ratio = hf_best[1] / mk_best[1] if hf_best and mk_best else None
            cells.append(f"{ratio:.2f}x" if ratio else "—")
            if mk_best:
                r = mk_best[2]
                # moekit's own floor (it ran with the bandwidth measured here); else ours for its touched count
                mf = r.get("floor_ms")
                if not mf and r.get("experts_touched"):
                    mf = (r["experts_touched"] * 3 * H * I * DTYPE_BYTES + T * H * 2 * DTYPE_BYTES) / (
                        bandwidth_gbs * 1e9) * 1e3
                mf = mf or floor_ms
                mk_floor_pct = 100.0 * mf / mk_best[1] if mf else None
            cells.append(f"{mk_floor_pct:.1f}%" if mk_floor_pct is not None else "—")
        hf_pct = 100.0 * floor_ms / hf_best[1] if hf_best and floor_ms else None
        cells.append(f"{hf_pct:.1f}%" if hf_pct is not None else "—")
        lines.append("| " + " | ".join(cells) + " |")
        summary.append({
            "tokens": T, "floor_ms": floor_ms,
            "hf_best": {"backend": hf_best[0], "median_ms": hf_best[1]} if hf_best else None,
            "moekit_best": {"backend": mk_best[0], "median_ms": mk_best[1]} if mk_best else None,
            "speedup_moekit_over_hf": (hf_best[1] / mk_best[1]) if hf_best and mk_best else None,
            "moekit_best_floor_percent": mk_floor_pct, "hf_best_floor_percent": hf_pct,
        })
    return lines, summary


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    report: dict = {"tool": "scripts/compare_transformers.py", "argv": sys.argv[1:],
                    "options": {k: v for k, v in vars(args).items()}, "shapes": {}, "notes": []}

    torch_side = None
    try:
        torch_side = import_torch_side()
    except Exception as e:  # noqa: BLE001
        msg = f"transformers side unavailable ({type(e).__name__}: {e}); transformers columns are empty"
        log(msg)
        report["notes"].append(msg)

    bandwidth = None
    if torch_side:
        torch, transformers, hf_moe, _, experts_cls = torch_side
        if not torch.cuda.is_available() and args.device.startswith("cuda"):
            msg = "torch sees no CUDA device; transformers side skipped"
            log(msg)
            report["notes"].append(msg)
            torch_side = None
        else:
            dev = torch.device(args.device)
            if dev.type == "cuda" and dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
            args.torch_device = dev
            torch.cuda.set_device(dev)
            props = torch.cuda.get_device_properties(dev)
            report["machine"] = {
                "gpu": props.name, "sm_count": props.multi_processor_count,
                "memory_gb": props.total_memory / 1e9, "torch": torch.__version__,
                "transformers": transformers.__version__, "cuda": torch.version.cuda,
                "grouped_mm_op": "torch.nn.functional.grouped_mm" if hasattr(torch.nn.functional, "grouped_mm")
                else ("torch._grouped_mm" if hasattr(torch, "_grouped_mm") else "fallback loop"),
                "experts_functions": sorted(hf_moe.ALL_EXPERTS_FUNCTIONS.keys()),
            }
            log(f"[hf] {props.name}, torch {torch.__version__}, transformers {transformers.__version__}; "
                f"experts functions {report['machine']['experts_functions']}")
            bandwidth = measure_copy_bandwidth(torch, dev)
            report["copy_bandwidth"] = bandwidth
            log(f"[hf] copy bandwidth {bandwidth['gb_per_second']:.0f} GB/s ({bandwidth['source']})")
    bw_gbs = bandwidth["gb_per_second"] if bandwidth else 0.0
    if not bw_gbs:
        m = shlex.split(args.moekit_extra_args)
        for i, a in enumerate(m):
            if a.startswith("--memory-bandwidth-gbs"):
                bw_gbs = float(a.split("=", 1)[1] if "=" in a else m[i + 1])

    md = ["# transformers experts backends vs moekit", ""]
    if "machine" in report:
        mch = report["machine"]
        md.append(f"{mch['gpu']}; torch {mch['torch']}, transformers {mch['transformers']} "
                  f"(grouped_mm via {mch['grouped_mm_op']}); copy bandwidth {bw_gbs:.0f} GB/s (read + write).")
    md.append("Forward only, no_grad, no compile; median of CUDA-event timed calls after 3 warm-ups; each call "
              "starts on an idle GPU, so small-T times include host launch overhead.")
    md.append("floor = experts touched x 3·H·I x 2 B + T·H·(2+2) B over the copy bandwidth; speedup = best hf time / "
              "best moekit time (>1: moekit faster).")
    md.append("")

    workdir = args.out or tempfile.mkdtemp(prefix="compare_transformers_")
    exit_code = 0
    for shape in args.shapes:
        entry: dict = {"preset": dict(zip(("hidden", "intermediate", "experts", "top_k"), PRESETS[shape]))}
        mk_rows = None
        if args.moekit:
            data, err, cmd = run_moekit(args, shape, bw_gbs, workdir)
            entry["moekit_command"] = shlex.join(cmd) if cmd else None
            if err:
                log(f"[moekit] {shape}: {err} -- showing transformers' columns only")
                entry["moekit_error"] = err
                report["notes"].append(f"{shape}: {err}")
            else:
                mk_rows, problems = parse_moekit_rows(data, shape)
                for pr in problems:
                    log(f"[moekit] JSON schema: {pr}")
                entry["moekit_schema_problems"] = problems
                entry["moekit_options"] = data.get("options")
                entry["moekit_machine"] = data.get("machine")
                if not mk_rows:
                    msg = f"{shape}: moekit JSON had no usable rows for this shape"
                    log(f"[moekit] {msg}")
                    report["notes"].append(msg)
                    mk_rows = None
                entry["moekit_rows"] = [r["raw"] for r in (mk_rows or {}).values()]
        hf_res = None
        if torch_side:
            try:
                hf_res, info = bench_hf_shape(args, torch_side, shape, bw_gbs)
                entry["hf_info"] = info
            except Exception as e:  # noqa: BLE001
                msg = f"{shape}: transformers side failed: {type(e).__name__}: {e}"
                log(f"[hf] {msg}")
                report["notes"].append(msg)
                exit_code = 1
        entry["hf_cases"] = [hf_res[T] for T in args.tokens] if hf_res else []
        lines, summary = build_table(args, shape, hf_res, mk_rows, bw_gbs or 1.0)
        entry["summary"] = summary
        report["shapes"][shape] = entry
        md += lines
        if mk_rows:
            notes = [f"- moekit {b} T={T}: {r['status']}: {r['reason']}" for (T, b), r in sorted(mk_rows.items())
                     if r["status"] != "ok" and r.get("reason")]
            md += [""] + notes if notes else []
        if entry.get("moekit_error"):
            md += ["", f"moekit not shown: {entry['moekit_error']}"]
        md.append("")
    if report["notes"]:
        md += ["Notes:"] + [f"- {n}" for n in report["notes"]] + [""]

    text = "\n".join(md)
    print(text)
    if args.out:
        with open(os.path.join(args.out, "compare.md"), "w") as f:
            f.write(text + "\n")
        with open(os.path.join(args.out, "compare.json"), "w") as f:
            json.dump(report, f, indent=2, default=str)
        log(f"wrote {os.path.join(args.out, 'compare.md')} and compare.json")
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
