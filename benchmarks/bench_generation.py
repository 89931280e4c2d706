"""Generation tokens/s: the trainer's in-process backend vs plain `model.generate` vs this machine's limit.

SmolLM2-135M-Instruct, fp32, sampling at temperature 1, a fixed number of new tokens (min = max), batch 8 and 32.
`--generations G`: the batch holds batch/G prompts, each G times, as a training step's generation batch does
(num_generations); both generate and the backend get the same rows. G=1: every row its own prompt.
The limit is estimated from two rates measured in the same run: the rate of reading a buffer the size of the
weights and the fp32 matmul rate (a large square matmul). A call cannot be faster than its prompts' forward (once per
distinct prompt, the LM head at the last position only: its FLOPs / matmul rate) plus, for each further token, a
decode step: max((weight bytes + the KV cache's bytes at that step) / bandwidth, 2 x parameters x rows / matmul rate).
"3x generate / limit" is the fraction of that limit a backend 3 times as fast as `generate` would reach.
"backend" packs the decode step's weights on every call, as a training step does; "kept" reuses the packed copy
(`reusing_weights`), as evaluation's batches of one policy do.

    .venv/bin/python benchmarks/bench_generation.py [--batches 8,32] [--tokens 48] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def measured_limits(weight_bytes: int) -> tuple[float, float]:
    """(bytes/s of reading a buffer as large as the model's weights again and again, as every decode step does: the
    machine's caches count where the weights fit in them; FLOP/s of a large fp32 matmul), best of a few."""
    source = torch.ones(weight_bytes // 4)  # (written, so that the reads are not of the shared zero page)
    reads = []
    for _ in range(5):
        start = time.perf_counter()
        source.sum()
        reads.append(time.perf_counter() - start)
    bandwidth = source.numel() * 4 / min(reads)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    matmuls = []
    for _ in range(5):
        start = time.perf_counter()
        a @ b
        matmuls.append(time.perf_counter() - start)
    return bandwidth, 2 * 1024**3 / min(matmuls)


def call_floor(config, parameters: int, embedding: int, rows: int, distinct: int, prompt_length: int, tokens: int,
               bandwidth: float, flops: float) -> float:
    """Seconds a generation call cannot go below on this machine (the module's docstring): fp32 weights and KV cache,
    every weight read once per decode step, the prompts' forward at the machine's matmul rate."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_per_position = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4  # keys and values
    prefill = 2 * ((parameters - embedding) * distinct * prompt_length + embedding * distinct) / flops
    steps = sum(max((parameters * 4 + rows * kv_per_position * (prompt_length + step)) / bandwidth,
                    2 * parameters * rows / flops) for step in range(1, tokens))
    return prefill + steps


def prompts(tokenizer, batch: int, generations: int = 1) -> list[list[int]]:
    """`batch` rows: batch / generations prompts of data/arithmetic.jsonl, each `generations` times in a row."""
    import json

    from rloo.data import tokenize_prompts
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data/arithmetic.jsonl")) as f:
        rows = [json.loads(line) for line in f][:max(batch // generations, 1)]
    distinct = tokenize_prompts(tokenizer, [row["prompt"] for row in rows], None)
    return [ids for ids in distinct for _ in range(generations)][:batch]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="8,32")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--generations", default="1,4", help="rows per prompt (comma-separated: one table row each)")
    options = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rloo import RLOOConfig
    from rloo.assets import smollm2_path
    from rloo.data import pad_rows
    from rloo.generation import make_generation_backend
    from rloo.models import eos_token_ids
    path = smollm2_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eos = eos_token_ids(tokenizer, model)
    tokens = options.tokens
    args = RLOOConfig(output_dir="/tmp/bench-generation", use_cpu=True, bf16=False, max_completion_length=tokens,
                      generation_kwargs={"min_new_tokens": tokens}, report_to="none")
    backend = make_generation_backend(args, None, model, tokenizer, tokenizer.pad_token_id, eos)
    config = backend.generation_config if hasattr(backend, "generation_config") else None
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth, flops = measured_limits(weight_bytes)
    parameters = sum(p.numel() for p in model.parameters())
    print(f"machine: {bandwidth / 1e9:.1f} GB/s reading the weights' size, {flops / 1e9:.0f} GFLOP/s fp32 matmul; "
          f"model "
          f"{parameters / 1e6:.0f}M parameters, {weight_bytes / 2**20:.0f} MiB")
    print(f"\n{'batch':>5} {'rows/prompt':>11} {'generate tok/s':>15} {'backend tok/s':>14} {'ratio':>7} "
          f"{'kept tok/s':>14} {'ratio':>7} {'limit tok/s':>12} {'backend/limit':>13} {'3x generate/limit':>17}")
    for batch, generations in ((int(b), int(g)) for b in options.batches.split(",")
                               for g in options.generations.split(",")):
        ids = prompts(tokenizer, batch, generations)
        input_ids, mask = pad_rows(ids, tokenizer.pad_token_id, "left")
        plain, ours, kept = [], [], []
        with backend.reusing_weights():
            backend.generate(model, ids, 1, 0)  # (packs the copy the `kept` calls reuse)
            for _ in range(options.repeats):
                start = time.perf_counter()
                with torch.no_grad():
                    model.generate(input_ids=input_ids, attention_mask=mask, generation_config=config)
                plain.append(batch * tokens / (time.perf_counter() - start))
                start = time.perf_counter()
                backend.generate(model, ids, 1, 0)
                kept.append(batch * tokens / (time.perf_counter() - start))
        for _ in range(options.repeats):
            start = time.perf_counter()
            backend.generate(model, ids, 1, 0)
            ours.append(batch * tokens / (time.perf_counter() - start))
        floor = call_floor(model.config, parameters, model.get_input_embeddings().weight.numel(), batch,
                           -(-batch // generations), input_ids.size(1), tokens, bandwidth, flops)
        limit = batch * tokens / floor
        g, b, k = statistics.median(plain), statistics.median(ours), statistics.median(kept)
        print(f"{batch:5d} {generations:11d} {g:15.1f} {b:14.1f} {b / g:6.2f}x {k:14.1f} {k / g:6.2f}x {limit:12.0f} "
              f"{b / limit:12.2f}x {3 * g / limit:16.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
