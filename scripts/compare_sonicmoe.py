#!/usr/bin/env python3
"""Yardstick: time SonicMoE itself (PyPI sonic-moe 0.1.2 on quack-kernels 0.3.11 and nvidia-cutlass-dsl) next to
`moekit bench`, forward and forward + backward, on the GPU.

SonicMoE is measured only, never a dependency of moekit: this script imports it from a folder of wheels
unpacked on the GPU machine (scripts/fetch_sonicmoe_wheels.sh makes it), and nothing else does. It uses the same
shape presets, token counts, bf16 dtype, weight scale, routing (the same seeded draw) and grad_out as
scripts/compare_transformers.py, whose timing, memory and moekit helpers it shares, and prints one markdown
table per shape: SonicMoE's forward and forward + backward beside moekit's best backend of those asked for,
with the ratios.

See docs/compare_transformers.md ("SonicMoE") for how to run it and what it measures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import site
import sys
import tempfile

import compare_transformers as ct  # the same directory: shapes, routing, timing, memory and moekit helpers


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Time SonicMoE's experts forward and forward + backward (sonic-moe's own kernels) on the shapes, "
        "token counts, bf16 dtype and routing `moekit bench` uses, side by side with moekit.")
    p.add_argument("--sonicmoe-site", default=None, metavar="DIR",
                   help="folder holding sonicmoe, quack, cutlass and their dependencies (the unpacked "
                   "sonicmoe-site.tar.xz of scripts/fetch_sonicmoe_wheels.sh); added as a site directory, so that "
                   "nvidia-cutlass-dsl's .pth file takes effect. Without it: whatever python can import")
    p.add_argument("--shapes", default="qwen3-30b-a3b,deepseek-v3", help="comma-separated presets: " +
                   ", ".join(ct.PRESETS) + ", or custom (sizes from --hidden, --intermediate, --experts, --top-k)")
    p.add_argument("--hidden", type=int, default=0, help="H of the custom shape")
    p.add_argument("--intermediate", type=int, default=0, help="I of the custom shape")
    p.add_argument("--experts", type=int, default=0, help="E of the custom shape")
    p.add_argument("--top-k", type=int, default=0, help="K of the custom shape")
    p.add_argument("--tokens", default="4096,16384", help="comma-separated token counts T")
    p.add_argument("--modes", default="forward,backward",
                   help="forward (no_grad, SonicMoE's inference mode) and/or backward (forward + backward)")
    p.add_argument("--moekit", default=None, metavar="PATH",
                   help="moekit binary; runs `PATH bench --device cuda ...` per shape and mode")
    p.add_argument("--moekit-backends", default="grouped_mm,sonicmoe",
                   help="moekit backends to time; the table shows the fastest that ran")
    p.add_argument("--moekit-extra-args", default="", help='string appended to the moekit command, e.g. "--graphs"')
    p.add_argument("--moekit-timeout", type=float, default=0, help="seconds one moekit run may take (0: estimated)")
    p.add_argument("--graphs", action="store_true", help="run moekit with --graphs (SonicMoE runs eagerly)")
    p.add_argument("--out", default=None, metavar="DIR", help="write compare_sonicmoe.json and .md there")
    p.add_argument("--max-seconds-per-case", type=float, default=5.0, help="time budget of one timed case")
    p.add_argument("--max-runs", type=int, default=50, help="at most this many timed runs per case")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights, inputs and routing")
    p.add_argument("--device", default="cuda", help="cuda or cuda:N (SonicMoE needs a Hopper GPU or newer)")
    args = p.parse_args(argv)
    # The shape, token and custom-size checks are compare_transformers.py's own.
    shared = ct.parse_args(["--shapes", args.shapes, "--tokens", args.tokens, "--hidden", str(args.hidden),
                            "--intermediate", str(args.intermediate), "--experts", str(args.experts),
                            "--top-k", str(args.top_k), "--max-seconds-per-case", str(args.max_seconds_per_case)])
    args.shapes, args.tokens, args.sizes = shared.shapes, shared.tokens, shared.sizes
    args.modes = ct.csv_list(args.modes)
    if not args.modes or any(m not in ("forward", "backward") for m in args.modes):
        p.error("--modes takes forward and/or backward")
    args.backends = ct.csv_list(args.moekit_backends)
    if not args.backends:
        p.error("--moekit-backends needs at least one name")
    if not args.device.startswith("cuda"):
        p.error("SonicMoE runs on CUDA only (--device cuda or cuda:N)")
    return args


def import_sonicmoe(site_dir: str | None):
    """torch and SonicMoE's entry point and activation enum; raises with the reason when they cannot be imported."""
    if site_dir:
        if not os.path.isdir(site_dir):
            raise ImportError(f"--sonicmoe-site {site_dir!r} is not a folder (unpack sonicmoe-site.tar.xz there)")
        site.addsitedir(site_dir)  # also runs its .pth files: nvidia-cutlass-dsl puts `cutlass` on the path so
    import torch  # noqa: PLC0415
    import sonicmoe  # noqa: PLC0415  (measured only)
    from sonicmoe.enums import ActivationType  # noqa: PLC0415
    return torch, sonicmoe, ActivationType


