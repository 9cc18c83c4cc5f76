#!/usr/bin/env python3
"""Makes tests/fixtures/models/*_fp8*: pre-quantised FP8 checkpoints written by `moekit quantize` from
the float fixtures (make_model_fixtures.py), each with transformers' own outputs after loading it as a
fine-grained FP8 checkpoint (quant_method "fp8"). transformers runs no FP8 kernel without a GPU, so on
this CPU it dequantises the weights at load (q * scale_inv, in the requested float32) — the reference
the issue asks for — and these fixtures prove that transformers loads what `moekit quantize` writes.

  prompt   [T] int32       the float fixture's prompt
  logits   [T, V] float32  transformers' float32 logits of the dequantised model
  greedy   [N] int32       greedy generate, new tokens only

Run:  scripts/reference_python.sh scripts/make_fp8_fixtures.py --moekit build/moekit
      (needs accelerate in .refenv: scripts/setup_reference_env.sh installs it)
transformers is the yardstick only, never a dependency of moekit.
"""
import argparse
import os
import shutil
import subprocess

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

MODELS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "models")
NEW_TOKENS = 8
# (float fixture, moekit quantize --format, fixture written)
FIXTURES = [("deepseek_v3", "fp8", "deepseek_v3_fp8"), ("qwen3_moe", "fp8-ue8m0", "qwen3_moe_fp8_ue8m0")]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--moekit", required=True, help="the moekit binary (its quantize command)")
    args = parser.parse_args()
    for source, fmt, name in FIXTURES:
        directory = os.path.join(MODELS, name)
        shutil.rmtree(directory, ignore_errors=True)
        subprocess.run([args.moekit, "quantize", "--model", os.path.join(MODELS, source), "--out", directory,
                        "--format", fmt], check=True)
        prompt = load_file(os.path.join(MODELS, source, "expected.safetensors"))["prompt"].long()[None]
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                     attn_implementation="eager").eval()
        with torch.no_grad():
            logits = model(prompt).logits[0].float()
            greedy = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS,
                                    eos_token_id=None, pad_token_id=0)[0, prompt.shape[1]:]
        top2 = logits.topk(2, dim=-1).values
        metadata = {"transformers": __import__("transformers").__version__, "torch": torch.__version__,
                    "source": source, "format": fmt,
                    "smallest_top2_gap": f"{(top2[:, 0] - top2[:, 1]).min().item():.4g}"}
        save_file({"prompt": prompt[0].to(torch.int32), "logits": logits.contiguous(),
                   "greedy": greedy.to(torch.int32).contiguous()},
                  os.path.join(directory, "expected.safetensors"), metadata=metadata)
        float_logits = load_file(os.path.join(MODELS, source, "expected.safetensors"))["logits"]
        drift = ((logits - float_logits).norm() / float_logits.norm()).item()
        print(f"{name}: from {source} ({fmt}), greedy {greedy.tolist()}, FP8 weights move the logits by "
              f"{drift:.4f} (relative L2), smallest top-2 gap {metadata['smallest_top2_gap']}")


if __name__ == "__main__":
    main()
