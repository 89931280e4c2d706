"""The GPU check: what one CUDA GPU shows about this trainer, in one table (printed and written to a file).

    bash scripts/gpu_check.sh                 # a CUDA GPU: SmolLM2-135M's shape (random weights), bf16
    bash scripts/gpu_check.sh --device cpu    # the dry run CI does: every check on a tiny model, float32

Each check (a row of the table):
- gradients: one RLOO step's gradient through the speed layer and through the reference path (plain forwards), for
  the same rollout: the largest difference relative to the largest gradient (bf16 rounding, no more);
- decode: our decode loop (its steps as CUDA graphs on a GPU) against `model.generate`, tokens/s of each at batch
  32, and whether their greedy tokens agree;
- step: seconds per optimizer step of RLOOTrainer, and of TRL's RLOOTrainer on the same model and data where TRL is
  installed (otherwise the row says so);
- QLoRA: a 4-bit base (bitsandbytes, NF4) with LoRA trained a few steps: the adapter moves, the loss is finite
  (the dry run trains LoRA on a full-precision base: bitsandbytes' 4-bit kernels need CUDA);
- peak memory: the GPU's peak allocated memory (the process's peak RSS on the CPU).
A check that fails says so in its row and the exit status is 1; one that cannot run here (no TRL, no bitsandbytes)
says why and does not fail the run.
"""

from __future__ import annotations

import argparse
import copy
import os
import resource
import statistics
import sys
import tempfile
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rloo.timing import synchronize  # noqa: E402

WORDS = ["what is two plus two ?", "the dog sat on the mat", "one two three four", "a big red cat"]


def model_and_tokenizer(dry: bool, device: torch.device, dtype: torch.dtype):
    """SmolLM2-135M's shape with random weights (a tiny Llama for the dry run) and the tiny tokenizer (its ids
    are valid for either: the weights are random)."""
    from rloo.tiny import smollm2_shaped, tiny_causal_lm, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    model = tiny_causal_lm(tokenizer) if dry else smollm2_shaped(seed=0)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.to(device, dtype), tokenizer


def dataset(rows: int):
    from datasets import Dataset

    return Dataset.from_list([{"prompt": WORDS[i % len(WORDS)]} for i in range(rows)])


