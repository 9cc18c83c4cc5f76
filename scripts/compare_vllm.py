#!/usr/bin/env python3
"""Yardstick: vLLM's Triton `fused_moe_kernel` next to `moekit bench`, bf16, CUDA graphs on both sides.

Runs on the GPU machine (torch + Triton). vLLM is not installed there and never a dependency: the kernel's source
is read from the file `scripts/fetch_vllm_kernel.sh` extracts from vLLM's wheel (fused_moe.py, carried beside
gpu-bundle/), and only its two Triton functions (`fused_moe_kernel` and the `write_zeros_to_output` it calls) are
compiled, from a temporary module. Around them, the layer as vLLM's `fused_experts_impl` runs it for unquantised
weights:
  gate_up GEMM (the kernel, top_k rows per token, no routing weight) -> SiLU-and-mul -> down GEMM (the kernel,
  routing weight applied in its epilogue) -> sum over the k rows of each token.
vLLM's CUDA ops (`silu_and_mul`, `moe_sum`, `moe_align_block_size`) are not available without its wheel's compiled
library: SiLU-and-mul is one Triton kernel of ours (one launch, as vLLM's op), the sum is torch's `sum` over k (one
launch), and the alignment (tokens sorted by expert, each expert's rows padded to BLOCK_SIZE_M) is made with torch
ops before timing, as issue 37 asks. The kernel's configuration is vLLM's: its tuned file for (E, N = I, this GPU)
where the wheel ships one (the nearest batch size, as `try_get_optimal_moe_config`), else its bf16 defaults
(`get_default_config`, restated below). The whole layer is captured in one CUDA graph and each timed run is one
replay between CUDA events; moekit runs `bench --graphs` on the same shapes and token counts in the same call,
with the copy bandwidth measured here, so both floors agree.

Every vLLM case is checked against a float32 torch computation of the same layer (relative L2 error and the worst
token's), so a wrong setup cannot pass as a fast one.

  python3 scripts/compare_vllm.py --vllm-kernel gpu-bundle/vllm/fused_moe.py --moekit gpu-bundle/moekit \\
      --shapes qwen3-30b-a3b,deepseek-v3 --tokens 16,64,256,1024 --out $OUT/vllm
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import math
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare_transformers as ct  # noqa: E402

KERNEL_FUNCTIONS = ("write_zeros_to_output", "fused_moe_kernel")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-kernel", required=True, metavar="FILE",
                   help="vLLM's model_executor/layers/fused_moe/fused_moe.py (scripts/fetch_vllm_kernel.sh)")
    p.add_argument("--vllm-configs", default=None, metavar="DIR",
                   help="vLLM's fused_moe/configs folder (default: configs/ beside --vllm-kernel, if there)")
    p.add_argument("--shapes", default="qwen1.5-moe-a2.7b,qwen3-30b-a3b,mixtral-8x7b,deepseek-v3",
                   help="comma-separated presets: " + ", ".join(ct.PRESETS))
    p.add_argument("--tokens", default="16,32,64,128,256,512,1024", help="comma-separated token counts T")
    p.add_argument("--moekit", default=None, metavar="PATH", help="moekit binary (`bench --graphs` per shape)")
    p.add_argument("--backends", default="batched_mm,grouped_mm,deepgemm,sonicmoe", help="moekit's backends")
    p.add_argument("--moekit-extra-args", default="", help="string appended to the moekit command")
    p.add_argument("--max-seconds-per-case", type=float, default=0.5, help="time budget of one timed case")
    p.add_argument("--max-runs", type=int, default=200, help="at most this many timed replays per vLLM case")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, metavar="DIR", help="write compare_vllm.md and compare_vllm.json there")
    args = p.parse_args(argv)
    args.shapes = ct.csv_list(args.shapes)
    bad = [s for s in args.shapes if s not in ct.PRESETS]
    if bad:
        p.error(f"unknown shape(s) {bad}; valid: {', '.join(ct.PRESETS)}")
    try:
        args.tokens = sorted({int(t) for t in ct.csv_list(args.tokens)})
    except ValueError:
        p.error("--tokens takes comma-separated integers")
    if not args.tokens or min(args.tokens) < 1:
        p.error("--tokens needs positive integers")
    args.backends = ct.csv_list(args.backends)
    if not os.path.isfile(args.vllm_kernel):
        p.error(f"--vllm-kernel {args.vllm_kernel!r} is not a file (run scripts/fetch_vllm_kernel.sh)")
    if args.vllm_configs is None:
        beside = os.path.join(os.path.dirname(os.path.abspath(args.vllm_kernel)), "configs")
        args.vllm_configs = beside if os.path.isdir(beside) else None
    # What compare_transformers.run_moekit reads.
    args.sizes = {s: ct.PRESETS[s] for s in args.shapes}
    args.device, args.backward, args.graphs, args.moekit_timeout = "cuda", False, True, 0
    return args


def kernel_source(path: str) -> str:
    """A module of the two Triton functions of vLLM's fused_moe.py alone, with the imports they need."""
    with open(path) as f:
        source = f.read()
    tree = ast.parse(source)
    found = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in KERNEL_FUNCTIONS}
    missing = [n for n in KERNEL_FUNCTIONS if n not in found]
    if missing:
        raise SystemExit(f"{path} has no {missing}: not the fused_moe.py of the vLLM version this script reads (0.33)")
    lines = source.splitlines()
    text = "import triton\nimport triton.language as tl\n"
    for n in KERNEL_FUNCTIONS:
        node = found[n]
        first = min([d.lineno for d in node.decorator_list] + [node.lineno])  # from the @triton.jit line
        text += "\n\n" + "\n".join(lines[first - 1:node.end_lineno]) + "\n"
    return text


