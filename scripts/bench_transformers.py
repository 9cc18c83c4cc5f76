#!/usr/bin/env python3
"""transformers with moekit's experts backends next to transformers' own, on one random
Qwen3-30B-A3B-shaped model, in one run: prefill tokens/s, decode tokens/s through generate(), the time of
one training step, and the per-call cost of moekit.torch.experts at 1 token.

  python3 scripts/bench_transformers.py --out bench-results/transformers.json        # the H200, installed wheel
  scripts/python.sh scripts/bench_transformers.py --device cpu --tiny                # a smoke run, here

The model: Qwen3-30B-A3B's sizes (the preset of scripts/bench_model.py / `moekit make-model --preset
qwen3-30b-a3b`: hidden 2048, 32 heads of 128 with 4 KV heads, 128 experts top-8, expert intermediate 768,
vocab 151936, softmax top-k with renormalisation), built in transformers with from_config on the device in
bf16 with transformers' random initialisation, --layers layers (default 4; the real model has 48, so
the experts are a larger share of the real model's time than of this one's lm_head-heavy copy). One model
serves every backend: set_experts_implementation switches between them.

For each experts backend, after warm-up (medians of --repeats, CUDA events; --rounds rounds over the backends
in turn, the median over rounds in the table):
  prefill    one forward over a 1 x --prompt-len prompt, logits of the last position only (as generate's
             prefill), tokens/s
  decode     generate(--new-tokens new tokens, greedy) from a batch x --decode-prompt-len prompt:
             batch * (new - 1) / (t_generate - t_prefill of that prompt), tokens/s, for each --decode-batches
  compiled decode (the backends of --compiled-decode) generate() with a static cache, which it compiles
             for the decode steps (torch.compile, reduce-overhead: CUDA graphs; eager on a CPU):
             batch * (new - 1) / (t_generate(new) - t_generate(1)), tokens/s
  train      forward + backward (cross-entropy on the batch itself) + AdamW step on --train-batch x
             --train-len tokens, seconds
On a GPU transformers' generate() switches a model loaded with "grouped_mm" (that exact name) to
"batched_mm" for the decode phase; the row says so. moekit_* names are not switched. The last row,
"grouped_mm -> moekit", is transformers' grouped_mm name after moekit.transformers.register(
override_builtin=True): the same switch, on moekit's kernels. The row "no experts" replaces the experts by
zeros: the time of everything else (attention, router, lm_head, generate's own work), which bounds what any
experts backend can gain on this model. One untimed round of prefills and a training step runs first.

The experts-call table times one layer's moekit.torch.experts at 1 token (decode), in a Python loop
(what each call costs the caller), through the transformers adapter (the function transformers calls),
and replayed from a CUDA graph (the kernels alone: the C++ library's time without Python): the
difference is the per-call overhead of the bridge.
transformers is the yardstick only, never a dependency of the moekit library.
"""
import argparse
import gc
import json
import math
import statistics
import sys
import time

MOEKIT_BACKENDS = ("moekit_grouped_mm", "moekit_batched_mm", "moekit_deepgemm", "moekit_sonicmoe")
TRANSFORMERS_BACKENDS = ("grouped_mm", "batched_mm")
OVERRIDDEN = "grouped_mm -> moekit"  # transformers' grouped_mm name bound to moekit (override_builtin)
# The experts replaced by zeros: what the rest of the model (attention, norms, router, lm_head, generate's
# own work) costs, the floor under every row.
NO_EXPERTS = "no experts"
NO_EXPERTS_IMPLEMENTATION = "bench_no_experts"
# transformers' batched_mm gathers the chosen experts' weights per (token, expert) pair; past this many
# bytes a run is refused up front instead of running the GPU out of memory.
BATCHED_MM_COPY_LIMIT = 64 << 30

QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                     num_experts_per_tok=8, rope_theta=1e6, max_position_embeddings=32768)
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, rope_theta=1e4,
            max_position_embeddings=512)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (the H200) or cpu (a smoke run)")
    p.add_argument("--tiny", action="store_true", help="a tiny model and tiny sizes: checks the script, measures nothing")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 4; --tiny: 2)")
    p.add_argument("--prompt-len", type=int, default=None, help="prefill prompt length (default 2048)")
    p.add_argument("--decode-prompt-len", type=int, default=None, help="prompt length before decoding (default 64)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens generated per decode run (default 32)")
    p.add_argument("--decode-batches", default=None, help="decode batch sizes (default 1,8)")
    p.add_argument("--train-batch", type=int, default=None, help="training sequences per step (default 4)")
    p.add_argument("--train-len", type=int, default=None, help="tokens per training sequence (default 512)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per measurement, median (default 3)")
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds over every backend, each backend measured once per round; the table holds the "
                        "median over rounds (default 3), so that drift of the machine spreads over every row")
    p.add_argument("--calls", type=int, default=200, help="calls per loop of the experts-call table")
    p.add_argument("--backends", default=",".join(MOEKIT_BACKENDS + TRANSFORMERS_BACKENDS + (OVERRIDDEN, NO_EXPERTS)),
                   help="experts implementations, in order")
    p.add_argument("--compiled-decode", default="",
                   help="backends whose decode is also timed with a static cache, which generate() compiles "
                        "(torch.compile, mode reduce-overhead: CUDA graphs), e.g. moekit_grouped_mm,grouped_mm")
    p.add_argument("--no-train", action="store_true", help="skip the training step")
    p.add_argument("--max-seconds", type=float, default=220.0,
                   help="time budget: measurements that would start after it are skipped (and say so)")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    defaults = (dict(layers=2, prompt_len=32, decode_prompt_len=8, new_tokens=4, decode_batches="1,2", train_batch=2,
                     train_len=16, repeats=1, rounds=1) if args.tiny else
                dict(layers=4, prompt_len=2048, decode_prompt_len=64, new_tokens=32, decode_batches="1,8",
                     train_batch=4, train_len=512, repeats=3, rounds=3))
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.decode_batches = [int(b) for b in args.decode_batches.split(",") if b]
    args.backends = [b for b in args.backends.split(",") if b]
    args.compiled_decode = [b for b in args.compiled_decode.split(",") if b]
    if args.new_tokens < 2:
        p.error("--new-tokens must be at least 2 (decode time is generate minus prefill)")
    return args


class Budget:
    def __init__(self, seconds):
        self.start, self.seconds = time.perf_counter(), seconds

    def left(self):
        return self.seconds - (time.perf_counter() - self.start)


class Timer:
    """Seconds of fn(): CUDA events on a GPU (the whole device timeline between them, host waits
    included, as generate synchronises), perf_counter on the CPU."""

    def __init__(self, device):
        import torch

        self.torch, self.cuda = torch, device.type == "cuda"

    def __call__(self, fn):
        torch = self.torch
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    def median(self, fn, repeats, warmup=1):
        for _ in range(warmup):
            fn()
        return statistics.median(self(fn) for _ in range(repeats))


def short_error(e):
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:240] if text else ''}"


