"""Optimizer steps per second and peak memory of this trainer vs TRL 1.16's RLOOTrainer, same recipe, same run.

Every (trainer, case) pair trains in its own child process, so peak RSS is its own; the two trainers alternate
within each repeat (TRL, rloo, TRL, rloo, ...) and the table shows medians over the repeats. Completion lengths are
fixed (generation_kwargs min_new_tokens = max_new_tokens), so both trainers do the same work each step and the
ratio is not noise from sampled lengths. A step is timed by the same callback in both trainers: from the start of
its first micro-batch to the end of the optimizer step; the first step (warm-up) is left out. Our step-time
breakdown (timing/*) is printed beside it. Run it with the benchmark environment, which has TRL installed:

    bash benchmarks/run.sh                                   # every case, 3 repeats (about an hour on 2 cores)
    bash benchmarks/run.sh --cases smollm2-full-32 --repeats 1
    bash benchmarks/run.sh --cases smollm2-full-32 --kl-logps-from-generation   # ours with that option (beta > 0)
    RLOO_KERNEL_MARCH=x86-64-v3 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
        bash benchmarks/run.sh ...       # a CPU with AVX-512 held to AVX2 (both trainers; the children inherit it)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = dict(
    bf16=False,
    use_cpu=True,
    per_device_train_batch_size=8,
    num_generations=4,
    learning_rate=1e-5,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    gradient_checkpointing=False,
    seed=0,
    disable_tqdm=True,
    temperature=1.0,
)
SECTIONS = ("generation", "weight_sync", "rewards", "logprobs", "train", "optimizer")


def cases() -> dict[str, dict]:
    """name -> model ('tiny' | 'smollm2'), lora, completion tokens, beta, steps."""
    found = {}
    for tokens in (32, 64):
        for beta in (0.05, 0.0):
            suffix = f"{tokens}" + ("" if beta else "-beta0")
            found[f"tiny-{suffix}"] = dict(
                model="tiny", lora=False, tokens=tokens, beta=beta, steps=12
            )
            found[f"smollm2-full-{suffix}"] = dict(
                model="smollm2", lora=False, tokens=tokens, beta=beta, steps=4
            )
            found[f"smollm2-lora-{suffix}"] = dict(
                model="smollm2", lora=True, tokens=tokens, beta=beta, steps=4
            )
    return found


def child(impl: str, case: dict) -> dict:
    import torch
    from datasets import load_dataset
    from transformers import TrainerCallback

    torch.set_num_threads(os.cpu_count() or 1)
    if impl == "trl":
        from trl import RLOOConfig, RLOOTrainer
    else:
        from rloo import RLOOConfig, RLOOTrainer
    from rloo.rewards import numeric_accuracy_reward

    dataset = load_dataset(
        "json", data_files=os.path.join(ROOT, "data/arithmetic.jsonl"), split="train"
    )
    if case["model"] == "tiny":
        from rloo.tiny import save_tiny, tiny_causal_lm, tiny_tokenizer

        tokenizer = tiny_tokenizer()
        # TRL rebuilds its reference model from the policy's path, so both get a saved folder.
        model, _ = save_tiny(f"/tmp/bench-tiny-{impl}", tiny_causal_lm(tokenizer), tokenizer)
    else:
        from transformers import AutoTokenizer

        from rloo.assets import smollm2_path

        model = smollm2_path()
        tokenizer = AutoTokenizer.from_pretrained(model)
    peft_config = None
    if case["lora"]:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=16,
            lora_alpha=32,
            lora_dropout=0.0,
            target_modules="all-linear",
            task_type="CAUSAL_LM",
        )
    tokens = case["tokens"]
    extra = {}
    if impl == "rloo" and case["beta"] and os.environ.get("BENCH_KL_LOGPS_FROM_GENERATION") == "1":
        extra["kl_logps_from_generation"] = True  # (TRL has no such option)
    args = RLOOConfig(
        output_dir=f"/tmp/bench-{impl}",
        max_steps=case["steps"],
        beta=case["beta"],
        max_completion_length=tokens,
        generation_kwargs={"min_new_tokens": tokens, "max_new_tokens": tokens},
        **BASE,
        **extra,
    )

    class StepClock(TrainerCallback):
        def __init__(self):
            self.started, self.seconds = None, []

        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds.append(time.perf_counter() - self.started)

    clock = StepClock()
    trainer = RLOOTrainer(
        model=model,
        reward_funcs=numeric_accuracy_reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[clock],
    )
    trainer.train()
    logs = [log for log in trainer.state.log_history if "num_tokens" in log]
    lengths = [log["completions/mean_length"] for log in logs]
    steady = clock.seconds[1:] or clock.seconds
    tokens_per_step = (logs[-1]["num_tokens"] - logs[0]["num_tokens"]) / max(len(logs) - 1, 1)
    breakdown = {
        name: statistics.median(log[f"timing/{name}"] for log in logs[1:] or logs)
        for name in SECTIONS
        if f"timing/{name}" in logs[0]
    }
    return {
        "step_s": statistics.median(steady),
        "tokens_per_step": tokens_per_step,
        "lengths": lengths,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "breakdown": breakdown,
    }


def run_child(impl: str, name: str) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", impl, name],
        capture_output=True,
        text=True,
        env=dict(os.environ, TOKENIZERS_PARALLELISM="false"),
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        print(out.stdout[-3000:], out.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"{impl}/{name} failed")
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", nargs=2, metavar=("IMPL", "CASE"))
    parser.add_argument(
        "--cases", default=",".join(cases()), help="comma-separated: " + ", ".join(cases())
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--kl-logps-from-generation",
        action="store_true",
        help="ours with kl_logps_from_generation=True where beta > 0",
    )
    options = parser.parse_args()
    if options.kl_logps_from_generation:
        os.environ["BENCH_KL_LOGPS_FROM_GENERATION"] = "1"
        print("rloo runs with kl_logps_from_generation=True where beta > 0", flush=True)
    if options.child:
        impl, name = options.child
        print("RESULT " + json.dumps(child(impl, cases()[name])), flush=True)
        return 0
    names = options.cases.split(",")
    unknown = [name for name in names if name not in cases()]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; known: {', '.join(cases())}")
    results: dict[tuple[str, str], list[dict]] = {}
    for repeat in range(options.repeats):
        for name in names:
            for impl in ("trl", "rloo"):
                result = run_child(impl, name)
                results.setdefault((name, impl), []).append(result)
                print(
                    f"repeat {repeat + 1}/{options.repeats} {name:22} {impl:4} {result['step_s']:7.3f} s/step, "
                    f"peak RSS {result['peak_rss_gib']:.2f} GiB",
                    flush=True,
                )
    print(
        f"\n{'case':22} {'TRL s/step':>10} {'rloo s/step':>11} {'steps/s ratio':>13} {'rloo tok/s':>10} "
        f"{'TRL GiB':>8} {'rloo GiB':>8} {'RSS ratio':>9}  rloo breakdown (s/step)"
    )
    for name in names:
        trl, ours = results[(name, "trl")], results[(name, "rloo")]
        trl_s = statistics.median(r["step_s"] for r in trl)
        our_s = statistics.median(r["step_s"] for r in ours)
        trl_rss = statistics.median(r["peak_rss_gib"] for r in trl)
        our_rss = statistics.median(r["peak_rss_gib"] for r in ours)
        tokens = statistics.median(r["tokens_per_step"] for r in ours) / our_s
        parts = ", ".join(
            f"{section} {statistics.median(r['breakdown'][section] for r in ours):.2f}"
            for section in SECTIONS
            if section in ours[0]["breakdown"]
        )
        print(
            f"{name:22} {trl_s:10.3f} {our_s:11.3f} {trl_s / our_s:12.2f}x {tokens:10.0f} {trl_rss:8.2f} "
            f"{our_rss:8.2f} {our_rss / trl_rss:8.2f}x  {parts}"
        )
        lengths = {
            impl: sorted({round(x, 1) for r in runs for x in r["lengths"]})
            for impl, runs in (("trl", trl), ("rloo", ours))
        }
        if lengths["trl"] != lengths["rloo"]:
            print(f"  note: completion lengths differ: {lengths}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
