#!/usr/bin/env python3
"""Yardstick: time Hugging Face transformers' own experts implementations next to `moekit bench`.

Runs on the GPU machine (torch + transformers installed). moekit itself never imports torch; this
script is only the reference it is measured against. For each shape preset and token count it times
transformers' `eager`, `batched_mm` and `grouped_mm` experts forwards (the same code path a model takes:
a `@use_experts_implementation` experts module whose `config._experts_implementation` selects the
function from `transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS`), optionally runs
`moekit bench --device cuda` on the same shapes, token counts and backends, and prints one markdown
table per shape with both sides, the speedup and the memory-floor percentage. With --backward it times
forward + backward instead (torch autograd through the same module; `moekit bench --backward`) and adds
TFLOP/s and each call's peak memory to the table.

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
GIB = 1 << 30


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
                   help="comma-separated presets: " + ", ".join(PRESETS) +
                   ", or custom (sizes from --hidden, --intermediate, --experts, --top-k)")
    p.add_argument("--hidden", type=int, default=0, help="H of the custom shape")
    p.add_argument("--intermediate", type=int, default=0, help="I of the custom shape")
    p.add_argument("--experts", type=int, default=0, help="E of the custom shape")
    p.add_argument("--top-k", type=int, default=0, help="K of the custom shape")
    p.add_argument("--backward", action="store_true",
                   help="time forward + backward: torch autograd through transformers' module, `moekit bench "
                   "--backward`; reports ms, TFLOP/s over 18·pairs·H·I and each call's peak memory")
    p.add_argument("--graphs", action="store_true",
                   help="run moekit with --graphs (each call replayed as a CUDA graph); transformers runs eagerly")
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
    p.add_argument("--device", default="cuda",
                   help="torch device for transformers, and moekit's --device: cuda, cuda:N, or cpu (small shapes: "
                   "a check of the script on a machine without a GPU)")
    args = p.parse_args(argv)
    args.shapes = csv_list(args.shapes)
    bad = [s for s in args.shapes if s not in PRESETS and s != "custom"]
    if bad:
        p.error(f"unknown shape(s) {bad}; valid: {', '.join(PRESETS)}, custom")
    custom = (args.hidden, args.intermediate, args.experts, args.top_k)
    if "custom" in args.shapes and min(custom) < 1:
        p.error("--shapes custom needs positive --hidden, --intermediate, --experts and --top-k")
    if "custom" not in args.shapes and max(custom) > 0:
        p.error("--hidden, --intermediate, --experts and --top-k describe the custom shape; add custom to --shapes")
    if "custom" in args.shapes and args.top_k > args.experts:
        p.error("--top-k cannot exceed --experts (each token takes K distinct experts)")
    # (H, I, E, K) of every shape that runs; moekit gets the same sizes (`--shape custom --hidden ...`).
    args.sizes = {s: custom if s == "custom" else PRESETS[s] for s in args.shapes}
    if not (args.device == "cpu" or args.device == "cuda" or args.device.startswith("cuda:")):
        p.error(f"--device must be cuda, cuda:N or cpu, got {args.device!r}")
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
    cmd = [path, "bench", "--device", args.device, "--shape", shape]
    if shape == "custom":
        H, I, E, K = args.sizes[shape]
        cmd += ["--hidden", str(H), "--intermediate", str(I), "--experts", str(E), "--top-k", str(K)]
    cmd += ["--tokens", ",".join(str(t) for t in args.tokens),
            "--backends", ",".join(args.backends), "--dtype", "bf16", "--json", json_path]
    if args.backward and not _has_flag(extra, "--backward"):
        cmd += ["--backward"]
    if args.graphs and not _has_flag(extra, "--graphs"):
        cmd += ["--graphs"]
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
        # A backward case also allocates and fills its gradients (the size of the weights) before timing.
        timeout = 600 + cases * (2.0 * args.max_seconds_per_case + 5.0) * (2 if args.backward else 1)
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
            "routed_pairs": row.get("routed_pairs"),
            "call_memory_bytes": row.get("call_memory_bytes"),
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


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def measure_copy_bandwidth(torch, device) -> dict:
    """A device-to-device copy (2 GiB on a GPU, 256 MiB on the CPU); GB/s counts bytes read + bytes written (as
    DESIGN §7 / moekit do)."""
    clock = Clock(torch, device)
    nbytes = (2 << 30) if clock.cuda else (256 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = [clock.time_ms(lambda: dst.copy_(src))[0] for _ in range(10)]
    del src, dst
    clock.empty_cache()
    med = statistics.median(times)
    return {
        "gb_per_second": 2 * nbytes / (med * 1e-3) / 1e9,
        "best_gb_per_second": 2 * nbytes / (min(times) * 1e-3) / 1e9,
        "source": f"torch copy_ of {nbytes >> 20} MiB on {device}, median of {len(times)}, "
                  "bytes read + bytes written counted",
    }


class Clock:
    """Times one call on the device. On a GPU: CUDA events around the call, which starts on an idle GPU
    (synchronised first), so its time is the latency of one call including its host-side launch overhead, as a
    model's forward sees it. On the CPU, where torch's calls return when their work is done: the host clock."""

    def __init__(self, torch, device):
        self.torch = torch
        self.cuda = torch.device(device).type == "cuda"

    def time_ms(self, fn) -> tuple[float, float]:
        """(time of the call in ms, host wall-clock seconds it took)."""
        torch = self.torch
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            wall = time.perf_counter() - t0
            return wall * 1e3, wall
        torch.cuda.synchronize()
        w0 = time.perf_counter()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b), time.perf_counter() - w0

    def empty_cache(self) -> None:
        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()


def time_call(clock: Clock, fn, budget_s: float, max_runs: int) -> dict:
    """3 warm-ups, then timed runs: at least 20 when the budget allows, at least 3, at most max_runs."""
    warm_ms, warm_wall = [], []
    t_start = time.perf_counter()
    for _ in range(WARMUP):
        ms, wall = clock.time_ms(fn)
        warm_ms.append(ms)
        warm_wall.append(wall)
        if time.perf_counter() - t_start > budget_s:
            break
    # The first call may carry one-off set-up (cuBLAS handles, allocator growth): estimate from the others.
    est_wall = max(min(warm_ms[1:] or warm_ms) * 1e-3, min(warm_wall[1:] or warm_wall), 1e-6)
    runs = max(3, min(max_runs, int(budget_s / est_wall)))
    times = [clock.time_ms(fn)[0] for _ in range(runs)]
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times),
            "runs": len(times), "warmup_runs": len(warm_ms)}


def call_memory(clock: Clock, fn, call_inputs_bytes: int, release) -> int | None:
    """Peak bytes one call holds beyond the inputs and weights, on a GPU (torch keeps no such count on the CPU).

    torch.cuda.max_memory_allocated over the call minus what was allocated before it, plus call_inputs_bytes:
    what the caller allocated for the call itself (grad_out), which moekit's call_memory_bytes counts too. So it
    counts out, grad_out, the gradients and everything the call allocates or autograd saves for the backward.
    release() first drops what an earlier call left (its gradients), which the call would free and reuse."""
    if not clock.cuda:
        return None
    torch = clock.torch
    release()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before + call_inputs_bytes


def make_routing(torch, T: int, E: int, K: int, H: int, device, seed: int):
    """Per token K distinct experts uniformly at random (top-k of i.i.d. scores), softmax-normalised weights.

    As a Qwen3-MoE router hands them to the experts: int64 ids, weights in the activation dtype. Also a grad_out
    for the backward, drawn last so that inputs and routing are the forward's."""
    g = torch.Generator(device=device)
    g.manual_seed(seed * 1_000_003 + T)
    hidden = torch.randn(T, H, generator=g, device=device, dtype=torch.float32).to(torch.bfloat16)
    logits = torch.randn(T, E, generator=g, device=device, dtype=torch.float32)
    probs = torch.softmax(logits, dim=-1)
    top_w, top_i = torch.topk(probs, K, dim=-1)
    top_w = (top_w / top_w.sum(dim=-1, keepdim=True)).to(torch.bfloat16)
    grad_out = torch.randn(T, H, generator=g, device=device, dtype=torch.float32).to(torch.bfloat16)
    return hidden, top_i.contiguous(), top_w.contiguous(), grad_out