def build_model(args, device):
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    shape = dict(TINY if args.tiny else QWEN3_30B_A3B)
    rope_theta = shape.pop("rope_theta")
    config = Qwen3MoeConfig(**shape, num_hidden_layers=args.layers, norm_topk_prob=True, decoder_sparse_step=1,
                            mlp_only_layers=[], rope_parameters=dict(rope_type="default", rope_theta=rope_theta),
                            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config.pad_token_id = 0
    return model.eval(), config


def warm_up(args, model, config, device):
    """Untimed work before the first row, so that it does not pay for the process's first CUDA calls
    (library handles, the caching allocator's first blocks) and the GPU's clocks are up."""
    import torch

    model.set_experts_implementation("grouped_mm")
    ids = torch.randint(3, config.vocab_size, (1, args.prompt_len), device=device)
    with torch.no_grad():
        for _ in range(3):
            model(ids, logits_to_keep=1)
    if not args.no_train:
        model.train()
        model(input_ids=ids[:, : args.train_len], labels=ids[:, : args.train_len]).loss.backward()
        model.zero_grad(set_to_none=True)
        model.eval()
    if device.type == "cuda":
        torch.cuda.synchronize()


def batched_mm_copy_bytes(config, tokens):
    return tokens * config.num_experts_per_tok * 3 * config.moe_intermediate_size * config.hidden_size * 2


def measure_backend(args, model, config, label, device, timer, budget):
    """One row: prefill, decode per batch size, training step; each an error text where it cannot run."""
    import torch

    row = {"backend": label, "prefill_tok_s": None, "decode_tok_s": {}, "compiled_decode_tok_s": {},
           "train_step_s": None, "errors": {}}
    implementation = {OVERRIDDEN: "grouped_mm", NO_EXPERTS: NO_EXPERTS_IMPLEMENTATION}.get(label, label)
    try:
        model.set_experts_implementation(implementation)
        with torch.no_grad():  # one tiny forward: a backend that cannot run says so here
            model(torch.ones(1, 4, dtype=torch.long, device=device))
    except Exception as e:
        row["errors"]["all"] = short_error(e)
        return row
    g = torch.Generator().manual_seed(1)

    def tokens(batch, length):
        return torch.randint(3, config.vocab_size, (batch, length), generator=g).to(device)

    def refused(tokens_in_call):
        if implementation == "batched_mm" and batched_mm_copy_bytes(config, tokens_in_call) > BATCHED_MM_COPY_LIMIT:
            gib = batched_mm_copy_bytes(config, tokens_in_call) / 2**30
            return f"skipped: transformers' batched_mm would copy {gib:.0f} GiB of expert weights per layer"
        return None

    def measure(key, fn):
        if budget.left() <= 0:
            row["errors"][key] = "skipped: --max-seconds spent"
            return None
        try:
            return fn()
        except Exception as e:
            row["errors"][key] = short_error(e)
            return None
        finally:
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()

    def prefill():
        ids = tokens(1, args.prompt_len)
        with torch.no_grad():
            return args.prompt_len / timer.median(lambda: model(ids, logits_to_keep=1), args.repeats)

    if (why := refused(args.prompt_len)) is None:
        row["prefill_tok_s"] = measure("prefill", prefill)
    else:
        row["errors"]["prefill"] = why

    for batch in args.decode_batches:
        def decode(batch=batch):
            ids = tokens(batch, args.decode_prompt_len)
            mask = torch.ones_like(ids)
            run = lambda: model.generate(ids, attention_mask=mask, max_new_tokens=args.new_tokens,
                                         min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
            with torch.no_grad():
                t_prefill = timer.median(lambda: model(ids, attention_mask=mask, logits_to_keep=1), args.repeats)
                t_generate = timer.median(run, args.repeats)
            if t_generate <= t_prefill:
                raise RuntimeError(f"generate ({t_generate:.4f} s) took less than its prefill ({t_prefill:.4f} s)")
            return batch * (args.new_tokens - 1) / (t_generate - t_prefill)

        if (why := refused(batch * args.decode_prompt_len)) is None:
            row["decode_tok_s"][str(batch)] = measure(f"decode_b{batch}", decode)
        else:
            row["errors"][f"decode_b{batch}"] = why

    if label in args.compiled_decode:
        for batch in args.decode_batches:
            def compiled_decode(batch=batch):
                # A static cache makes generate() compile the decode step (reduce-overhead: CUDA graphs); the
                # prefill stays eager. Decode time: generating new tokens minus generating one (the prefill
                # and its first token), both with the static cache; the untimed runs compile and record.
                ids = tokens(batch, args.decode_prompt_len)
                mask = torch.ones_like(ids)
                run = lambda new: model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                                 do_sample=False, pad_token_id=0, cache_implementation="static")
                with torch.no_grad():
                    t_one = timer.median(lambda: run(1), args.repeats, warmup=2)
                    t_all = timer.median(lambda: run(args.new_tokens), args.repeats, warmup=3)
                if t_all <= t_one:
                    raise RuntimeError(f"generate ({t_all:.4f} s) took less than its prefill ({t_one:.4f} s)")
                return batch * (args.new_tokens - 1) / (t_all - t_one)

            row["compiled_decode_tok_s"][str(batch)] = measure(f"compiled_decode_b{batch}", compiled_decode)

    if not args.no_train:
        def train():
            ids = tokens(args.train_batch, args.train_len)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)

            def step():
                optimizer.zero_grad(set_to_none=True)
                model(input_ids=ids, labels=ids).loss.backward()
                optimizer.step()

            model.train()
            try:
                return timer.median(step, args.repeats, warmup=2)  # the first step allocates AdamW's state
            finally:
                model.eval()
                optimizer.zero_grad(set_to_none=True)
                del optimizer

        if (why := refused(args.train_batch * args.train_len)) is None:
            row["train_step_s"] = measure("train", train)
        else:
            row["errors"]["train"] = why
    return row


