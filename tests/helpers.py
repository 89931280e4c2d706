"""Shared builders for trainer tests: tiny datasets, a config sized for 2 CPU cores, simple rewards."""

import pytest
import torch
from datasets import Dataset

from rloo import RLOOConfig

# Where a test runs: the CPU always, and a CUDA GPU where the machine has one (CI has none: skipped there).
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]

WORDS = [
    "the dog",
    "a big cat",
    "one two",
    "what is",
    "red mat",
    "sat on",
    "good dog",
    "small blue",
]
PROMPTS = [
    "the dog sat",
    "one two three four",
    "red",
    "a big cat on the mat",
]  # (generation tests: texts to tokenize)


def config(tokenizer, **settings):
    """A GenerationConfig for the tiny tokenizer: its pad and EOS, 12 new tokens unless `settings` say otherwise."""
    from transformers import GenerationConfig

    return GenerationConfig(
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=[tokenizer.eos_token_id],
        **{"max_new_tokens": 12, **settings},
    )


def kernel_targets() -> list[str]:
    """The builds of our decode kernel the tests check: this CPU's, and where that one has 16-float vectors (AVX-512)
    and the CPU AVX2 and FMA, the build for x86-64-v3 as well (8-float vectors: what a CPU without AVX-512 runs)."""
    from rloo.engine import kernel

    native = kernel.compiled()
    wide = (
        native is not None
        and native.vector_floats() == 16
        and {"avx2", "fma"} <= set(kernel._cpu_flags().split())
    )
    # (a gcc older than 11 has no -march=x86-64-v3)
    return ["native"] + (["x86-64-v3"] if wide and kernel.compiled("x86-64-v3") is not None else [])


def conversational(n=8):
    return Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": WORDS[i % len(WORDS)]}], "tag": i}
            for i in range(n)
        ]
    )


def standard(n=8):
    return Dataset.from_list([{"prompt": WORDS[i % len(WORDS)], "tag": i} for i in range(n)])


def make_args(tmp_path, **kwargs):
    settings = dict(
        output_dir=str(tmp_path / "out"),
        bf16=False,
        use_cpu=True,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=6,
        learning_rate=0.05,
        logging_steps=1,
        max_steps=2,
        report_to="none",
        save_strategy="no",
        beta=0.0,
        disable_tqdm=True,
    )
    settings.update(kwargs)
    return RLOOConfig(**settings)


def length_reward(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


def position_reward(completion_ids, **kwargs):
    """Differs inside every group, so every step has non-zero advantages and the weights move whatever is sampled
    (with length_reward, a tiny random model often samples equal lengths: zero advantages, no update)."""
    return [float(i) for i in range(len(completion_ids))]


def logged(trainer, key):
    return [log[key] for log in trainer.state.log_history if key in log]


TIMING_KEYS = [
    "timing/generation",
    "timing/weight_sync",
    "timing/rewards",
    "timing/logprobs",
    "timing/train",
    "timing/optimizer",
]


def assert_step_timing(records, generated=True):
    """Every training log record carries the six timing/* sections, and they add up to step_time within 10 %.
    Returns the records' timings as floats (a printed log has them as strings)."""
    records = [
        {key: float(value) for key, value in r.items() if key in TIMING_KEYS or key == "step_time"}
        for r in records
        if "step_time" in r
    ]
    assert records, "no training log record has step_time"
    for record in records:
        missing = [key for key in TIMING_KEYS if key not in record]
        assert not missing, (missing, record)
        total = sum(record[key] for key in TIMING_KEYS)
        assert abs(total - record["step_time"]) <= 0.1 * record["step_time"], (total, record)
        assert all(record[key] >= 0 for key in TIMING_KEYS), record
    if generated:
        assert (
            sum(r["timing/generation"] for r in records) > 0
            and sum(r["timing/train"] for r in records) > 0
        )
    return records


def with_lora(model, std: float = 0.3, **settings):
    """`model` with a peft LoRA adapter (r 4, alpha 8, every linear layer, no dropout, unless `settings` say otherwise)
    whose B matrices are drawn from N(0, std) instead of peft's zeros, so that an adapter a computation drops changes
    its outputs."""
    import torch
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        model,
        LoraConfig(
            **{**dict(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0), **settings}
        ),
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, std)
    return model


def small_llama(tokenizer, biases: bool = False):
    """A 2-layer Llama (hidden 64, 4 query heads over 2 key/value heads of 16, tied embeddings), seeded, whose norm
    weights and biases (every projection's, with `biases`) are drawn from N(0.5, 0.3) and N(0, 0.3) instead of 1 and
    0: a computation that dropped one of them gives other outputs."""
    import torch

    from rloo.tiny import tiny_causal_lm

    model = tiny_causal_lm(
        tokenizer,
        0,
        hidden_size=64,
        intermediate_size=96,
        max_position_embeddings=2048,
        attention_bias=biases,
        mlp_bias=biases,
        tie_word_embeddings=True,
    )
    with torch.no_grad():
        for module in model.modules():
            for name, param in module.named_parameters(recurse=False):
                if name == "bias" or "norm" in type(module).__name__.lower():
                    param.normal_(0.5 if name == "weight" else 0.0, 0.3)
    return model


def printed_logs(stdout: str) -> list[dict]:
    """The trainer's printed log dicts (`{'loss': ...}`), one per logged step. Another process (a vLLM engine's
    logger, a second rank) may write right after one on the same line: the dict ends at its first '}'."""
    import ast

    return [
        ast.literal_eval(line[: line.index("}") + 1])
        for line in stdout.splitlines()
        if line.startswith("{'loss'")
    ]


def assert_same_update(mine: dict, theirs: dict, start: dict, exact: bool = True):
    """Two runs from the `start` weights ended at the same ones (name -> tensor each): to 1e-6 where
    `exact`, else up to what float rounding in a loss becomes through Adam's normalised steps,
    measured against how far training moved each tensor (~1e-6 from last-bit differences, ~0.1 % of
    the move)."""
    for name, value in theirs.items():
        if exact:
            assert torch.allclose(mine[name], value, atol=1e-6, rtol=1e-5), name
        else:
            moved = (value - start[name]).abs().max().item()
            assert (mine[name] - value).abs().max().item() <= 1e-2 * moved + 1e-7, name