def make_weights(torch, E: int, H: int, I: int, device, seed: int):
    """bf16 weights as SonicMoE's own MoE module holds them, [E, out, in], drawn as compare_transformers.py draws
    them (normal, 1/sqrt(fan_in)). The up projection's 2I rows interleave gate and up (g0, u0, g1, u1, ...), SonicMoE's
    default layout (concat_layout=False); the work is the same as moekit's concatenated layout."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    w1 = torch.empty(E, 2 * I, H, device=device, dtype=torch.bfloat16).normal_(0.0, 1.0 / math.sqrt(H), generator=g)
    w2 = torch.empty(E, H, I, device=device, dtype=torch.bfloat16).normal_(0.0, 1.0 / math.sqrt(I), generator=g)
    return w1, w2


def sonicmoe_call(torch, sonicmoe, activation, x, token_idx, expert_idx, scores, w1, w2, E, grad_out, backward):
    """One experts call through sonic-moe's general-routing entry point, the weights passed as its own module passes
    them (permute(1, 2, 0) views: [out, in, E]). Forward: no_grad and its inference mode. Forward + backward: autograd
    to x, the routing scores and both weights, their gradients dropped first as zero_grad(set_to_none=True) does;
    returns (out, grad of x)."""
    def run():
        out, _ = sonicmoe.moe_general_routing_inputs(
            x, scores, token_idx, expert_idx, w1.permute(1, 2, 0), None, w2.permute(1, 2, 0), None, E=E,
            stream_id=None, activation_type=activation.SWIGLU, is_inference_mode_enabled=not backward,
            concat_layout=False)
        return out

    if not backward:
        with torch.no_grad():
            return run(), None
    for t in (x, scores, w1, w2):
        t.grad = None
    out = run()
    out.backward(grad_out)
    return out.detach(), x.grad


def reference_out_and_grad(torch, x, top_i, top_w, w1, w2, grad_out):
    """out and its gradient with respect to x in float32, one expert at a time (gate rows even, up rows odd): a
    check that SonicMoE was called as meant, not a timing."""
    xr = x.detach().float().requires_grad_(True)
    out = torch.zeros_like(xr)
    for e in torch.unique(top_i).tolist():
        token, slot = (top_i == e).nonzero(as_tuple=True)
        z = xr[token] @ w1[e].float().t()
        h = torch.nn.functional.silu(z[:, 0::2]) * z[:, 1::2]
        out = out.index_add(0, token, (h @ w2[e].float().t()) * top_w[token, slot, None].float())
    out.backward(grad_out.float())
    return out.detach(), xr.grad


def bench_sonicmoe_shape(args, sonic, shape: str, bandwidth_gbs: float, backward: bool) -> dict:
    torch, sonicmoe, activation = sonic
    H, I, E, K = args.sizes[shape]
    device = args.torch_device
    clock = ct.Clock(torch, device)
    mode = argparse.Namespace(backward=backward)  # what floor_and_flops reads
    ct.log(f"[sonicmoe] {shape}: allocating {E * 3 * H * I * ct.DTYPE_BYTES / 1e9:.2f} GB of bf16 expert weights ...")
    w1, w2 = make_weights(torch, E, H, I, device, args.seed)
    w1.requires_grad_(backward)
    w2.requires_grad_(backward)
    results = {}
    for T in args.tokens:
        with torch.no_grad():
            x, top_i, top_w, grad_out = ct.make_routing(torch, T, E, K, H, device, args.seed)
            touched = int(torch.unique(top_i).numel())
        # sonic-moe's flattened routing: token ids ascending (it requires them sorted), K slots per token.
        token_idx = torch.arange(T, device=device, dtype=torch.int32).repeat_interleave(K)
        expert_idx = top_i.reshape(-1).to(torch.int32)
        scores = top_w.reshape(-1).clone()
        if backward:
            x.requires_grad_(True)
            scores.requires_grad_(True)
        floor_bytes, flops = ct.floor_and_flops(mode, H, I, K, T, touched)
        r: dict = {"tokens": T, "experts_touched": touched, "flops": flops,
                   "floor_ms": floor_bytes / (bandwidth_gbs * 1e9) * 1e3 if bandwidth_gbs else None}

        def fn():
            return sonicmoe_call(torch, sonicmoe, activation, x, token_idx, expert_idx, scores, w1, w2, E, grad_out,
                                 backward)

        def drop():
            for t in (x, scores, w1, w2):
                t.grad = None

        try:
            out, grad_x = fn()  # the first call compiles SonicMoE's kernels (CuTe DSL): untimed
            if T == args.tokens[0]:  # the smallest T only: the float32 reference loops over experts
                ref_out, ref_grad = reference_out_and_grad(torch, x, top_i, top_w, w1.detach(), w2.detach(), grad_out)
                r["check_vs_float32"] = {
                    "out_rel_l2": ((out.float() - ref_out).norm() / ref_out.norm()).item()}
                if backward:
                    r["check_vs_float32"]["grad_hidden_states_rel_l2"] = (
                        (grad_x.float() - ref_grad).norm() / ref_grad.norm()).item()
            out = grad_x = None
            r.update(status="ok", **ct.time_call(clock, fn, args.max_seconds_per_case, args.max_runs))
            r["tflops"] = flops / (r["median_ms"] * 1e-3) / 1e12
            r["call_memory_bytes"] = ct.call_memory(clock, fn, grad_out.nbytes if backward else 0, drop)
        except torch.OutOfMemoryError as e:
            r.update(status="OOM", reason=str(e).split("\n")[0][:300])
        except Exception as e:  # noqa: BLE001  report and go on with the sweep
            r.update(status="error", reason=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
        finally:
            drop()
        results[T] = r
        if r["status"] == "ok":
            mem = r["call_memory_bytes"]  # None where torch keeps no count (not on a GPU)
            check = r.get("check_vs_float32")
            ct.log(f"[sonicmoe] {shape} T={T} {'forward + backward' if backward else 'forward'}: "
                   f"{r['median_ms']:.4g} ms, {r['tflops']:.3g} TFLOP/s, {ct.fmt_gib(mem)} call memory"
                   + (f", vs float32 {check}" if check else "") + f" ({r['runs']} runs)")
        else:
            ct.log(f"[sonicmoe] {shape} T={T}: {r['status']} {r.get('reason', '')}")
        del x, top_i, top_w, grad_out, token_idx, expert_idx, scores
        clock.empty_cache()
    del w1, w2
    clock.empty_cache()
    return results


def moekit_tflops(row: dict, H: int, I: int, backward: bool) -> float | None:
    """The rate moekit's JSON reports for its mode, or ours from its routed pairs (6 or 18 ·pairs·H·I)."""
    if row.get("flops_per_second"):
        return row["flops_per_second"] / 1e12
    if row.get("routed_pairs") and row.get("median_ms"):
        return (18.0 if backward else 6.0) * row["routed_pairs"] * H * I / (row["median_ms"] * 1e-3) / 1e12
    return None