def measure_call_overhead(args, model, config, device, budget):
    """One layer's experts at 1 token: a Python loop of moekit.torch.experts calls, the same through the
    transformers adapter, and (CUDA) a CUDA graph replaying the calls: the kernels' time alone."""
    import torch
    import moekit
    import moekit.torch
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    experts = model.model.layers[0].mlp.experts
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, config.hidden_size, generator=g).to(device, torch.bfloat16)
    idx = torch.randperm(config.num_experts, generator=g)[: config.num_experts_per_tok][None].to(device)
    w = torch.rand(1, config.num_experts_per_tok, generator=g).softmax(-1).to(device)
    n = args.calls
    cuda = device.type == "cuda"

    def per_call(fn):
        for _ in range(10):
            fn()
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - t) / n

    def graph_per_call(fn, captured=20, replays=20):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(captured):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / (captured * replays)

    def c_call(backend):
        # The C ABI's forward alone, its problem packed once: the library's host time (conversion, checks,
        # launches) without the op's Python. Uses the package's internals, which only this table needs.
        import moekit._capi as capi
        import moekit.torch as mt

        out = torch.empty_like(x)
        tensors = (x, idx, w, experts.gate_up_proj, experts.down_proj, None, None, None, None)
        config = ("silu", True, False, True, 1.702, None, "none")
        problem, views = mt._problem(tensors, config)
        name = backend.encode()
        nbytes = capi.experts_workspace_bytes(problem, name, False)
        workspace = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
        out_view = mt._view(out, "out")
        stream = torch.cuda.current_stream(device).cuda_stream if cuda else 0
        # The views hold bare addresses: out and workspace must live as long as the function.
        def call(out=out, workspace=workspace):
            capi.experts_forward(problem, name, out_view, workspace.data_ptr() if nbytes else 0, nbytes, stream)

        return call

    rows = []
    for backend in ("batched_mm", "grouped_mm", "deepgemm", "sonicmoe"):
        row = {"backend": backend, "c_loop_us": None, "op_loop_us": None, "adapter_loop_us": None, "graph_us": None,
               "error": ""}
        rows.append(row)
        if budget.left() <= 0:
            row["error"] = "skipped: --max-seconds spent"
            continue
        op = lambda: moekit.torch.experts(x, idx, w, experts.gate_up_proj, experts.down_proj, backend=backend)
        adapter = lambda: ALL_EXPERTS_FUNCTIONS[f"moekit_{backend}"](experts, x, idx, w)
        try:
            with torch.no_grad():
                row["c_loop_us"] = per_call(c_call(backend)) * 1e6
                row["op_loop_us"] = per_call(op) * 1e6
                row["adapter_loop_us"] = per_call(adapter) * 1e6
                if cuda:
                    row["graph_us"] = graph_per_call(op) * 1e6
        except Exception as e:
            row["error"] = short_error(e)
    # transformers' own batched_mm (its decode backend) on the same call, for scale.
    row = {"backend": "transformers batched_mm", "c_loop_us": None, "op_loop_us": None, "adapter_loop_us": None,
           "graph_us": None, "error": ""}
    try:
        with torch.no_grad():
            row["adapter_loop_us"] = per_call(lambda: ALL_EXPERTS_FUNCTIONS["batched_mm"](experts, x, idx, w)) * 1e6
    except Exception as e:
        row["error"] = short_error(e)
    rows.append(row)
    return rows


