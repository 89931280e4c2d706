"""Real torchrun processes (gloo, CPU): rewards gathered across ranks, groups straddling ranks; one process is not
wrapped in DDP."""

import json
import os
import subprocess
import sys

import pytest

from services import free_port

pytestmark = pytest.mark.slow


def test_two_process_training_gathers_rewards_across_ranks(tmp_path):
    script = os.path.join(os.path.dirname(__file__), "distributed_train.py")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            script,
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1)]
    # Each rank scores 3 rows; one prompt's group of 6 is split 3 + 3 across the two ranks.
    for step in range(2):
        tags0, tags1 = ranks[0]["seen"][step]["tags"], ranks[1]["seen"][step]["tags"]
        assert len(tags0) == len(tags1) == 3
        assert len(set(tags0)) == 1 and tags0 == tags1
        rewards = ranks[0]["seen"][step]["rewards"] + ranks[1]["seen"][step]["rewards"]
        logged = [log for log in ranks[0]["log_history"] if "reward" in log][step]
        assert logged["reward"] == pytest.approx(sum(rewards) / 6)  # global mean, not rank 0's
        assert logged["rank_metric"] == pytest.approx(0.5)  # log_metric averaged over ranks
        # Reward functions see the live step on every rank; no call before training.
        assert ranks[0]["seen"][step]["step"] == ranks[1]["seen"][step]["step"] == step
    assert len(ranks[0]["seen"]) == len(ranks[1]["seen"]) == 2
    # The completion table holds every rank's rows of the last generation (6 = the whole group).
    assert len(ranks[0]["table"]) == 6
    # DDP keeps the replicas identical.
    assert ranks[0]["param_sum"] == pytest.approx(ranks[1]["param_sum"], rel=1e-9)
    # The KL's pi_old taken from the loss's forward (the default here) is the separate old forward's, on both ranks.
    separate = tmp_path / "separate"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            script,
            str(separate),
            "separate-old-forward",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    for rank in (0, 1):
        other = json.load(open(separate / f"rank{rank}.json"))
        assert [log["kl"] for log in ranks[rank]["log_history"] if "kl" in log] == pytest.approx(
            [log["kl"] for log in other["log_history"] if "kl" in log], rel=1e-5, abs=1e-8
        )
        assert ranks[rank]["param_sum"] == pytest.approx(other["param_sum"], rel=1e-7)


ONE_PROCESS = """
from datasets import Dataset
from rloo import RLOOConfig, RLOOTrainer
from rloo.tiny import tiny_causal_lm, tiny_tokenizer
tokenizer = tiny_tokenizer()
data = Dataset.from_list([{"prompt": [{"role": "user", "content": w}]} for w in ["a b", "c d"] * 4])
args = RLOOConfig(output_dir=OUT, use_cpu=True, bf16=False, per_device_train_batch_size=4, num_generations=2,
                  max_completion_length=4, max_steps=1, report_to="none", save_strategy="no", disable_tqdm=True)
trainer = RLOOTrainer(model=tiny_causal_lm(tokenizer), reward_funcs=lambda completion_ids, **k: [1.0, 2.0] * 2,
                      args=args, train_dataset=data, processing_class=tokenizer)
trainer.train()
print("WRAPPER", type(trainer.model_wrapped).__name__, trainer.accelerator.num_processes)
"""


def test_one_torchrun_process_trains_without_a_ddp_wrapper(tmp_path):
    """torchrun --nproc_per_node 1 (the pipeline's local job): accelerate would wrap the model in a one-process DDP
    (an all-reduce per backward, and no shared prompts through the wrapper); the trainer drops that wrapper."""
    script = tmp_path / "one.py"
    script.write_text(f"OUT = {str(tmp_path / 'out')!r}\n" + ONE_PROCESS)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "1",
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "WRAPPER LlamaForCausalLM 1" in result.stdout
    assert "find_unused_parameters" not in result.stderr  # (DDP's warning in every such job's log)


FREEZE_RANK_1 = """
import os, time
from datasets import Dataset
from rloo import RLOOConfig, RLOOTrainer
from rloo.tiny import tiny_causal_lm, tiny_tokenizer

def reward(completion_ids, trainer_state, **kwargs):
    if trainer_state.global_step == 1 and int(os.environ["RANK"]) == 1:
        time.sleep(600)  # frozen in step 2: rank 0 waits for its rewards in a collective
    return [1.0, 2.0]

tokenizer = tiny_tokenizer()
data = Dataset.from_list([{"prompt": [{"role": "user", "content": w}]} for w in ["a b", "c d"] * 8])
args = RLOOConfig(output_dir=OUT, use_cpu=True, bf16=False, per_device_train_batch_size=2, num_generations=2,
                  max_completion_length=4, max_steps=3, report_to="none", save_strategy="no", disable_tqdm=True,
                  ddp_backend="gloo", stall_timeout_s=3)
trainer = RLOOTrainer(model=tiny_causal_lm(tokenizer), reward_funcs=reward, args=args, train_dataset=data,
                      processing_class=tokenizer)
trainer.train()
"""


def test_a_frozen_rank_fails_the_job_with_a_report_from_each_rank(tmp_path):
    """Rank 1 freezes in its reward call of step 2 while rank 0 waits for it in a collective: each rank's watchdog
    fails the step within stall_timeout_s and writes its own report (rank 1: where it is stuck; rank 0: what it
    waits in), and the job exits instead of hanging. The pipeline quotes both."""
    import time

    from infra.jobs import stall_cause
    from rloo.watchdog import STALLED_EXIT_CODE, report_path

    script = tmp_path / "freeze.py"
    out = tmp_path / "out"
    script.write_text(f"OUT = {str(out)!r}\n" + FREEZE_RANK_1)
    started = time.time()
    job = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    output = job.stdout + job.stderr
    assert job.returncode != 0 and (
        f"exitcode  : {STALLED_EXIT_CODE}" in output or "TrainingStalled" in output
    ), output[-3000:]
    stuck, waiting = open(report_path(str(out), 1)).read(), open(report_path(str(out), 0)).read()
    assert (
        "training stalled: rank 1 made no progress for 3 s (stall_timeout_s) in step 2, waiting in "
        "train > rewards" in stuck
    )
    assert (
        "training stalled: rank 0 made no progress for 3 s (stall_timeout_s) in step 2, waiting in"
        in waiting
    )
    for rank, report, own in ((1, stuck, "freeze.py"), (0, waiting, "rloo/")):
        # every process of the machine named (the other one may be exiting by then), its own stack
        # in full: rank 1 in its reward call, rank 0 in the trainer's code that waits for it
        assert "--- rank0 (pid" in report and "--- rank1 (pid" in report
        assert own in report.split(f"--- rank{rank} (pid")[1].split("--- rank")[0]
    cause = stall_cause(str(out), started)
    assert "rank 0 made no progress" in cause and "rank 1 made no progress" in cause