def build_table(args, shape: str, sonic: dict, mk: dict) -> tuple[list[str], list[dict]]:
    """One row per token count: per mode SonicMoE, moekit's fastest backend, and SonicMoE's time over moekit's."""
    H, I, E, K = args.sizes[shape]
    header = ["tokens"]
    for m in args.modes:
        what = "fwd" if m == "forward" else "fwd+bwd"
        header += [f"SonicMoE {what}", f"moekit {what}", f"SonicMoE / moekit {what}"]
        if m == "backward":
            header += ["memory SonicMoE / moekit"]
    lines = [f"### {shape} (H={H}, I={I}, E={E}, K={K}), bf16: ms (median) · TFLOP/s · call memory", "",
             "| " + " | ".join(header) + " |", "|" + "|".join("---:" for _ in header) + "|"]
    summary = []

    def cell(ms, tflops, mem) -> str:
        return " · ".join([ct.fmt_ms(ms), f"{tflops:.3g} TF/s" if tflops else "—", ct.fmt_gib(mem)])

    for T in args.tokens:
        cells, row = [str(T)], {"tokens": T}
        for m in args.modes:
            s = (sonic.get(m) or {}).get(T)
            rows = mk.get(m)
            best = None
            if rows:
                _, best = ct.backend_cells(args.backends, lambda b: rows.get((T, b)), lambda r: "")
            if s is None:
                cells.append("—")
            elif s["status"] == "ok":
                cells.append(cell(s["median_ms"], s["tflops"], s.get("call_memory_bytes")))
            else:
                cells.append(s["status"])
            if best:
                b, ms, r = best
                cells.append(f"{b}: " + cell(ms, moekit_tflops(r, H, I, m == "backward"), r.get("call_memory_bytes")))
            else:
                cells.append("—")
            ok = s is not None and s["status"] == "ok" and best
            ratio = s["median_ms"] / best[1] if ok else None
            cells.append(f"{ratio:.2f}x" if ratio else "—")
            row[m] = {"sonicmoe_ms": s["median_ms"] if ok else None, "moekit_best": best[0] if best else None,
                      "moekit_ms": best[1] if best else None, "sonicmoe_over_moekit": ratio}
            if m == "backward":
                mem = (s["call_memory_bytes"] / best[2]["call_memory_bytes"]
                       if ok and s.get("call_memory_bytes") and best[2].get("call_memory_bytes") else None)
                cells.append(f"{mem:.2f}x" if mem else "—")
                row[m]["memory_sonicmoe_over_moekit"] = mem
        lines.append("| " + " | ".join(cells) + " |")
        summary.append(row)
    return lines, summary


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    report: dict = {"tool": "scripts/compare_sonicmoe.py", "argv": sys.argv[1:], "options": dict(vars(args)),
                    "shapes": {}, "notes": []}
    sonic = None
    try:
        sonic = import_sonicmoe(args.sonicmoe_site)
        torch = sonic[0]
        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device")
        dev = torch.device(args.device)
        dev = torch.device("cuda", torch.cuda.current_device()) if dev.index is None else dev
        torch.cuda.set_device(dev)
        args.torch_device = dev
        props = torch.cuda.get_device_properties(dev)
        if props.major < 9:
            raise RuntimeError(f"SonicMoE needs compute capability 9.0 or newer; {props.name} is {props.major}.{props.minor}")
        report["machine"] = {"gpu": props.name, "torch": torch.__version__, "cuda": torch.version.cuda,
                             "sonicmoe": getattr(sonic[1], "__version__", "?"), "sonicmoe_file": sonic[1].__file__}
        ct.log(f"[sonicmoe] {props.name}, torch {torch.__version__}, sonic-moe {report['machine']['sonicmoe']}")
        report["copy_bandwidth"] = ct.measure_copy_bandwidth(torch, dev)
    except Exception as e:  # noqa: BLE001  the moekit columns can still be shown
        msg = f"SonicMoE side unavailable ({type(e).__name__}: {e}); its columns are empty"
        ct.log(msg)
        report["notes"].append(msg)
        sonic = None
    bw_gbs = report.get("copy_bandwidth", {}).get("gb_per_second", 0.0)

    md = ["# SonicMoE vs moekit", ""]
    if "machine" in report:
        m = report["machine"]
        md.append(f"{m['gpu']}; torch {m['torch']}, sonic-moe {m['sonicmoe']} (its default configuration, not "
                  f"autotuned); copy bandwidth {bw_gbs:.0f} GB/s.")
    md.append("SonicMoE: `moe_general_routing_inputs` with the weights as its own module passes them, interleaved "
              "gate/up, SwiGLU, no bias; forward under no_grad in its inference mode, forward + backward with "
              "autograd to x, the routing scores and both weights. moekit: `moekit bench`, the fastest of "
              f"{', '.join(args.backends)}" + (" with --graphs" if args.graphs else "") + ". Same shapes, tokens, "
              "routing distribution and grad_out as scripts/compare_transformers.py; TFLOP/s over 6 (forward) or 18 "
              "(forward + backward) ·pairs·H·I; call memory as compare_transformers.py counts it; SonicMoE / moekit "
              "above 1x means moekit is faster.")
    md.append("")
    workdir = args.out or tempfile.mkdtemp(prefix="compare_sonicmoe_")
    for shape in args.shapes:
        entry: dict = {"preset": dict(zip(("hidden", "intermediate", "experts", "top_k"), args.sizes[shape])),
                       "sonicmoe": {}, "moekit": {}}
        mk: dict = {}
        for mode in args.modes:
            backward = mode == "backward"
            if args.moekit:
                margs = argparse.Namespace(**{**vars(args), "backward": backward})
                data, err, cmd = ct.run_moekit(margs, shape, bw_gbs, workdir)
                # run_moekit writes moekit-<shape>.json; keep each mode's under its own name.
                if data is not None:
                    os.replace(os.path.join(workdir, f"moekit-{shape}.json"),
                               os.path.join(workdir, f"moekit-{shape}-{mode}.json"))
                entry["moekit"][mode] = {"command": shlex.join(cmd) if cmd else None, "error": err}
                if err:
                    report["notes"].append(f"{shape} {mode}: moekit: {err}")
                else:
                    rows, problems = ct.parse_moekit_rows(data, shape)
                    mk[mode] = rows
                    entry["moekit"][mode]["rows"] = [r["raw"] for r in rows.values()]
                    entry["moekit"][mode]["schema_problems"] = problems
            if sonic:
                entry["sonicmoe"][mode] = bench_sonicmoe_shape(args, sonic, shape, bw_gbs, backward)
        lines, summary = build_table(args, shape, entry["sonicmoe"], mk)
        entry["summary"] = summary
        report["shapes"][shape] = entry
        md += lines + [""]
        reasons = [f"- moekit {b} T={T} ({mode}): {r['status']}: {r['reason']}" for mode, rows in mk.items()
                   for (T, b), r in sorted(rows.items()) if r["status"] != "ok" and r.get("reason")]
        md += reasons + ([""] if reasons else [])
    if report["notes"]:
        md += ["Notes:"] + [f"- {n}" for n in report["notes"]] + [""]
    text = "\n".join(md)
    print(text)
    if args.out:
        with open(os.path.join(args.out, "compare_sonicmoe.md"), "w") as f:
            f.write(text + "\n")
        with open(os.path.join(args.out, "compare_sonicmoe.json"), "w") as f:
            json.dump(report, f, indent=2, default=str)
        ct.log(f"wrote {os.path.join(args.out, 'compare_sonicmoe.md')} and compare_sonicmoe.json")
    return 0 if sonic else 1  # without SonicMoE there is nothing to compare with


if __name__ == "__main__":
    sys.exit(main())