def median_row(rows):
    """One backend's rounds as one row: the median of each measurement over the rounds that made it, the
    errors of every round."""
    def median(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    row = {"backend": rows[0]["backend"], "prefill_tok_s": median(r["prefill_tok_s"] for r in rows),
           "train_step_s": median(r["train_step_s"] for r in rows), "errors": {}}
    for key in ("decode_tok_s", "compiled_decode_tok_s"):
        batches = {b for r in rows for b in r[key]}
        row[key] = {b: median(r[key].get(b) for r in rows) for b in sorted(batches, key=int)}
    for r in rows:
        for k, v in r["errors"].items():
            row["errors"].setdefault(k, v)
    return row


def fmt(v, digits=1):
    return "—" if v is None else f"{v:.{digits}f}"


def ratio(ours, best, higher_is_better=True):
    if ours is None or best is None:
        return "—"
    return f"{(ours / best if higher_is_better else best / ours):.2f}x"


def print_tables(result, args):
    rows = result["rows"]
    builtin = [r for r in rows if r["backend"] in TRANSFORMERS_BACKENDS]

    def best(values, higher_is_better=True):
        values = [v for v in values if v is not None]
        return (max(values) if higher_is_better else min(values)) if values else None

    best_prefill = best(r["prefill_tok_s"] for r in builtin)
    best_decode = {b: best(r["decode_tok_s"].get(str(b)) for r in builtin) for b in args.decode_batches}
    best_train = best((r["train_step_s"] for r in builtin), higher_is_better=False)
    m = result["model"]
    print(f"\nmodel: Qwen3-30B-A3B-shaped qwen3_moe{' (tiny)' if args.tiny else ''}, {m['layers']} layers, hidden "
          f"{m['hidden_size']}, {m['num_experts']} experts top-{m['top_k']}, I {m['moe_intermediate_size']}, vocab "
          f"{m['vocab_size']}, bf16, {result['environment']['device']}; prefill 1x{args.prompt_len}, decode "
          f"{args.new_tokens} new tokens after {args.decode_prompt_len}, train {args.train_batch}x{args.train_len} "
          f"(AdamW); each cell the median over {args.rounds} rounds of the median of {args.repeats}; ratios: to transformers' best built-in backend (of "
          f"{', '.join(TRANSFORMERS_BACKENDS)}) in the same column")
    head = ["experts backend", "prefill tok/s", "ratio"]
    for b in args.decode_batches:
        head += [f"decode b{b} tok/s", "ratio"]
    head += ["train step ms", "ratio"]
    print("\n| " + " | ".join(head) + " |\n|" + " --- |" * len(head))
    switched = result["environment"]["device_type"] != "cpu"
    for r in rows:
        label = r["backend"] + (" (decode: batched_mm)" if switched and r["backend"] in ("grouped_mm", OVERRIDDEN)
                                else " (the rest of the model: a floor)" if r["backend"] == NO_EXPERTS else "")
        cells = [label, fmt(r["prefill_tok_s"]), ratio(r["prefill_tok_s"], best_prefill)]
        for b in args.decode_batches:
            v = r["decode_tok_s"].get(str(b))
            cells += [fmt(v), ratio(v, best_decode[b])]
        t = r["train_step_s"]
        cells += [fmt(t * 1e3 if t is not None else None), ratio(t, best_train, higher_is_better=False)]
        print("| " + " | ".join(cells) + " |")
    compiled = [r for r in rows if r["compiled_decode_tok_s"]]
    if compiled:
        best_compiled = {b: best(r["compiled_decode_tok_s"].get(str(b)) for r in compiled
                                 if r["backend"] in TRANSFORMERS_BACKENDS) for b in args.decode_batches}
        head = ["decode, static cache, compiled (reduce-overhead)"]
        for b in args.decode_batches:
            head += [f"b{b} tok/s", "ratio"]
        print("\n| " + " | ".join(head) + " |\n|" + " --- |" * len(head))
        for r in compiled:
            cells = [r["backend"]]
            for b in args.decode_batches:
                v = r["compiled_decode_tok_s"].get(str(b))
                cells += [fmt(v), ratio(v, best_compiled[b])]
            print("| " + " | ".join(cells) + " |")
    errors = [(r["backend"], k, v) for r in rows for k, v in r["errors"].items()]
    if errors:
        print("\nnot measured:")
        for backend, key, why in errors:
            print(f"- {backend} {key}: {why}")
    if result["call_overhead"]:
        print("\n| experts call at 1 token (layer 0) | C ABI call loop µs/call | moekit.torch.experts loop µs/call | "
              "via the transformers adapter µs/call | CUDA graph replay µs/call (kernels alone) | overhead µs (loop - "
              "graph) |")
        print("| --- | --- | --- | --- | --- | --- |")
        for r in result["call_overhead"]:
            overhead = r["op_loop_us"] - r["graph_us"] if r["op_loop_us"] is not None and r["graph_us"] is not None else None
            print(f"| {r['backend']} | {fmt(r.get('c_loop_us'))} | {fmt(r['op_loop_us'])} | {fmt(r['adapter_loop_us'])} | "
                  f"{fmt(r['graph_us'], 2)} | {fmt(overhead)} |" + (f" {r['error']}" if r["error"] else ""))


def main(argv=None):
    args = parse_args(argv)
    budget = Budget(args.max_seconds)
    import torch
    import transformers

    import moekit
    import moekit.transformers as moekit_transformers

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_transformers.py: --device cuda but torch sees no CUDA GPU (use --device cpu --tiny)")
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(NO_EXPERTS_IMPLEMENTATION, lambda self, hidden_states, *_: torch.zeros_like(hidden_states))
    timer = Timer(device)
    t0 = time.perf_counter()
    model, config = build_model(args, device)
    print(f"model built in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    warm_up(args, model, config, device)
    print(f"warmed up in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    result = {
        "args": {k: v for k, v in vars(args).items()},
        "model": {"layers": config.num_hidden_layers, "hidden_size": config.hidden_size,
                  "num_experts": config.num_experts, "top_k": config.num_experts_per_tok,
                  "moe_intermediate_size": config.moe_intermediate_size, "vocab_size": config.vocab_size,
                  "parameters": sum(p.numel() for p in model.parameters())},
        "environment": {"torch": torch.__version__, "transformers": transformers.__version__,
                        "moekit": getattr(moekit, "__version__", "?"), "device_type": device.type,
                        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"},
        "rows": [], "call_overhead": [],
    }
    try:
        rounds = {label: [] for label in args.backends}
        for r in range(args.rounds):
            for label in args.backends:
                t = time.perf_counter()
                if label == OVERRIDDEN:
                    moekit_transformers.register(override_builtin=True)
                try:
                    rounds[label].append(measure_backend(args, model, config, label, device, timer, budget))
                finally:
                    if label == OVERRIDDEN:
                        moekit_transformers.register(override_builtin=False)
                print(f"  round {r + 1}, {label}: {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
        result["rounds"] = rounds
        result["rows"] = [median_row(rows) for rows in rounds.values()]
        t = time.perf_counter()
        result["call_overhead"] = measure_call_overhead(args, model, config, device, budget)
        print(f"  experts calls: {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
    finally:
        result["seconds"] = time.perf_counter() - budget.start
        print_tables(result, args)
        print(f"\n{result['seconds']:.0f} s in all", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1, default=lambda v: None if isinstance(v, float) and math.isnan(v) else str(v))
            print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
