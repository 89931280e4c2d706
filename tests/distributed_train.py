"""Launched by tests/test_distributed.py under torchrun: 2 CPU processes, groups of 6 straddling ranks."""

import json
import os
import sys

import torch.distributed
from datasets import Dataset

from rloo import RLOOConfig, RLOOTrainer
from rloo.engine import mapped
from rloo.process import exit_without_native_teardown
from rloo.tiny import tiny_causal_lm, tiny_tokenizer

out = sys.argv[1]
rank = int(os.environ["RANK"])
seen = []


def reward(completion_ids, tag, trainer_state, **kwargs):
    values = [float(len(ids)) for ids in completion_ids]
    seen.append({"tags": list(tag), "rewards": values, "step": trainer_state.global_step})
    kwargs["log_metric"]("rank_metric", float(rank))
    return values


tokenizer = tiny_tokenizer()
data = Dataset.from_list(
    [
        {"prompt": [{"role": "user", "content": w}], "tag": i}
        for i, w in enumerate(["the dog", "a cat", "one two", "red mat"])
    ]
)
args = RLOOConfig(
    output_dir=os.path.join(out, "run"),
    bf16=False,
    use_cpu=True,
    ddp_backend="gloo",
    per_device_train_batch_size=3,
    num_generations=6,
    max_completion_length=6,
    max_steps=2,
    logging_steps=1,
    report_to="none",
    save_strategy="no",
    beta=0.1,
    disable_tqdm=True,
    learning_rate=0.01,
    log_completions=True,
)
trainer = RLOOTrainer(
    model=tiny_causal_lm(tokenizer),
    reward_funcs=reward,
    args=args,
    train_dataset=data,
    processing_class=tokenizer,
)
assert trainer._pi_old["train"].kl == "loss"
flat = getattr(
    trainer.ref_model, "_rloo_mapping", None
)  # rloo.engine.mapped: accelerate's placement did not copy it out
if mapped.disk_directory(1 << 20) is not None:
    assert all(
        flat.data_ptr() <= p.data_ptr() < flat.data_ptr() + flat.numel()
        for p in trainer.ref_model.parameters()
    )
trainer._pi_old["train"] = trainer._pi_old["train"]._replace(
    kl="rollout" if sys.argv[2:] == ["separate-old-forward"] else "loss"
)  # the KL's pi_old from a forward of its own
trainer.train()
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(
        {
            "seen": seen,
            "log_history": trainer.state.log_history,
            "table": list(trainer._logs.prompt),
            "param_sum": sum(p.double().sum().item() for p in trainer.model.parameters()),
        },
        f,
    )
# As `rloo train` exits (rloo.cli.exit_without_native_teardown): the process group destroyed, then no interpreter
# finalization, where a gloo worker thread dropping a finished collective's tensors aborted a rank after both had
# written their results (see that function).
torch.distributed.destroy_process_group()
exit_without_native_teardown(0)