def length_reward(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


def config(out: str, device: torch.device, dtype: torch.dtype, **overrides):
    from rloo import RLOOConfig

    return RLOOConfig(**settings(out, device, dtype, **overrides))


def settings(out: str, device: torch.device, dtype: torch.dtype, **overrides) -> dict:
    """The check's recipe, in field names TRL's RLOOConfig shares."""
    chosen = dict(
        output_dir=out,
        use_cpu=device.type == "cpu",
        bf16=dtype == torch.bfloat16,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=32,
        learning_rate=1e-5,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
        gradient_checkpointing=False,
    )
    chosen.update(overrides)
    return chosen


def check_gradients(model, tokenizer, device, dtype, out):
    """One rollout; the loss's gradient with the speed layer on and off."""
    from rloo import RLOOTrainer

    trainer = RLOOTrainer(
        model=copy.deepcopy(model),
        reward_funcs=length_reward,
        processing_class=tokenizer,
        args=config(out, device, dtype, engine="fast", beta=0.05),
        train_dataset=dataset(8),
    )
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.model.train()
    rollout = trainer._prepare_inputs(batch)
    gradients = {}
    for fast in (True, False):
        trainer._fast = fast
        trainer.model.zero_grad()
        trainer.compute_loss(trainer.model, copy.copy(rollout)).backward()
        gradients[fast] = {
            name: p.grad.float().clone()
            for name, p in trainer.model.named_parameters()
            if p.grad is not None
        }
    largest = max(g.abs().max().item() for g in gradients[False].values())
    difference = max(
        (gradients[True][name] - g).abs().max().item() for name, g in gradients[False].items()
    )
    relative = difference / max(largest, 1e-30)
    limit = 2e-2 if dtype == torch.bfloat16 else 1e-4  # (bf16 keeps 8 bits of mantissa)
    return (
        relative <= limit,
        f"max |difference| / max |gradient| = {relative:.2e} (limit {limit:g})",
    )


def check_decode(model, tokenizer, device, dtype, out, tokens: int, repeats: int):
    """Our decode loop against model.generate: tokens/s at batch 32 (sampling), greedy tokens compared."""
    from rloo.data import pad_rows, tokenize_prompts
    from rloo.generation import make_generation_backend
    from rloo.models import eos_token_ids

    model = model.eval()
    eos = eos_token_ids(tokenizer, model)
    args = config(
        out,
        device,
        dtype,
        max_completion_length=tokens,
        generation_kwargs={"min_new_tokens": tokens},
    )
    backend = make_generation_backend(args, None, model, tokenizer, tokenizer.pad_token_id, eos)
    ids = [row for row in tokenize_prompts(tokenizer, WORDS, None) for _ in range(8)]
    input_ids, mask = (t.to(device) for t in pad_rows(ids, tokenizer.pad_token_id, "left"))
    settings = backend.generation_config

    def rate(call) -> float:
        synchronize(device)
        start = time.perf_counter()
        call()
        synchronize(device)
        return len(ids) * tokens / (time.perf_counter() - start)

    def plain():
        with torch.no_grad():
            model.generate(input_ids=input_ids, attention_mask=mask, generation_config=settings)

    def ours():
        backend.generate(model, ids, 1, 0)

    plain(), ours()  # (first calls: allocator, cuBLAS, graph capture)
    rates = {"generate": [], "ours": []}
    for _ in range(repeats):
        rates["generate"].append(rate(plain))
        rates["ours"].append(rate(ours))
    generate_rate, our_rate = (statistics.median(rates[key]) for key in ("generate", "ours"))
    greedy = make_generation_backend(
        config(out, device, dtype, max_completion_length=tokens, top_k=1),
        None,
        model,
        tokenizer,
        tokenizer.pad_token_id,
        eos,
    )
    with torch.no_grad():
        expected = model.generate(
            input_ids=input_ids[:4],
            attention_mask=mask[:4],
            do_sample=False,
            max_new_tokens=tokens,
            pad_token_id=tokenizer.pad_token_id,
        )
    width = input_ids.size(1)
    got = greedy.generate(model, ids[:4], 1, 0)
    agree = all(
        _to_eos(expected[row, width:].tolist(), eos) == _to_eos(list(got[row]), eos)
        for row in range(4)
    )
    graphs = " (CUDA graphs)" if device.type == "cuda" else ""
    return agree, (
        f"decode loop{graphs} {our_rate:.0f} tok/s, model.generate {generate_rate:.0f} tok/s: "
        f"{our_rate / generate_rate:.2f}x; greedy tokens {'agree' if agree else 'DIFFER'}"
    )


def _to_eos(ids, eos) -> list[int]:
    for at, token in enumerate(ids):
        if token in eos:
            return ids[: at + 1]
    return ids


def step_seconds(
    trainer_class, config_class, model, tokenizer, device, dtype, out, steps: int
) -> float:
    """Median seconds of an optimizer step (the first, warm-up, left out) of one trainer; `model` a saved folder
    (TRL builds its reference model from the policy's path)."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def __init__(self):
            self.started, self.seconds = 0.0, []

        def on_step_begin(self, args, state, control, **kwargs):
            synchronize(device)
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            synchronize(device)
            self.seconds.append(time.perf_counter() - self.started)

    clock = Clock()
    args = config_class(
        **settings(
            out, device, dtype, max_steps=steps + 1, generation_kwargs={"min_new_tokens": 32}
        )
    )
    trainer = trainer_class(
        model=model,
        reward_funcs=length_reward,
        args=args,
        train_dataset=dataset(8 * (steps + 1)),
        processing_class=tokenizer,
        callbacks=[clock],
    )
    trainer.train()
    return statistics.median(clock.seconds[1:] or clock.seconds)


def check_steps(model, tokenizer, device, dtype, out, steps: int):
    from rloo import RLOOConfig, RLOOTrainer
    from rloo.tiny import save_tiny

    model, _ = save_tiny(out + "-model", model, tokenizer)  # both trainers load the same folder
    ours = step_seconds(RLOOTrainer, RLOOConfig, model, tokenizer, device, dtype, out, steps)
    try:
        import trl
        from trl import RLOOConfig as TRLConfig
        from trl import RLOOTrainer as TRLTrainer
    except ImportError:
        return (
            True,
            f"rloo {ours:.3f} s/step; TRL not installed: no side-by-side (pip install trl==1.16.*)",
        )
    theirs = step_seconds(
        TRLTrainer, TRLConfig, model, tokenizer, device, dtype, out + "-trl", steps
    )
    return (
        True,
        f"rloo {ours:.3f} s/step, TRL {trl.__version__} {theirs:.3f} s/step: {theirs / ours:.2f}x",
    )


def check_qlora(model, tokenizer, device, dtype, out, steps: int):
    """A 4-bit NF4 base with LoRA, a few steps (the dry run: LoRA on the full-precision base)."""
    from peft import LoraConfig

    from rloo import RLOOTrainer

    quantized = device.type == "cuda"
    if quantized:
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            return None, "skipped: bitsandbytes is not installed (pip install bitsandbytes)"
        from transformers import AutoModelForCausalLM, BitsAndBytesConfig

        folder = tempfile.mkdtemp(prefix="gpu-check-")
        model.save_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(
            folder,
            device_map={"": device.index or 0},
            quantization_config=BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16
            ),
        )
    else:
        model = copy.deepcopy(model)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = RLOOTrainer(
        model=model,
        reward_funcs=length_reward,
        processing_class=tokenizer,
        args=config(out, device, dtype, max_steps=steps, learning_rate=1e-3),
        train_dataset=dataset(8 * steps),
        peft_config=lora,
    )
    before = {
        name: p.detach().float().clone()
        for name, p in trainer.model.named_parameters()
        if p.requires_grad
    }
    trainer.train()
    moved = sum(
        not torch.equal(before[name], p.detach().float())
        for name, p in trainer.model.named_parameters()
        if name in before
    )
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    finite = bool(losses) and all(loss == loss and abs(loss) != float("inf") for loss in losses)
    kind = "4-bit NF4 base" if quantized else "dry run: full-precision base, no 4-bit on the CPU"
    return moved > 0 and finite, (
        f"{kind}: {len(losses)} steps, {moved}/{len(before)} adapter tensors moved, "
        f"losses {'finite' if finite else 'NOT finite'}"
    )


def peak_memory(device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB allocated at peak (GPU)"
    return f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB peak RSS (CPU)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--out", default="gpu-check.md")
    parser.add_argument("--steps", type=int, default=3)
    options = parser.parse_args()
    device = torch.device(options.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA GPU here. Fix: run it on a machine with one, or --device cpu for the dry run.",
            file=sys.stderr,
        )
        return 2
    dry = device.type == "cpu"
    dtype = torch.float32 if dry else torch.bfloat16
    import accelerate
    import peft
    import transformers

    where = torch.cuda.get_device_name(device) if not dry else "CPU (dry run)"
    rows = [
        (
            "machine",
            True,
            f"{where}; torch {torch.__version__}, transformers {transformers.__version__}, "
            f"peft {peft.__version__}, accelerate {accelerate.__version__}",
        )
    ]
    model, tokenizer = model_and_tokenizer(dry, device, dtype)
    parameters = sum(p.numel() for p in model.parameters())
    rows.append(
        ("model", True, f"{parameters / 1e6:.2f}M parameters, random weights, {str(dtype)[6:]}")
    )
    work = tempfile.mkdtemp(prefix="gpu-check-")
    checks = [
        (
            "gradients: speed layer vs reference",
            lambda: check_gradients(model, tokenizer, device, dtype, f"{work}/gradients"),
        ),
        (
            "decode loop vs model.generate",
            lambda: check_decode(
                model,
                tokenizer,
                device,
                dtype,
                f"{work}/decode",
                16 if dry else 64,
                2 if dry else 5,
            ),
        ),
        (
            "step time (and TRL's)",
            lambda: check_steps(model, tokenizer, device, dtype, f"{work}/steps", options.steps),
        ),
        (
            "QLoRA",
            lambda: check_qlora(model, tokenizer, device, dtype, f"{work}/qlora", options.steps),
        ),
    ]
    for name, check in checks:
        start = time.perf_counter()
        try:
            ok, detail = check()
        except Exception as error:  # a failed check is a row of the table, not the end of the run
            ok, detail = False, f"{type(error).__name__}: {error}"
            traceback.print_exc()
        rows.append((name, ok, f"{detail} [{time.perf_counter() - start:.0f} s]"))
        print(
            f"[gpu-check] {name}: {'ok' if ok else 'skipped' if ok is None else 'FAILED'}: {detail}",
            flush=True,
        )
    rows.append(("peak memory", True, peak_memory(device)))
    table = ["| check | result | detail |", "|---|---|---|"]
    table += [
        f"| {name} | {'ok' if ok else 'skipped' if ok is None else 'FAILED'} | {detail} |"
        for name, ok, detail in rows
    ]
    text = "\n".join(table) + "\n"
    print("\n" + text)
    with open(options.out, "w") as handle:
        handle.write(text)
    print(f"written to {options.out}")
    return 1 if any(ok is False for _, ok, _ in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
