"""DeepSpeed ZeRO-3 on CPU (gloo), real processes: two ranks under torchrun train the same update as plain DDP,
ds3_gather_for_generation on/off give the same run, a resumed ZeRO-3 run ends where the uninterrupted one does,
and a reward model and the reference are sharded like the policy. Plus the config checks that need no process."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file

from helpers import printed_logs
from rloo import RLOOConfig
from rloo.zero import frozen_engine_config
from services import free_port
from tiny_models import save_tiny, tiny_causal_lm, tiny_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.dirname(os.path.abspath(__file__))
ZERO3 = os.path.join(ROOT, "configs", "deepspeed", "zero3.json")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("zero3")
    tokenizer = tiny_tokenizer()
    torch.manual_seed(0)
    # Tied embeddings, as SmolLM2's: one parameter that ZeRO-3 partitions and ZeRO-2's save writes twice.
    model = tiny_causal_lm(tokenizer, tie_word_embeddings=True)
    model_dir, tokenizer_dir = save_tiny(str(root / "tiny"), model, tokenizer)
    with open(root / "prompts.jsonl", "w") as handle:
        for words in ["the dog", "a big cat", "one two", "what is"] * 4:
            handle.write(json.dumps({"prompt": [{"role": "user", "content": words}]}) + "\n")
    recipe = {
        "model_name_or_path": model_dir,
        "tokenizer_name_or_path": tokenizer_dir,
        "dataset_name": str(root / "prompts.jsonl"),
        "reward_funcs": ["cli_rewards:length_reward"],
        "bf16": False,
        "max_steps": 3,
        "per_device_train_batch_size": 4,
        "num_generations": 4,
        "max_completion_length": 6,
        "optim": "sgd",
        "learning_rate": 0.5,
        "beta": 0.1,
        "logging_steps": 1,
        "save_strategy": "steps",
        "save_steps": 2,
        "report_to": "none",
        "disable_tqdm": True,
        "deepspeed": ZERO3,
    }
    (root / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return root


def _train(workdir, name: str, *flags: str, port: int | None = None) -> dict:
    port = (
        port or free_port()
    )  # a fixed rendezvous port can collide with a process still shutting down
    out = workdir / name
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([TESTS, ROOT]))
    result = subprocess.run(
        [
            sys.executable,
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
            str(workdir / "recipe.yaml"),
            "--output_dir",
            str(out),
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    logs = printed_logs(result.stdout)  # rank 0's log lines
    return {
        "weights": load_file(str(out / "model.safetensors")),
        "logs": logs,
        "out": out,
        "stdout": result.stdout,
    }


@pytest.fixture(scope="module")
def zero3_run(workdir):
    return _train(workdir, "zero3")


@pytest.fixture(scope="module")
def ddp_run(workdir):
    return _train(workdir, "ddp", "--deepspeed", "", "--use_cpu", "true", "--ddp_backend", "gloo")


def _untied(weights: dict) -> dict:
    """The saved weights without a copy of the tied LM head (ZeRO-2's save writes it, DDP's does not)."""
    head = weights.get("lm_head.weight")
    if head is not None and torch.equal(head, weights["model.embed_tokens.weight"]):
        return {key: value for key, value in weights.items() if key != "lm_head.weight"}
    return weights


def _max_difference(a: dict, b: dict) -> float:
    a, b = _untied(a), _untied(b)
    assert a.keys() == b.keys()
    return max((a[key] - b[key]).abs().max().item() for key in a)


@pytest.mark.slow
def test_zero3_trains_the_same_update_as_ddp(workdir, zero3_run, ddp_run):
    # SGD: the update is linear in the gradient, so only reduction order may differ (Adam would amplify it).
    ddp = ddp_run
    initial = load_file(os.path.join(workdir, "tiny", "model", "model.safetensors"))
    assert _max_difference(ddp["weights"], initial) > 1e-2  # training moved the weights
    assert _max_difference(zero3_run["weights"], ddp["weights"]) < 1e-6
    assert len(zero3_run["logs"]) == 3
    for mine, theirs in zip(zero3_run["logs"], ddp["logs"]):
        assert (
            mine["reward"] == theirs["reward"]
            and abs(float(mine["kl"]) - float(theirs["kl"])) < 1e-5
        )
    assert float(zero3_run["logs"][0]["kl"]) == 0.0  # the sharded reference starts as the policy
    assert float(zero3_run["logs"][2]["kl"]) != 0.0  # (a mean log-ratio: either sign)
    checkpoint = zero3_run["out"] / "checkpoint-2"
    assert (checkpoint / "model.safetensors").exists() and (checkpoint / "global_step2").is_dir()
    assert "rloo: DeepSpeed ZeRO-3 sharding on 2 ranks" in zero3_run["stdout"]
    assert "ZeRO-3" not in ddp["stdout"]


@pytest.mark.slow
def test_zero2_trains_the_same_update_as_ddp(workdir, ddp_run):
    zero2 = _train(
        workdir, "zero2", "--deepspeed", os.path.join(ROOT, "configs", "deepspeed", "zero2.json")
    )
    assert _max_difference(zero2["weights"], ddp_run["weights"]) < 1e-6
    assert [log["reward"] for log in zero2["logs"]] == [log["reward"] for log in ddp_run["logs"]]
    assert "ZeRO-3" not in zero2["stdout"]  # stage 2: the reference stays a plain replicated copy


@pytest.mark.slow
def test_zero3_without_gathering_for_generation_samples_the_same(workdir, zero3_run):
    # Layer-by-layer gathering (synced ranks) instead of one full gather: same tokens, same update.
    sharded = _train(workdir, "zero3-nogather", "--ds3_gather_for_generation", "false")
    assert _max_difference(sharded["weights"], zero3_run["weights"]) == 0.0
    assert [log["reward"] for log in sharded["logs"]] == [
        log["reward"] for log in zero3_run["logs"]
    ]


@pytest.mark.slow
def test_zero3_resume_ends_with_the_uninterrupted_weights(workdir, zero3_run):
    resumed_dir = workdir / "zero3-resumed"
    resumed_dir.mkdir()
    shutil.copytree(zero3_run["out"] / "checkpoint-2", resumed_dir / "checkpoint-2")
    resumed = _train(workdir, "zero3-resumed", "--resume_from_checkpoint", "latest")
    assert len(resumed["logs"]) == 1  # only step 3 ran
    assert resumed["logs"][0]["reward"] == zero3_run["logs"][2]["reward"]
    assert _max_difference(resumed["weights"], zero3_run["weights"]) == 0.0


UNWRAP_CHECK = """
import sys
import rloo
from accelerate.utils.other import extract_model_from_parallel
from torch import nn
from tiny_models import tiny_causal_lm, tiny_tokenizer

