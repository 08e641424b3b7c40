"""PyTorch + transformers on the GPU, bf16, random weights of the benchmark shapes: prefill of a
512- and a 2048-token prompt, then 128 greedy tokens through transformers' own generate loop.

usage: python3 benches/gpu/torch_bench.py --hidden 2048 --intermediate 5632 --layers 16
           --heads 32 --kv-heads 8 --vocab 32000 [--arch qwen2] [--repeats 3]
Prints one JSON line per prompt length, in the fields `oxlm bench` prints.
"""
import argparse
import json
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from shapes import add_shape_args


def main():
    ap = argparse.ArgumentParser()
    add_shape_args(ap)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    qwen2 = a.arch == "qwen2"
    config, model_class = (Qwen2Config, Qwen2ForCausalLM) if qwen2 else (
        LlamaConfig, LlamaForCausalLM)
    cfg = config(hidden_size=a.hidden, intermediate_size=a.intermediate,
                 num_hidden_layers=a.layers, num_attention_heads=a.heads,
                 num_key_value_heads=a.kv_heads, vocab_size=a.vocab,
                 max_position_embeddings=8192, tie_word_embeddings=qwen2,
                 rope_theta=1e6 if qwen2 else 10000.0, rms_norm_eps=1e-6 if qwen2 else 1e-5)
    torch.manual_seed(0)
    model = model_class(cfg).to(device="cuda", dtype=torch.bfloat16).eval()

    def sync_time():
        torch.cuda.synchronize()
        return time.perf_counter()

    for prompt in (512, 2048):
        pre, dec = [], []
        for rep in range(a.repeats + 1):
            ids = torch.randint(0, a.vocab, (1, prompt), device="cuda")
            with torch.inference_mode():
                t0 = sync_time()
                model(ids)
                t1 = sync_time()
                model.generate(ids, max_new_tokens=a.gen, min_new_tokens=a.gen, do_sample=False)
                t2 = sync_time()
            if rep:
                pre.append(prompt / (t1 - t0))
                # generate repeats the prefill: what it took beyond that is the decoding.
                dec.append(a.gen / ((t2 - t1) - (t1 - t0)))
        print(json.dumps({"engine": "torch", "arch": a.arch, "hidden": a.hidden, "layers": a.layers,
                          "prompt_tokens": prompt, "prefill_tps": statistics.median(pre),
                          "decode_tps": statistics.median(dec)}), flush=True)


if __name__ == "__main__":
    main()
