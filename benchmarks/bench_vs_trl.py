"""Seconds per step and peak memory of this trainer vs TRL 1.16's RLOOTrainer, same recipe, same run.

Each (implementation, model) pair trains in its own child process so peak RSS is its own. Run with the
benchmark environment, which has TRL installed (bash benchmarks/run.sh).
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

RECIPE = dict(bf16=False, use_cpu=True, per_device_train_batch_size=8, num_generations=4, max_completion_length=32,
              learning_rate=1e-5, beta=0.05, logging_steps=1, save_strategy="no", report_to="none",
              gradient_checkpointing=False, seed=0, disable_tqdm=True)


def child(impl: str, model_kind: str, steps: int) -> dict:
    import torch
    from datasets import load_dataset
    torch.set_num_threads(os.cpu_count() or 1)
    if impl == "trl":
        from trl import RLOOConfig, RLOOTrainer
    else:
        from rloo import RLOOConfig, RLOOTrainer
    from rloo.rewards import numeric_accuracy_reward
    dataset = load_dataset("json", data_files="data/arithmetic.jsonl", split="train")
    if model_kind == "tiny":
        from rloo.testing import save_tiny, tiny_causal_lm, tiny_tokenizer
        tokenizer = tiny_tokenizer()
        # TRL rebuilds its reference model from the policy's path, so both get a saved folder.
        model, _ = save_tiny(f"/tmp/bench-tiny-{impl}", tiny_causal_lm(tokenizer), tokenizer)
    else:
        from transformers import AutoTokenizer
        from rloo.assets import smollm2_path
        path = smollm2_path()
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = path
    args = RLOOConfig(output_dir=f"/tmp/bench-{impl}-{model_kind}", max_steps=steps, **RECIPE)
    trainer = RLOOTrainer(model=model, reward_funcs=numeric_accuracy_reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer)
    start = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - start
    step_times = [log["step_time"] for log in trainer.state.log_history if "step_time" in log]
    steady = step_times[1:] or step_times
    return {"impl": impl, "model": model_kind, "steps": steps, "total_s": total,
            "median_step_s": statistics.median(steady), "peak_rss_gib": resource.getrusage(
                resource.RUSAGE_SELF).ru_maxrss / 2**20}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", nargs=3, metavar=("IMPL", "MODEL", "STEPS"))
    parser.add_argument("--tiny-steps", type=int, default=12)
    parser.add_argument("--smollm-steps", type=int, default=4)
    parser.add_argument("--models", default="tiny,smollm2")
    options = parser.parse_args()
    if options.child:
        impl, model_kind, steps = options.child
        print("RESULT " + json.dumps(child(impl, model_kind, int(steps))), flush=True)
        return 0
    results = []
    for model_kind in options.models.split(","):
        steps = options.tiny_steps if model_kind == "tiny" else options.smollm_steps
        for impl in ("trl", "rloo"):
            out = subprocess.run([sys.executable, __file__, "--child", impl, model_kind, str(steps)],
                                 capture_output=True, text=True)
            lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
            if out.returncode != 0 or not lines:
                print(out.stdout[-3000:], out.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"{impl}/{model_kind} failed")
            results.append(json.loads(lines[-1][len("RESULT "):]))
    print(f"\n{'model':8} {'impl':5} {'steps':>5} {'median s/step':>14} {'peak RSS GiB':>13} {'ratio s/step':>13}")
    for model_kind in options.models.split(","):
        rows = {r["impl"]: r for r in results if r["model"] == model_kind}
        for impl in ("trl", "rloo"):
            r = rows[impl]
            ratio = r["median_step_s"] / rows["trl"]["median_step_s"]
            print(f"{model_kind:8} {impl:5} {r['steps']:5d} {r['median_step_s']:14.3f} {r['peak_rss_gib']:13.2f} "
                  f"{ratio:12.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