model = tiny_causal_lm(tiny_tokenizer())
model.save_pretrained(sys.argv[1])
assert extract_model_from_parallel(model) is model
assert "deepspeed" not in sys.modules, "saving a model without DeepSpeed imported deepspeed"
from deepspeed import DeepSpeedEngine

class Engine(DeepSpeedEngine):
    def __init__(self, module):
        nn.Module.__init__(self)
        self.module = module

assert extract_model_from_parallel(Engine(model)) is model, "a DeepSpeed engine was not unwrapped"
"""


def test_deepspeed_is_imported_only_by_the_runs_that_use_it(tmp_path):
    """accelerate's unwrap (at every save) skips its DeepSpeed lookup while deepspeed is not loaded
    (rloo.deepspeed_lookup), and still unwraps an engine once it is."""
    done = subprocess.run(
        [sys.executable, "-c", UNWRAP_CHECK, str(tmp_path / "model")],
        cwd=TESTS,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_deepspeed_with_use_cpu_is_refused(tmp_path):
    with pytest.raises(ValueError, match="use_cpu=True would bypass it"):
        RLOOConfig(
            output_dir=str(tmp_path), deepspeed=ZERO3, use_cpu=True, bf16=False, report_to="none"
        )


def test_continuous_batching_under_zero3_needs_gathering(tmp_path):
    with pytest.raises(ValueError, match="ds3_gather_for_generation=True"):
        RLOOConfig(
            output_dir=str(tmp_path),
            deepspeed=ZERO3,
            bf16=False,
            report_to="none",
            use_transformers_continuous_batching=True,
            ds3_gather_for_generation=False,
        )


def test_frozen_engine_config_for_reference_and_reward_models(model):
    training = {
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": "auto",
            "overlap_comm": True,
            "stage3_prefetch_bucket_size": "auto",
        },
        "optimizer": {"type": "AdamW"},
        "scheduler": {"type": "WarmupLR"},
        "train_batch_size": 16,
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 2,
        "bf16": {"enabled": "auto"},
    }
    config = frozen_engine_config(training, model, micro_batch_size=8)
    hidden = model.config.hidden_size
    assert (
        "optimizer" not in config and "scheduler" not in config and "train_batch_size" not in config
    )
    assert config["zero_optimization"] == {
        "stage": 3,
        "reduce_bucket_size": hidden * hidden,
        "overlap_comm": True,
        "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
        "stage3_param_persistence_threshold": 10 * hidden,
    }
    assert config["gradient_accumulation_steps"] == 1 and config["bf16"] == {}
    assert (
        training["zero_optimization"]["reduce_bucket_size"] == "auto"
    )  # the training config is left untouched
    stage2 = frozen_engine_config({"zero_optimization": {"stage": 2}}, model, micro_batch_size=4)
    assert stage2["zero_optimization"] == {
        "stage": 0
    }  # ZeRO-1/2 shard optimizer state only: replicate


@pytest.mark.slow
def test_zero3_reward_model_is_sharded_and_scores_as_under_ddp(workdir):
    from tiny_models import tiny_reward_model

    tokenizer = tiny_tokenizer()
    reward_dir = workdir / "reward-model"
    tiny_reward_model(tokenizer).save_pretrained(str(reward_dir))
    tokenizer.save_pretrained(str(reward_dir))
    flags = ("--reward_funcs", str(reward_dir), "--max_steps", "1", "--save_strategy", "no")
    zero3 = _train(workdir, "zero3-rm", *flags)
    ddp = _train(
        workdir, "ddp-rm", *flags, "--deepspeed", "", "--use_cpu", "true", "--ddp_backend", "gloo"
    )
    assert zero3["logs"][0]["reward"] == ddp["logs"][0]["reward"]
    assert _max_difference(zero3["weights"], ddp["weights"]) < 1e-6