def load_kernel(path: str):
    """vLLM's fused_moe_kernel, compiled from a temporary module of kernel_source's (Triton reads a function's
    source from its file, so the functions are written to one rather than exec'd)."""
    text = kernel_source(path)
    folder = tempfile.mkdtemp(prefix="vllm_kernel_")
    module_path = os.path.join(folder, "vllm_fused_moe_kernel.py")
    with open(module_path, "w") as f:
        f.write(text)
    spec = importlib.util.spec_from_file_location("vllm_fused_moe_kernel", module_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.fused_moe_kernel


def device_file_name(torch) -> str:
    # As vLLM names its configuration files: spaces and dashes to underscores, every H200 variant as NVIDIA_H200.
    name = torch.cuda.get_device_name().replace(" ", "_").replace("-", "_")
    return "NVIDIA_H200" if "H200" in name.split("_") else name


def vllm_config(args, torch, T: int, E: int, I: int) -> tuple[dict, str]:
    """(config, where it came from) as vLLM 0.33 picks it for bf16 weights."""
    if args.vllm_configs:
        path = os.path.join(args.vllm_configs, f"E={E},N={I},device_name={device_file_name(torch)}.json")
        if os.path.isfile(path):
            with open(path) as f:
                table = {int(k): v for k, v in json.load(f).items() if k != "triton_version"}
            return dict(table[min(table, key=lambda m: abs(m - T))]), "tuned " + os.path.basename(path)
    # vLLM's bf16 defaults: small batches stream the weights with tall K tiles, larger ones widen M and N.
    block_m = 16 if T <= 32 else 32 if T <= 96 else 64 if T <= 512 else 128
    config = {"BLOCK_SIZE_M": block_m, "BLOCK_SIZE_N": 64 if T <= 64 else 128, "BLOCK_SIZE_K": 128 if T <= 64 else 64,
              "GROUP_SIZE_M": 16 if T // max(E, 1) > 128 else 1, "num_warps": 4 if T <= 128 else 8,
              "num_stages": 4 if T <= 32 else 3}
    return config, "vLLM default"


def align(torch, top_i, E: int, block_m: int):
    """moe_align_block_size's outputs from torch ops: the pair ids sorted by expert, each expert's run padded to a
    multiple of block_m with the id P (no pair); the expert of each block; the padded total."""
    flat = top_i.flatten().to(torch.int64)
    P = flat.numel()
    counts = torch.bincount(flat, minlength=E)
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded
    order = torch.sort(flat, stable=True).indices
    sorted_experts = flat[order]
    first_of_expert = torch.cumsum(counts, 0) - counts
    rank = torch.arange(P, device=flat.device) - first_of_expert[sorted_experts]
    capacity = P + E * (block_m - 1)
    if P < E:
        capacity = min(P * block_m, capacity)
    sorted_ids = torch.full((capacity,), P, dtype=torch.int32, device=flat.device)
    sorted_ids[starts[sorted_experts] + rank] = order.to(torch.int32)
    blocks = (capacity + block_m - 1) // block_m
    block_start = torch.arange(blocks, device=flat.device) * block_m
    ends = starts + padded
    expert_ids = torch.searchsorted(ends, block_start, right=True).clamp(max=E - 1).to(torch.int32)
    total = padded.sum().to(torch.int32).reshape(1)
    return sorted_ids, expert_ids, total


def make_silu_and_mul(triton, tl):
    @triton.jit
    def silu_and_mul_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        # y[r, c] = silu(x[r, c]) * x[r, n + c], in float, one row per program along axis 0
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n
        g = tl.load(x_ptr + row * 2 * n + cols, mask=mask).to(tl.float32)
        u = tl.load(x_ptr + row * 2 * n + n + cols, mask=mask).to(tl.float32)
        y = g / (1.0 + tl.exp(-g)) * u
        tl.store(y_ptr + row * n + cols, y.to(y_ptr.dtype.element_ty), mask=mask)

    def silu_and_mul(x, y):
        rows, n = y.shape
        silu_and_mul_kernel[(rows, triton.cdiv(n, 1024))](x, y, n, BLOCK=1024)

    return silu_and_mul


class VllmLayer:
    """vLLM's unquantised fused_experts for one (shape, T): buffers, alignment and launches fixed up front."""

    def __init__(self, torch, triton, tl, kernel, silu_and_mul, w1, w2, hidden, top_i, top_w, config):
        self.torch, self.triton, self.kernel, self.silu_and_mul = torch, triton, kernel, silu_and_mul
        self.w1, self.w2, self.hidden, self.top_w = w1, w2, hidden, top_w.float().contiguous()
        T, K = top_i.shape
        E, N, H = w1.shape
        self.T, self.K, self.N = T, K, N
        self.config = dict(config)
        self.block_k = self.config.pop("BLOCK_SIZE_K")
        self.config.pop("SPLIT_K", None)
        bm = self.config["BLOCK_SIZE_M"]
        # vLLM reads each pair's expert weights straight from its id when T * K * 4 <= E (no alignment at all).
        self.naive = T * K * 4 <= E
        if self.naive:
            self.sorted_ids = None
            self.expert_ids = top_i.flatten().to(torch.int32)
            self.total = torch.full((1,), T * K * bm, dtype=torch.int32, device=hidden.device)
            self.em = T * K * bm
        else:
            self.sorted_ids, self.expert_ids, self.total = align(torch, top_i, E, bm)
            self.em = self.sorted_ids.numel()
            if T < bm:
                self.em = min(self.em, T * K * bm)
        dev, dt = hidden.device, hidden.dtype
        self.cache1 = torch.empty(T, K, N, device=dev, dtype=dt)
        self.cache2 = torch.empty(T * K, N // 2, device=dev, dtype=dt)
        self.cache3 = torch.empty(T, K, H, device=dev, dtype=dt)
        self.out = torch.empty(T, H, device=dev, dtype=dt)
        self.compute_type = tl.bfloat16

    def gemm(self, a, b, c, weighted: bool, top_k: int):
        cfg = self.config
        grid = (self.triton.cdiv(self.em, cfg["BLOCK_SIZE_M"]) * self.triton.cdiv(b.size(1), cfg["BLOCK_SIZE_N"]),)
        self.kernel[grid](
            a, b, c, None, None, None, self.top_w, self.sorted_ids, self.expert_ids, self.total,
            b.size(1), b.size(2), self.em, self.T * self.K,
            a.stride(0), a.stride(1), b.stride(0), b.stride(2), b.stride(1), c.stride(1), c.stride(2),
            0, 0, 0, 0, 0, 0, 0, 0, 0,
            naive_block_assignment=self.naive, MUL_ROUTED_WEIGHT=weighted, top_k=top_k,
            compute_type=self.compute_type, use_fp8_w8a8=False, use_int8_w8a8=False, use_int8_w8a16=False,
            per_channel_quant=False, HAS_BIAS=False, SWAP_AB=False, USE_TD=False, SPLIT_K=1,
            BLOCK_SIZE_K=self.block_k, **cfg)

    def __call__(self):
        self.gemm(self.hidden, self.w1, self.cache1, False, self.K)
        self.silu_and_mul(self.cache1.view(-1, self.N), self.cache2)
        self.gemm(self.cache2, self.w2, self.cache3, True, 1)
        self.torch.sum(self.cache3, dim=1, out=self.out)
        return self.out


def reference(torch, w1, w2, hidden, top_i, top_w):
    """out in float32 from torch's matrix products, expert by expert (the layer's contract, DESIGN §2)."""
    T, K = top_i.shape
    I = w1.shape[1] // 2
    out = torch.zeros(T, w2.shape[1], device=hidden.device, dtype=torch.float32)
    x = hidden.float()
    for e in torch.unique(top_i).tolist():
        t, k = torch.nonzero(top_i == e, as_tuple=True)
        h = x[t] @ w1[e].float().t()
        a = torch.nn.functional.silu(h[:, :I]) * h[:, I:]
        out.index_add_(0, t, (a @ w2[e].float().t()) * top_w[t, k].float()[:, None])
    return out


def errors(torch, got, want) -> tuple[float, float]:
    diff = (got.float() - want)
    rel = (diff.norm() / want.norm().clamp_min(1e-30)).item()
    worst = (diff.norm(dim=1) / want.norm(dim=1).clamp_min(1e-30)).max().item()
    return rel, worst


def time_graph(torch, graph, budget_s: float, max_runs: int) -> dict:
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    start = time.perf_counter()
    while len(times) < max_runs and (len(times) < 20 or time.perf_counter() - start < budget_s):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return {"median_ms": statistics.median(times), "min_ms": min(times), "runs": len(times)}


def bench_vllm_shape(args, torch, triton, tl, kernel, silu_and_mul, shape: str, bandwidth_gbs: float) -> dict:
    H, I, E, K = ct.PRESETS[shape]
    dev = torch.device("cuda")
    ct.log(f"[vllm] {shape}: {E * 3 * H * I * 2 / 1e9:.2f} GB of bf16 weights")
    g = torch.Generator(device=dev)
    g.manual_seed(args.seed)
    w1 = torch.empty(E, 2 * I, H, device=dev, dtype=torch.bfloat16).normal_(0.0, 1.0 / math.sqrt(H), generator=g)
    w2 = torch.empty(E, H, I, device=dev, dtype=torch.bfloat16).normal_(0.0, 1.0 / math.sqrt(I), generator=g)
    results = {}
    for T in args.tokens:
        hidden, top_i, top_w, _ = ct.make_routing(torch, T, E, K, H, dev, args.seed)
        touched = int(torch.unique(top_i).numel())
        floor_bytes, _flops = ct.floor_and_flops(args, H, I, K, T, touched)  # as moekit bench counts them
        floor_ms = floor_bytes / (bandwidth_gbs * 1e9) * 1e3
        config, source = vllm_config(args, torch, T, E, I)
        r = {"tokens": T, "experts_touched": touched, "floor_ms": floor_ms, "config": config, "config_source": source}
        try:
            layer = VllmLayer(torch, triton, tl, kernel, silu_and_mul, w1, w2, hidden, top_i, top_w, config)
            layer()  # compiles the kernels outside the capture
            torch.cuda.synchronize()
            r["rel_l2"], r["worst_token_rel_l2"] = errors(torch, layer.out, reference(torch, w1, w2, hidden, top_i, top_w))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                layer()
            r.update(time_graph(torch, graph, args.max_seconds_per_case, args.max_runs))
            r["status"] = "ok" if r["rel_l2"] <= 2e-2 and r["worst_token_rel_l2"] <= 5e-2 else "wrong"
            r["floor_percent"] = 100.0 * floor_ms / r["median_ms"]
            ct.log(f"[vllm] {shape} T={T}: {r['median_ms']:.4g} ms, {r['floor_percent']:.3g}% of floor, "
                   f"rel. L2 {r['rel_l2']:.2e} (worst token {r['worst_token_rel_l2']:.2e}), {source} {config}")
            del graph, layer
        except Exception as e:  # noqa: BLE001  report and go on with the sweep
            r.update(status="error", reason=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
            ct.log(f"[vllm] {shape} T={T}: {r['reason']}")
        results[T] = r
        torch.cuda.empty_cache()
    del w1, w2
    torch.cuda.empty_cache()
    return results


def build_table(args, shape: str, vllm: dict, mk: dict | None) -> tuple[list[str], list[dict]]:
    H, I, E, K = ct.PRESETS[shape]
    header = ["T", "floor ms"] + [f"moekit {b}" for b in args.backends]
    header += ["moekit best (% of floor)", "vLLM Triton (% of floor)", "vLLM / moekit best", "vLLM / grouped_mm"]
    lines = [f"### {shape} (H={H}, I={I}, E={E}, K={K}), bf16, CUDA graphs, ms (median)", "",
             "| " + " | ".join(header) + " |", "|" + "|".join("---:" for _ in header) + "|"]
    summary = []
    for T in args.tokens:
        v = vllm.get(T, {})
        cells = [str(T), ct.fmt_ms(v.get("floor_ms"))]
        mk_cells, best = ct.backend_cells(args.backends, lambda b: (mk or {}).get((T, b)),
                                          lambda r: ct.fmt_ms(r["median_ms"]))
        cells += mk_cells
        if best:
            pct = best[2].get("floor_percent")
            cells.append(f"{ct.fmt_ms(best[1])} ({best[0]}" + (f", {pct:.0f}%)" if pct else ")"))
        else:
            cells.append("—")
        ok = v.get("status") == "ok"
        cells.append(f"{ct.fmt_ms(v['median_ms'])} ({v['floor_percent']:.0f}%)" if ok else v.get("status", "—"))
        ratio = v["median_ms"] / best[1] if ok and best else None
        cells.append(f"{ratio:.2f}×" if ratio else "—")
        gm = (mk or {}).get((T, "grouped_mm"))
        gm_ratio = v["median_ms"] / gm["median_ms"] if ok and gm and gm.get("median_ms") else None
        cells.append(f"{gm_ratio:.2f}×" if gm_ratio else "—")
        lines.append("| " + " | ".join(cells) + " |")
        summary.append({"tokens": T, "vllm": v, "moekit_best": {"backend": best[0], "median_ms": best[1]} if best else None,
                        "vllm_over_moekit_best": ratio, "vllm_over_grouped_mm": gm_ratio})
    return lines, summary


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    import torch  # noqa: PLC0415  (the yardstick only)
    import triton  # noqa: PLC0415
    import triton.language as tl  # noqa: PLC0415
    if not torch.cuda.is_available():
        ct.log("no CUDA device: vLLM's Triton kernel needs one")
        return 2
    kernel = load_kernel(args.vllm_kernel)
    silu_and_mul = make_silu_and_mul(triton, tl)
    bandwidth = ct.measure_copy_bandwidth(torch, "cuda")
    bw = bandwidth["gb_per_second"]
    ct.log(f"copy bandwidth {bw:.0f} GB/s ({bandwidth['source']}); {torch.cuda.get_device_name()}, "
           f"torch {torch.__version__}, Triton {triton.__version__}")
    report = {"tool": "scripts/compare_vllm.py", "argv": sys.argv[1:], "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "triton": triton.__version__, "bandwidth": bandwidth, "shapes": {}}
    md = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}, copy bandwidth "
          f"{bw:.0f} GB/s; vLLM's kernel from {args.vllm_kernel}", ""]
    workdir = args.out or tempfile.mkdtemp(prefix="compare_vllm_")
    for shape in args.shapes:
        vllm = bench_vllm_shape(args, torch, triton, tl, kernel, silu_and_mul, shape, bw)
        mk = None
        if args.moekit:
            data, err, _cmd = ct.run_moekit(args, shape, bw, workdir)
            if err:
                ct.log(f"[moekit] {shape}: {err}")
            else:
                mk, problems = ct.parse_moekit_rows(data, shape)
                for problem in problems:
                    ct.log(f"[moekit] {problem}")
        lines, summary = build_table(args, shape, vllm, mk)
        md += lines + [""]
        report["shapes"][shape] = summary
        print("\n".join(lines) + "\n", flush=True)
    if args.out:
        with open(os.path.join(args.out, "compare_vllm.md"), "w") as f:
            f.write("\n".join(md) + "\n")
        with open(os.path.join(args.out, "compare_vllm.json"), "w") as f:
            json.dump(report, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
