#!/usr/bin/env python3
"""Prefill and decode tokens/s of the model runtime, moekit next to transformers on the same random
checkpoint, the same prompt and the same machine, in one run.

  scripts/reference_python.sh scripts/bench_model.py --moekit build/moekit            # CPU, here
  python3 scripts/bench_model.py --moekit gpu-bundle/moekit --device cuda              # GPU machine

The checkpoint is `moekit make-model --preset PRESET --layers N` (a random qwen3_moe in transformers'
own layout), written once into --model-dir. For each experts backend, moekit runs
`moekit generate --prompt-tokens ... --max-new-tokens N --ignore-eos` and reports its own prefill and
decode times; transformers loads the same directory with from_pretrained(dtype=bfloat16,
experts_implementation=backend) and is timed the same way: prefill = one forward over the prompt,
decode = (generate(N new tokens) - prefill) / (N - 1). Medians of --repeats runs, each side after one
untimed generation (moekit: --warmup 1), so one-time work (packing weights, first allocations) is out. transformers is the
yardstick only, never a dependency of moekit.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time


def run_moekit(args, backend, prompt, decode_switch=True):
    command = [args.moekit, "generate", "--model", args.model_dir, "--prompt-tokens", ",".join(map(str, prompt)),
               "--max-new-tokens", str(args.new_tokens), "--experts-implementation", backend, "--raw",
               "--ignore-eos", "--device", args.device, "--warmup", "1"] + ([] if decode_switch else ["--no-decode-switch"])
    prefill, decode = [], []
    for _ in range(args.repeats):
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            return None, None, done.stderr.strip().splitlines()[-1]
        p = re.search(r"prefill: (\d+) tokens in ([\d.]+) s", done.stderr)
        d = re.search(r"decode:  (\d+) tokens in ([\d.]+) s", done.stderr)
        prefill.append(int(p.group(1)) / float(p.group(2)))
        decode.append(int(d.group(1)) / float(d.group(2)))
    return statistics.median(prefill), statistics.median(decode), ""


def run_transformers(args, backend, prompt):
    import torch
    from transformers import AutoModelForCausalLM

    device = "cuda" if args.device.startswith("cuda") else "cpu"
    try:
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.bfloat16,
                                                     experts_implementation=backend).to(device).eval()
    except Exception as e:  # an experts backend transformers cannot run here
        return None, None, f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
    ids = torch.tensor([prompt], device=device)

    def timed(fn):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    prefill, decode = [], []
    try:
        with torch.no_grad():
            # Warm-up of both timed calls, as moekit's --warmup 1: one-time work stays out of the timings.
            # The prefill forward keeps the last position's logits only, as generate's prefill does (and as
            # moekit's prefill computes).
            prefill_forward = lambda: model(ids, logits_to_keep=1)
            prefill_forward()
            model.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                           pad_token_id=0)
            for _ in range(args.repeats):
                t_prefill = timed(prefill_forward)
                t_generate = timed(lambda: model.generate(ids, max_new_tokens=args.new_tokens,
                                                          min_new_tokens=args.new_tokens, do_sample=False,
                                                          pad_token_id=0))
                prefill.append(len(prompt) / t_prefill)
                if t_generate <= t_prefill:  # a noisy machine: the difference measures nothing
                    return None, None, f"generate ({t_generate:.3f} s) took less than prefill ({t_prefill:.3f} s)"
                decode.append((args.new_tokens - 1) / (t_generate - t_prefill))
    except Exception as e:  # out of memory, say
        return None, None, f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
    finally:
        del model
    return statistics.median(prefill), statistics.median(decode), ""


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--moekit", required=True, help="the moekit binary")
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--model-dir", default="/tmp/moekit-bench-model")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backends", default="eager,batched_mm,grouped_mm")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    if not os.path.exists(os.path.join(args.model_dir, "model.safetensors")):
        subprocess.run([args.moekit, "make-model", "--preset", args.preset, "--layers", str(args.layers),
                        "--out", args.model_dir], check=True)
    with open(os.path.join(args.model_dir, "config.json")) as f:
        config = json.load(f)
    prompt = [(7 + 31 * i) % 250 for i in range(args.prompt_len)]
    print(f"model: {args.model_dir} ({config['model_type']}, {config['num_hidden_layers']} layers, hidden "
          f"{config['hidden_size']}, {config['num_experts']} experts top-{config['num_experts_per_tok']}, bf16), "
          f"prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, device {args.device}, "
          f"median of {args.repeats}", flush=True)
    # All moekit runs first, then transformers: the Python process keeps the memory of the models it
    # loaded, which would otherwise crowd out moekit's memory-mapped checkpoint on a small machine.
    on_gpu = args.device.startswith("cuda")
    backends = args.backends.split(",")
    ours, ours_unswitched = {}, {}
    for backend in backends:
        ours[backend] = run_moekit(args, backend, prompt)
        if backend == "grouped_mm" and on_gpu:
            # On a GPU moekit decodes grouped_mm models with batched_mm; this row keeps grouped_mm.
            ours_unswitched[backend] = run_moekit(args, backend, prompt, decode_switch=False)
        print(f"  moekit {backend}: done", file=sys.stderr, flush=True)
    rows = []
    for backend in backends:
        theirs = (None, None, "skipped") if args.skip_transformers else run_transformers(args, backend, prompt)
        print(f"  transformers {backend}: done", file=sys.stderr, flush=True)
        label = backend + (" (decode switch)" if backend in ours_unswitched else "")
        for name, result in [(label, ours[backend])] + (
                [(backend + " (no decode switch)", ours_unswitched[backend])] if backend in ours_unswitched else []):
            rows.append({"backend": name, "moekit_prefill": result[0], "moekit_decode": result[1],
                         "moekit_error": result[2], "hf_prefill": theirs[0], "hf_decode": theirs[1],
                         "hf_error": theirs[2]})

    def cell(v):
        return f"{v:.1f}" if v is not None else "—"

    def ratio(a, b):
        return f"{a / b:.2f}x" if a is not None and b is not None else "—"

    best_hf_prefill = max((r["hf_prefill"] for r in rows if r["hf_prefill"]), default=None)
    best_hf_decode = max((r["hf_decode"] for r in rows if r["hf_decode"]), default=None)
    print("\n| experts backend | moekit prefill tok/s | HF prefill tok/s | ratio | moekit decode tok/s | "
          "HF decode tok/s | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['backend']} | {cell(r['moekit_prefill'])} | {cell(r['hf_prefill'])} | "
              f"{ratio(r['moekit_prefill'], r['hf_prefill'])} | {cell(r['moekit_decode'])} | {cell(r['hf_decode'])} | "
              f"{ratio(r['moekit_decode'], r['hf_decode'])} |")
    for r in rows:
        for side in ("moekit", "hf"):
            if r[f"{side}_error"] and r[f"{side}_error"] != "skipped":
                print(f"  {side} {r['backend']}: {r[side + '_error']}")
    print(f"\nbest transformers backend: prefill {cell(best_hf_prefill)} tok/s, decode {cell(best_hf_decode)} tok/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