def floor_and_flops(args, H: int, I: int, K: int, T: int, touched: int) -> tuple[float, float]:
    """(floor bytes, FLOPs) of one call, as `moekit bench` counts them. Forward: each touched expert's weights read
    once, x read and out written; 6·pairs·H·I. Forward + backward: the weights read by both passes and their
    gradients written, x read by both, out written, grad_out read and grad_x written; 18·pairs·H·I (the backward
    counted as twice the forward, DESIGN §2b)."""
    expert_bytes = 3 * H * I * DTYPE_BYTES
    row_bytes = H * DTYPE_BYTES
    if args.backward:
        return 3 * touched * expert_bytes + 5 * T * row_bytes, 18.0 * T * K * H * I
    return touched * expert_bytes + 2 * T * row_bytes, 6.0 * T * K * H * I


def drop_gradients(experts, hidden, top_w) -> None:
    for t in (hidden, top_w, *experts.parameters()):
        t.grad = None


def experts_call(torch, experts, hidden, top_i, top_w, grad_out, backward: bool):
    """One call as a model makes it. Forward: under no_grad. Forward + backward: autograd to the inputs and the
    module's weights, with the previous call's gradients dropped first, as zero_grad(set_to_none=True) does in a
    training step, so each call allocates its gradients again; returns (out, grad_hidden_states)."""
    if not backward:
        with torch.no_grad():
            return experts(hidden, top_i, top_w), None
    drop_gradients(experts, hidden, top_w)
    out = experts(hidden, top_i, top_w)
    out.backward(grad_out)
    return out.detach(), hidden.grad


