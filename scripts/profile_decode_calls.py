#!/usr/bin/env python3
"""Where a decode step's time goes, per experts call, inside transformers' generate(): the host time of each
experts function call (the adapter transformers calls, and within it moekit.torch.experts), timed with
perf_counter around the call without synchronising, next to the step time, for moekit_grouped_mm,
transformers' batched_mm and no experts. The model is scripts/bench_transformers.py's.

  python3 scripts/profile_decode_calls.py [--batch 1] [--new-tokens 32]      # the H200, installed wheel
  scripts/python.sh scripts/profile_decode_calls.py --device cpu --tiny       # a smoke run
"""
import argparse
import statistics
import sys
import time

import torch

sys.path.insert(0, __import__("os").path.dirname(__file__))
import bench_transformers as bt  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="bench_transformers.py's tiny model: checks the script")
    args = p.parse_args()
    import moekit.torch
    import moekit.transformers  # noqa: F401
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(bt.NO_EXPERTS_IMPLEMENTATION, lambda self, hidden_states, *_: torch.zeros_like(hidden_states))
    device = torch.device(args.device)
    model, config = bt.build_model(bt.parse_args(["--tiny"] if args.tiny else ["--layers", "4"]), device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    ids = torch.randint(3, config.vocab_size, (args.batch, 8 if args.tiny else 64), device=device)
    mask = torch.ones_like(ids)
    mapping = ExpertsInterface._global_mapping
    real_op = moekit.torch.experts
    for name in ("moekit_grouped_mm", "batched_mm", bt.NO_EXPERTS_IMPLEMENTATION, "moekit_grouped_mm"):
        calls, ops = [], []
        real = mapping[name]

        def timed(self, *a, real=real):
            t = time.perf_counter()
            out = real(self, *a)
            calls.append(time.perf_counter() - t)
            return out

        def timed_op(*a, **k):
            t = time.perf_counter()
            out = real_op(*a, **k)
            ops.append(time.perf_counter() - t)
            return out

        mapping[name] = timed
        moekit.torch.experts = timed_op
        model.set_experts_implementation(name)
        try:
            with torch.no_grad():
                run = lambda n: model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                               do_sample=False, pad_token_id=0)
                for _ in range(2):
                    run(args.new_tokens)
                times = {}
                for n in (1, args.new_tokens):
                    samples = []
                    for _ in range(3):
                        sync()
                        t = time.perf_counter()
                        run(n)
                        sync()
                        samples.append(time.perf_counter() - t)
                    times[n] = statistics.median(samples)
                calls.clear()
                ops.clear()
                run(args.new_tokens)
        finally:
            mapping[name] = real
            moekit.torch.experts = real_op
        step_ms = (times[args.new_tokens] - times[1]) / (args.new_tokens - 1) * 1e3
        decode_calls = calls[config.num_hidden_layers:]  # after the prefill's
        print(f"{name:22s} decode step {step_ms:6.2f} ms; experts function host time per call: median "
              f"{statistics.median(decode_calls) * 1e6:6.1f} µs, mean {statistics.mean(decode_calls) * 1e6:6.1f} µs"
              + (f"; moekit.torch.experts median {statistics.median(ops[config.num_hidden_layers:]) * 1e6:6.1f} µs"
                 if ops else ""), flush=True)


if __name__ == "__main__":
    main()