def bench_hf_shape(args, torch_side, shape: str, bandwidth_gbs: float) -> tuple[dict, dict]:
    torch, _transformers, _hf_moe, Qwen3MoeConfig, Qwen3MoeExperts = torch_side
    H, I, E, K = args.sizes[shape]
    device = args.torch_device
    clock = Clock(torch, device)
    info: dict = {"experts_class": f"{Qwen3MoeExperts.__module__}.{Qwen3MoeExperts.__qualname__}",
                  "mode": "forward + backward (torch autograd)" if args.backward else "forward (no_grad)"}
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
    if args.backward:
        experts.train().requires_grad_(True)
    else:
        experts.eval().requires_grad_(False)
    g = torch.Generator(device=device)
    g.manual_seed(args.seed)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0.0, 1.0 / math.sqrt(H), generator=g)  # fan_in H
        experts.down_proj.normal_(0.0, 1.0 / math.sqrt(I), generator=g)  # fan_in I

    valid = set(_hf_moe.ALL_EXPERTS_FUNCTIONS.keys()) | {"eager"}
    for T in args.tokens:
        with torch.no_grad():
            hidden, top_i, top_w, grad_out = make_routing(torch, T, E, K, H, device, args.seed)
            touched = int(torch.unique(top_i).numel())
        if args.backward:
            hidden.requires_grad_(True)  # leaves: their gradients are part of the contract (DESIGN §2b)
            top_w.requires_grad_(True)
        floor_bytes, flops = floor_and_flops(args, H, I, K, T, touched)
        floor_ms = floor_bytes / (bandwidth_gbs * 1e9) * 1e3
        case = {"tokens": T, "experts_touched": touched, "routed_pairs": T * K, "flops": flops,
                "floor_bytes": floor_bytes, "floor_ms": floor_ms, "backends": {}}
        reference = None
        for name in args.backends:
            r: dict
            if name not in valid:
                r = {"status": "unavailable", "reason": f"not in transformers' ExpertsInterface ({sorted(valid)})"}
            else:
                config._experts_implementation = name  # what model.set_experts_implementation(name) sets
                out = grad_x = None
                try:
                    fn = lambda: experts_call(torch, experts, hidden, top_i, top_w, grad_out, args.backward)  # noqa: E731
                    out, grad_x = fn()
                    r = {"status": "ok", **time_call(clock, fn, args.max_seconds_per_case, args.max_runs)}
                    r["tflops"] = flops / (r["median_ms"] * 1e-3) / 1e12
                    r["floor_percent"] = 100.0 * floor_ms / r["median_ms"]
                    r["gb_per_second_floor"] = floor_bytes / (r["median_ms"] * 1e-3) / 1e9
                    r["call_memory_bytes"] = call_memory(clock, fn, grad_out.nbytes if args.backward else 0,
                                                         lambda: drop_gradients(experts, hidden, top_w))
                    # out under its old keys; with --backward grad_hidden_states too, under its name.
                    compared = [("", out)] + ([("grad_hidden_states_", grad_x)] if args.backward else [])
                    if reference is None:
                        reference = (name, {k: v.float() for k, v in compared})
                    else:
                        r["max_abs_diff_vs"] = {"backend": reference[0]}
                        for k, v in compared:
                            r["max_abs_diff_vs"][k + "max_abs_diff"] = (v.float() - reference[1][k]).abs().max().item()
                            r["max_abs_diff_vs"][k + "ref_max_abs"] = reference[1][k].abs().max().item()
                except torch.OutOfMemoryError as e:
                    r = {"status": "OOM", "reason": str(e).split("\n")[0][:300]}
                except Exception as e:  # noqa: BLE001  report and go on with the sweep
                    r = {"status": "error", "reason": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
                finally:
                    out = grad_x = None
                    fn = None
                    drop_gradients(experts, hidden, top_w)  # none may count against the next backend
                if r["status"] != "ok":
                    clock.empty_cache()
            case["backends"][name] = r
            if r["status"] == "ok":
                mem = r["call_memory_bytes"]
                log(f"[hf] {shape} T={T} {name}: {r['median_ms']:.4g} ms, {r['tflops']:.3g} TFLOP/s, "
                    f"{r['floor_percent']:.3g}% of floor" + (f", {mem / GIB:.3g} GiB call memory" if mem else "") +
                    f" ({r['runs']} runs)")
            else:
                log(f"[hf] {shape} T={T} {name}: {r['status']} {r.get('reason', '')}")
        results[T] = case
        reference = None
        del hidden, top_i, top_w, grad_out
        clock.empty_cache()
    del experts
    clock.empty_cache()
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


def backend_cells(backends: list[str], row_of, show) -> tuple[list[str], tuple | None]:
    """One cell per backend: show(row) where it ran, its status where it did not, — where it has no row; and the
    fastest that ran, as (backend, median ms, row)."""
    cells, best = [], None
    for b in backends:
        r = row_of(b)
        if r is None:
            cells.append("—")
        elif r["status"] == "ok" and r.get("median_ms") is not None:
            cells.append(show(r))
            if best is None or r["median_ms"] < best[1]:
                best = (b, r["median_ms"], r)
        else:
            cells.append(r["status"])
    return cells, best


def build_table(args, shape: str, hf: dict | None, mk: dict | None, bandwidth_gbs: float) -> tuple[list[str], list[dict]]:
    if args.backward:
        return build_backward_table(args, shape, hf, mk)
    H, I, E, K = args.sizes[shape]
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
        hf_cells, hf_best = backend_cells(args.backends, lambda b: case["backends"].get(b) if case else None,
                                          lambda r: fmt_ms(r["median_ms"]))
        cells += hf_cells
        mk_best = None
        mk_floor_pct = None
        if show_mk:
            mk_cells, mk_best = backend_cells(args.backends, lambda b: mk.get((T, b)), lambda r: fmt_ms(r["median_ms"]))
            cells += mk_cells
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


def fmt_gib(nbytes) -> str:
    return "—" if nbytes is None else f"{nbytes / GIB:.3g} GiB"


def moekit_tflops(r: dict, H: int, I: int) -> float | None:
    """moekit's own FLOP rate (it counts 18·pairs·H·I for forward + backward too), or ours from its routed pairs."""
    if r.get("flops_per_second"):
        return r["flops_per_second"] / 1e12
    if r.get("routed_pairs") and r.get("median_ms"):
        return 18.0 * r["routed_pairs"] * H * I / (r["median_ms"] * 1e-3) / 1e12
    return None


def build_backward_table(args, shape: str, hf: dict | None, mk: dict | None) -> tuple[list[str], list[dict]]:
    """One row per token count; each backend's cell: forward + backward ms, TFLOP/s, peak call memory."""
    H, I, E, K = args.sizes[shape]
    show_mk = mk is not None
    header = ["tokens", "floor ms"] + [f"hf {b}" for b in args.backends]
    if show_mk:
        header += [f"moekit {b}" for b in args.backends]
        header += ["best hf / best moekit", "memory hf / moekit"]
    lines = [f"### {shape} (H={H}, I={I}, E={E}, K={K}), bf16, forward + backward: ms (median) · TFLOP/s · "
             "call memory", "",
             "| " + " | ".join(header) + " |", "|" + "|".join("---:" for _ in header) + "|"]
    summary = []

    def cell(ms, tflops, mem) -> str:
        return " · ".join([fmt_ms(ms), f"{tflops:.3g} TF/s" if tflops else "—", fmt_gib(mem)])

    for T in args.tokens:
        case = (hf or {}).get(T)
        cells = [str(T), fmt_ms(case["floor_ms"] if case else None)]
        # (backend, ms, call memory) of each side's fastest
        hf_cells, hf_best = backend_cells(args.backends, lambda b: case["backends"].get(b) if case else None,
                                          lambda r: cell(r["median_ms"], r["tflops"], r.get("call_memory_bytes")))
        hf_best = hf_best and (hf_best[0], hf_best[1], hf_best[2].get("call_memory_bytes"))
        cells += hf_cells
        mk_best = None
        if show_mk:
            mk_cells, mk_best = backend_cells(
                args.backends, lambda b: mk.get((T, b)),
                lambda r: cell(r["median_ms"], moekit_tflops(r, H, I), r.get("call_memory_bytes")))
            mk_best = mk_best and (mk_best[0], mk_best[1], mk_best[2].get("call_memory_bytes"))
            cells += mk_cells
            ratio = hf_best[1] / mk_best[1] if hf_best and mk_best else None
            cells.append(f"{ratio:.2f}x" if ratio else "—")
            mem_ratio = hf_best[2] / mk_best[2] if hf_best and mk_best and hf_best[2] and mk_best[2] else None
            cells.append(f"{mem_ratio:.2f}x" if mem_ratio else "—")
        lines.append("| " + " | ".join(cells) + " |")
        summary.append({
            "tokens": T, "floor_ms": case["floor_ms"] if case else None,
            "hf_best": {"backend": hf_best[0], "median_ms": hf_best[1], "call_memory_bytes": hf_best[2]}
            if hf_best else None,
            "moekit_best": {"backend": mk_best[0], "median_ms": mk_best[1], "call_memory_bytes": mk_best[2]}
            if mk_best else None,
            "speedup_moekit_over_hf": (hf_best[1] / mk_best[1]) if hf_best and mk_best else None,
            "memory_hf_over_moekit": (hf_best[2] / mk_best[2])
            if hf_best and mk_best and hf_best[2] and mk_best[2] else None,
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
            if dev.type == "cuda":
                torch.cuda.set_device(dev)
                props = torch.cuda.get_device_properties(dev)
                where = {"gpu": props.name, "sm_count": props.multi_processor_count,
                         "memory_gb": props.total_memory / 1e9, "cuda": torch.version.cuda}
            else:
                where = {"gpu": f"CPU ({cpu_name()}, {torch.get_num_threads()} torch threads)"}
            report["machine"] = {
                **where, "torch": torch.__version__, "transformers": transformers.__version__,
                "grouped_mm_op": "torch.nn.functional.grouped_mm" if hasattr(torch.nn.functional, "grouped_mm")
                else ("torch._grouped_mm" if hasattr(torch, "_grouped_mm") else "fallback loop"),
                "experts_functions": sorted(hf_moe.ALL_EXPERTS_FUNCTIONS.keys()),
            }
            log(f"[hf] {where['gpu']}, torch {torch.__version__}, transformers {transformers.__version__}; "
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
    timing = ("median of CUDA-event timed calls after 3 warm-ups; each call starts on an idle GPU, so small-T "
              "times include host launch overhead." if args.device != "cpu" else
              "median of host-clock timed calls after 3 warm-ups (CPU).")
    if args.backward:
        md.append("Forward + backward: torch autograd through transformers' module to hidden_states, top_k_weights "
                  "and the expert weights, gradients set to None before each call (zero_grad(set_to_none=True)), "
                  "no compile; `moekit bench --backward`" + (" --graphs" if args.graphs else "") + "; " + timing)
        md.append("TFLOP/s over 18·pairs·H·I (forward 6, backward 12); call memory = peak allocated during one call "
                  "minus the inputs and weights (out, grad_out, gradients, saved activations, workspace; moekit: "
                  "its call_memory_bytes); floor = touched experts x 3·H·I x 2 B x 3 + T·H x 2 B x 5 over the "
                  "copy bandwidth; speedup = best hf time / best moekit time (>1: moekit faster).")
    else:
        md.append("Forward only, no_grad, no compile; " + timing)
        md.append("floor = experts touched x 3·H·I x 2 B + T·H·(2+2) B over the copy bandwidth; speedup = best hf "
                  "time / best moekit time (>1: moekit faster).")
    md.append("")

    workdir = args.out or tempfile.mkdtemp(prefix="compare_transformers_")
    exit_code = 0
    for shape in args.shapes:
        entry: dict = {"preset": dict(zip(("hidden", "intermediate", "experts", "top_k"), args.sizes[shape]))}
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
