"""`rloo-pipeline`: run, validate, sweep, status, resume, compare, promote, ui, serve, sync."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

from flows.prefect_api import DEFAULT_ROOT, EphemeralApi, known_run_root, prefect_environment


def _load(config_path: str, assignments: list[str]):
    from infra.runconfig import load_run_config

    return load_run_config(config_path, assignments)


def cmd_validate(options) -> int:
    from infra.stages import check_config

    config = _load(options.config, options.set)
    rows = check_config(config, read_rows=True)
    if config.sweep is not None:
        from infra.sweep import check_sweep, study_name

        check_sweep(config)
        print(
            f"sweep {study_name(config)}: {config.sweep.n_trials} trials over "
            f"{', '.join(config.sweep.space)} ({config.sweep.parallel} at once), objective "
            f"{config.sweep.objective_set} {config.sweep.objective} ({config.sweep.direction})"
        )
    print(
        f"valid: {options.config} -> run {config.run_key} in {config.run_dir}"
        + (
            ""
            if rows
            else f" (the rows of {config.data.source} are checked when the dataset stage loads "
            "them)"
        )
    )
    return 0


def cmd_run(options, config_path: str | None = None, assignments: list[str] | None = None) -> int:
    config_path = config_path or options.config
    assignments = assignments if assignments is not None else options.set
    api = EphemeralApi()
    if (early_root := known_run_root(config_path, assignments)) is not None:
        api.start(early_root)
    # when this fails, the API started early is stopped at exit, once up
    config = _load(config_path, assignments)
    if early_root is not None and os.path.abspath(config.run_root) != os.path.abspath(early_root):
        raise RuntimeError(
            f"run root read early ({early_root}) differs from the config's ({config.run_root})"
        )
    return _run_checked(options, config, config_path, assignments, api)


def _run_checked(
    options, config, config_path: str, assignments: list[str], api: EphemeralApi
) -> int:
    from flows import console
    from infra.checkpoints import best
    from infra.stages import check_config
    from infra.tracking import check_reachable, experiment_id, models_link

    check_config(config, read_rows=False)  # the rows: in the dataset stage, which reads them anyway
    local_store = config.tracking_uri.startswith("sqlite:")
    if not local_store:
        check_reachable(config.tracking_uri)  # a server: fails fast, before anything starts
    from infra.writer import wait_until_free

    # the flow holds the lock; this fails (or waits) early
    wait_until_free(config.run_dir, options.if_running)
    # valid: third-party lines go to pipeline.log from now on (before MLflow creates its tables)
    console.quiet(config.run_root)
    api.start(config.run_root)  # (already started when the run root was known early)
    if local_store:  # a new SQLite store creates its tables here (seconds), while the API starts
        check_reachable(config.tracking_uri)
    from flows.pipeline import rloo_pipeline

    api.wait_ready()
    console.quiet(config.run_root)  # again: Prefect configured its logging since
    start = time.time()
    try:
        summary = asyncio.run(
            rloo_pipeline(config_path, if_running=options.if_running, overrides=assignments)
        )
    except Exception as err:
        if not _prefect_unreachable(err):
            raise
        root = "" if config.run_root == DEFAULT_ROOT else f" --run-root {config.run_root}"
        api = os.environ.get("PREFECT_API_URL") or "the ephemeral one"
        print(
            f"rloo-pipeline {options.command}: error: the Prefect API ({api}) went away "
            f"({type(err).__name__}: {str(err)[:120]}). A training job already started trains on; "
            f"when the API is back, `rloo-pipeline resume {config.run_key}{root}` picks the run "
            "up.",
            file=sys.stderr,
        )
        return 1
    evaluation = summary.get("evaluate") or {}
    print("")
    print(f"Done in {time.time() - start:.0f} s: {summary['run_dir']}")
    if evaluation:
        print(
            f"  held-out reward: base {evaluation['base']['reward']:.3f} -> trained "
            f"{evaluation['trained']['reward']:.3f} ({evaluation['reward_gain']:+.3f}); report "
            f"{evaluation['report_path']}"
        )
        table, metric = evaluation.get("checkpoints") or [], config.promotion.metric
        if len(table) > 1 and (top := best(table, metric)) is not None:
            models = models_link(
                config.tracking_uri, experiment_id(config.tracking_uri, config.tracking.experiment)
            )
            print(
                f"  best of {len(table)} evaluated checkpoints on held-out {metric}: "
                f"{top['name']} ({top['held_out'][metric]:.3f}); ranked in MLflow: {models}"
            )
    print(f"  MLflow run {summary['mlflow_run_id']} in {config.tracking_uri}")
    print(
        f"  Browse both UIs: rloo-pipeline ui --run-root {config.run_root}   (Prefect :4200, "
        f"MLflow :5000 -> {summary['mlflow_link']})"
    )
    root = "" if config.run_root == DEFAULT_ROOT else f" --run-root {config.run_root}"
    print(
        f"  Next: rloo-pipeline promote {config.run_key}{root}   (registry, gate, Hub); "
        f"rloo-pipeline serve{root}   (start runs from the UI)"
    )
    return 0


def cmd_sweep(options) -> int:
    """A sweep on the embedded default (an ephemeral Prefect API under the run root) or against
    PREFECT_API_URL, like `run`."""
    from flows import console
    from infra.sweep import check_sweep

    api = EphemeralApi()
    config = _load(options.config, options.set)
    check_sweep(config)  # every trial's values, before anything starts
    console.quiet(config.run_root)
    api.start(config.run_root)
    from flows.sweep import TrialFailed, rloo_sweep

    api.wait_ready()
    console.quiet(config.run_root)
    start = time.time()
    try:
        report = asyncio.run(rloo_sweep(options.config, overrides=options.set))
    except TrialFailed as err:
        print(f"rloo-pipeline sweep: {err}", file=sys.stderr)
        return 1
    print(f"\nDone in {time.time() - start:.0f} s: {report['summary']}")
    root = "" if config.run_root == DEFAULT_ROOT else f" --run-root {config.run_root}"
    from infra.sweep import study_name

    print(
        f"  Next: rloo-pipeline compare --sweep {study_name(config)}{root}   (trials ranked); "
        f"rloo-pipeline promote --sweep {study_name(config)}{root}   (the best trial's best "
        "checkpoint through the gate)"
    )
    return 0


def _sweep_study(run_root: str, name: str):
    """(the sweep's record, its study) from `rloo-pipeline sweep`'s folder under the run root."""
    from infra import stages
    from infra.sweep import quiet_optuna, sweep_dir

    record = stages.read_json(os.path.join(sweep_dir(run_root, name), "sweep.json"))
    if record is None:
        sweeps = os.path.join(run_root, "sweeps")
        known = sorted(os.listdir(sweeps)) if os.path.isdir(sweeps) else []
        raise FileNotFoundError(
            f"no sweep {name!r} under {run_root} (sweeps: {', '.join(known) or 'none'})."
        )
    import optuna

    quiet_optuna()
    return record, optuna.load_study(study_name=name, storage=record["storage"])


def cmd_compare_sweep(options) -> int:
    from rich.console import Console
    from rich.table import Table

    from infra import sweep_report, tracking

    record, study = _sweep_study(options.run_root, options.sweep)
    objective = study.user_attrs.get("rloo.objective", "objective")
    columns, body = sweep_report.table(sweep_report.ranked(study), objective)
    table = Table(
        title=f"sweep {options.sweep}: trials ranked by {objective} "
        f"({study.direction.name.lower()})"
    )
    for column in columns:  # whole names: they are what a person copies into a config
        table.add_column(column, min_width=len(column) if column != "run" else 30)
    for cells in body:
        table.add_row(*cells)
    Console(width=max(120, sum(max(len(c), 12) + 3 for c in columns) + 30)).print(table)
    uri, experiment = record["tracking_uri"], record["experiment"]
    run_id = tracking.sweep_run(uri, experiment, options.sweep)
    print(
        f"MLflow: {tracking.run_link(uri, tracking.experiment_id(uri, experiment), run_id)}   "
        "(the sweep's run, one child run per trial)"
    )
    return 0


def best_trial_run(run_root: str, name: str) -> tuple[str, str]:
    """(run key, checkpoint) of a sweep's best finished trial: its best evaluated checkpoint, as
    --checkpoint takes it (a step, or last for the final model)."""
    from infra import sweep_report

    _, study = _sweep_study(run_root, name)
    complete = [row for row in sweep_report.ranked(study) if row["state"] == "COMPLETE"]
    if not complete:
        raise FileNotFoundError(f"sweep {name!r} has no finished trial to promote yet.")
    top = complete[0]
    return top["run_key"], "last" if top["checkpoint"] == "final" else str(top["step"])


def _prefect_unreachable(err: BaseException) -> bool:
    import httpx

    while err is not None:
        unreachable = isinstance(err, (httpx.ConnectError, httpx.ConnectTimeout))
        if unreachable or "Failed to reach API" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


def _run_dirs(run_root: str) -> list[str]:
    if not os.path.isdir(run_root):
        return []
    return sorted(
        d for d in os.listdir(run_root) if os.path.exists(os.path.join(run_root, d, "config.json"))
    )


def _stage_states(run_root: str, run: str) -> dict[str, str]:
    """Per stage: 'done' when its persisted result matches the config and stage version (what a
    resume skips), 'stale' when it is from another version, '-' when absent; how often its body ran
    when more than once; a running training job's state."""
    from collections import Counter

    from infra import stages
    from infra.launch import JobHandle, job_state
    from infra.runconfig import load_run_config

    run_dir = os.path.join(run_root, run)
    config = load_run_config(_run_config_file(run_root, run))
    runs = Counter(stages.executions(config))
    states = {}
    for stage in stages.STAGE_VERSIONS:
        done = stages.load_stage_result(config, stage) is not None
        state = (
            "done"
            if done
            else (
                "stale" if os.path.exists(os.path.join(run_dir, "stages", f"{stage}.json")) else "-"
            )
        )
        states[stage] = state + (f" (ran {runs[stage]}x)" if runs[stage] > 1 else "")
    job = os.path.join(run_dir, "train", "job.json")
    if not states["train"].startswith("done") and os.path.exists(job):
        with open(job) as handle:
            state, _ = job_state(JobHandle.from_dict(json.load(handle)["handle"]))
        states["train"] = state.lower()
    return states


def cmd_status(options) -> int:
    from rich.console import Console
    from rich.table import Table

    from infra.job_tracking import read_metrics

    runs = [options.run] if options.run else _run_dirs(options.run_root)
    if not runs:
        print(f"no runs under {options.run_root}")
        return 0
    table = Table(title=f"runs in {options.run_root}")
    for column in ("run", "dataset", "model", "train", "evaluate", "steps", "held-out gain"):
        table.add_column(column)
    for run in runs:
        run_dir = os.path.join(options.run_root, run)
        if not os.path.isdir(run_dir):
            raise FileNotFoundError(f"no run {run!r} under {options.run_root}")
        states = _stage_states(options.run_root, run)
        steps = gain = "-"
        if lines := read_metrics(os.path.join(run_dir, "train")):
            steps = str(max(line.get("step", 0) for line in lines))
        evaluation = os.path.join(run_dir, "eval", "metrics.json")
        if os.path.exists(evaluation):
            with open(evaluation) as handle:
                value = json.load(handle).get("reward_gain")
            gain = "-" if value is None else f"{value:+.3f}"
        table.add_row(run, *states.values(), steps, gain)
    Console().print(table)
    return 0


def _run_config_file(run_root: str, run: str) -> str:
    """The resolved config of a run, as a recipe the pipeline can load again (same fingerprint)."""
    import yaml

    path = os.path.join(run_root, run, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"no run {run!r} under {run_root} (rloo-pipeline status lists them)."
        )
    with open(path) as handle:
        config = json.load(handle)["config"]
    recipe = os.path.join(run_root, run, "config.yaml")
    with open(recipe, "w") as handle:
        yaml.safe_dump(config, handle, sort_keys=False)
    return recipe


def cmd_resume(options) -> int:
    return cmd_run(options, _run_config_file(options.run_root, options.run), [])


def cmd_compare(options) -> int:
    if options.sweep:
        return cmd_compare_sweep(options)
    from rich.console import Console
    from rich.table import Table

    from infra.compare import compare
    from infra.runconfig import load_run_config

    runs = options.runs or _run_dirs(options.run_root)
    if not runs:
        print(f"no runs under {options.run_root}")
        return 0
    configs = {run: load_run_config(_run_config_file(options.run_root, run)) for run in runs}
    result = compare(
        configs, os.path.join(options.run_root, "comparisons", "-vs-".join(runs)[:200])
    )
    console = Console(width=max(120, 40 + 24 * len(runs)))
    table = Table(title="config differences")
    for column in ("key", *runs):
        table.add_column(column)
    for key, values in result["differences"].items():
        table.add_row(key, *[str(values[run]) for run in runs])
    console.print(table)
    table = Table(title="held-out evaluation (MLflow) and run tags")
    for column in ("", *runs):
        table.add_column(column)
    names = sorted({name for values in result["metrics"].values() for name in values})
    for name in names:
        table.add_row(
            name,
            *[
                f"{result['metrics'][run][name]:.3f}" if name in result["metrics"][run] else "-"
                for run in runs
            ],
        )
    for tag in ("rloo.recipe", "rloo.model", "rloo.promoted"):
        table.add_row(tag, *[result["tags"][run].get(tag, "-") for run in runs])
    console.print(table)
    print(
        f"reward curves: {result['plot'] or '(no training metrics)'} (also in MLflow run "
        f"{result['comparison_run']})"
    )
    print(f"MLflow comparison: {result['link']}")
    return 0


def _paused_promotion(name: str):
    """The promotion flow run of that name waiting for approval, or None."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterName,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType

    async def find():
        async with get_client() as client:
            runs = await client.read_flow_runs(
                flow_run_filter=FlowRunFilter(
                    name=FlowRunFilterName(any_=[name]),
                    state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.PAUSED])),
                )
            )
        return runs[0] if runs else None

    return asyncio.run(find())


def cmd_promote(options) -> int:
    if options.sweep:
        if options.run:
            raise FileNotFoundError("give a run or --sweep NAME, not both.")
        options.run, checkpoint = best_trial_run(options.run_root, options.sweep)
        if options.checkpoint not in ("best", checkpoint):
            raise FileNotFoundError(
                f"--sweep promotes the best trial's best checkpoint "
                f"({checkpoint}); drop --checkpoint {options.checkpoint}."
            )
        options.checkpoint = checkpoint
        print(f"sweep {options.sweep}: best trial is {options.run}, checkpoint {checkpoint}")
    elif not options.run:
        raise FileNotFoundError(
            "promote what? Give a run (rloo-pipeline status lists them) or --sweep NAME."
        )
    prefect_environment(options.run_root)
    from flows.promote import flow_run_name, rloo_promote
    from infra.promotion import PromotionError, load_config, parse_checkpoint

    config_path = _run_config_file(options.run_root, options.run)
    load_config(config_path, options.set)  # a bad setting: an error now, before Prefect starts
    try:
        options.checkpoint = parse_checkpoint(options.checkpoint)
    except PromotionError as err:
        print(f"rloo-pipeline promote: error: {err}", file=sys.stderr)
        return 2
    name = flow_run_name(options.run, options.checkpoint)
    if options.approve or options.reject:
        waiting = _paused_promotion(name)
        if waiting is not None:
            from prefect.flow_runs import resume_flow_run

            resume_flow_run(
                waiting.id, run_input={"approve": bool(options.approve), "comment": options.comment}
            )
            print(
                f"{'approved' if options.approve else 'rejected'}: flow run {waiting.name} "
                f"({waiting.id}) resumes"
            )
            return 0
        if options.reject:
            raise FileNotFoundError(
                f"no promotion of {options.run} is waiting for approval (rloo-pipeline promote "
                f"{options.run} starts one)."
            )
    try:
        result = rloo_promote.with_options(flow_run_name=name)(
            config_path, options.checkpoint, bool(options.approve), options.comment, options.set
        )
    except PromotionError as err:
        print(f"rloo-pipeline promote: error: {err}", file=sys.stderr)
        return 2
    # e.g. the Hub unreachable or failing mid-upload: nothing moved, a rerun retries
    except Exception as err:
        print(
            f"rloo-pipeline promote: failed ({type(err).__name__}: {str(err)[:300]}); the champion "
            "alias is unchanged. Run the same command again to retry.",
            file=sys.stderr,
        )
        return 1
    print(
        f"{result['status']}: "
        + ", ".join(
            f"{key} {result[key]}"
            for key in ("version", "repo", "commit", "url", "report")
            if result.get(key)
        )
    )
    return 1 if result["status"] == "gate failed" else 0


def cmd_sync(options) -> int:
    from infra import job_tracking, tracking
    from infra.runconfig import load_run_config

    config = load_run_config(_run_config_file(options.run_root, options.run))
    train_dir = os.path.join(config.run_dir, "train")
    with open(os.path.join(train_dir, "job.json")) as handle:
        run_id = json.load(handle)["mlflow_run_id"]
    before = job_tracking.pending_count(train_dir)
    tracking.check_reachable(config.tracking_uri)
    ok = job_tracking.flush_pending(train_dir, config.tracking_uri, run_id)
    after = job_tracking.pending_count(train_dir)
    print(f"uploaded {before - after} pending item(s) to MLflow run {run_id}; {after} left")
    return 0 if ok else 1


def cmd_ui(options) -> int:
    from flows import serve

    env = serve.service_environment(
        options.run_root,
        options.prefect_port,
        options.mlflow_port,
        options.prefect_db,
        options.mlflow_db,
    )
    processes = serve.start_servers(
        options.run_root, options.prefect_port, options.mlflow_port, env, options.mlflow_workers
    )
    with serve.running(processes):
        print(
            f"Prefect UI: http://127.0.0.1:{options.prefect_port}   MLflow UI: "
            f"http://127.0.0.1:{options.mlflow_port}   (logs in "
            f"{os.path.abspath(options.run_root)}/.logs; Ctrl-C stops both)",
            flush=True,
        )
        serve.wait_any(processes)
    return 0


def cmd_serve(options) -> int:
    from flows import serve

    env = serve.service_environment(
        options.run_root,
        options.prefect_port,
        options.mlflow_port,
        options.prefect_db,
        options.mlflow_db,
    )
    processes = serve.start_servers(
        options.run_root, options.prefect_port, options.mlflow_port, env, options.mlflow_workers
    )
    with serve.running(processes):
        from infra.jobs import wait_for_health

        wait_for_health(
            f"{env['PREFECT_API_URL']}/health",
            180,
            "the Prefect server",
            alive=lambda: processes[0].poll() is None,
        )
        serve.deploy(env, options.stall_alert_minutes * 60)
        processes.append(serve.start_worker(env))
        ui = f"http://127.0.0.1:{options.prefect_port}"
        print(
            f"Prefect UI: {ui}   deployments: {ui}/v2/deployments   work pool '{serve.POOL}' with "
            f"a worker (its flow runs below)\nMLflow UI: http://127.0.0.1:{options.mlflow_port}   "
            f"runs in {env['RLOO_RUN_ROOT']}   server logs in {env['RLOO_RUN_ROOT']}/.logs   "
            "(Ctrl-C stops everything)",
            flush=True,
        )
        serve.wait_any(processes)
    return 0


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number, 1 or more")
    return int(text)


def _if_running_option(command) -> None:
    command.add_argument(
        "--if-running",
        choices=("refuse", "wait"),
        default="refuse",
        help="when another process is writing this run's directory (the same config): refuse "
        "(default) or wait for it to finish",
    )


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(
        prog="rloo-pipeline", description="The RLOO pipeline (Prefect + MLflow)."
    )
    commands = root.add_subparsers(dest="command", required=True)
    for name, helptext in (
        ("run", "run the pipeline on a config"),
        ("validate", "check a config, no compute"),
    ):
        command = commands.add_parser(name, help=helptext)
        command.add_argument("config")
        command.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a config key, e.g. --set training.max_steps=20",
        )
        if name == "run":
            _if_running_option(command)
    for name, helptext in (
        ("status", "stage states of the runs"),
        ("resume", "run a run's pipeline again (finished stages are skipped)"),
        ("sync", "upload metrics kept while MLflow was unreachable"),
    ):
        command = commands.add_parser(name, help=helptext)
        command.add_argument("run", nargs="?" if name == "status" else None)
        command.add_argument("--run-root", default=DEFAULT_ROOT)
        if name == "resume":
            _if_running_option(command)
    compare = commands.add_parser(
        "compare",
        help="config differences, held-out metrics and reward curves of runs (from MLflow)",
    )
    compare.add_argument("runs", nargs="*")
    compare.add_argument("--run-root", default=DEFAULT_ROOT)
    compare.add_argument(
        "--sweep",
        metavar="NAME",
        help="a sweep's trials ranked by its objective, the keys that differ",
    )
    sweep = commands.add_parser(
        "sweep",
        help="trials of a config's `sweep:` section (Optuna), in parallel, pruned "
        "early; rerun to continue",
    )
    sweep.add_argument("config")
    sweep.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set sweep.n_trials=16",
    )
    promote = commands.add_parser(
        "promote",
        help="register a run's policy, gate it against the champion, publish "
        "it to the Hub after approval",
    )
    promote.add_argument("run", nargs="?")
    promote.add_argument("--run-root", default=DEFAULT_ROOT)
    promote.add_argument(
        "--sweep", metavar="NAME", help="promote the best trial of this sweep (its best checkpoint)"
    )
    promote.add_argument(
        "--checkpoint",
        default="best",
        help="best (default: the highest held-out promotion.metric of the evaluated "
        "checkpoints), last (the final model) or a checkpoint's step",
    )
    answer = promote.add_mutually_exclusive_group()
    answer.add_argument(
        "--approve", action="store_true", help="answer a waiting promotion (or approve up front)"
    )
    answer.add_argument("--reject", action="store_true", help="reject a waiting promotion")
    promote.add_argument("--comment", default="", help="why (kept on the model version)")
    promote.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a promotion setting, e.g. --set promotion.min_gain=0.05",
    )
    for name, helptext in (
        ("ui", "start the Prefect and MLflow UIs on 127.0.0.1"),
        (
            "serve",
            "the UIs plus prefect.yaml's deployments and a worker: start and schedule runs from "
            "the Prefect UI",
        ),
    ):
        ui = commands.add_parser(name, help=helptext)
        ui.add_argument("--run-root", default=DEFAULT_ROOT)
        ui.add_argument("--prefect-port", type=int, default=4200)
        ui.add_argument("--mlflow-port", type=int, default=5000)
        ui.add_argument(
            "--mlflow-workers",
            type=_positive_int,
            default=1,
            help="the MLflow server's worker processes (default 1; raise it for many clients)",
        )
        ui.add_argument(
            "--prefect-db",
            metavar="URL",
            help="the Prefect server's database: postgresql://user@host:port/db "
            "(default $RLOO_PREFECT_DB, else SQLite under the run root)",
        )
        ui.add_argument(
            "--mlflow-db",
            metavar="URL",
            help="MLflow's backend store: postgresql://user@host:port/db (default "
            "$RLOO_MLFLOW_DB, else SQLite under the run root); runs track into it",
        )
        if name == "serve":
            ui.add_argument(
                "--stall-alert-minutes",
                type=float,
                default=30.0,
                help="flag a run Stalled in the UI after this long without a step",
            )
    return root


def main(argv: list[str] | None = None) -> int:
    options = parser().parse_args(argv)
    from flows import console

    console.before_imports()
    handlers = {
        "run": cmd_run,
        "validate": cmd_validate,
        "status": cmd_status,
        "resume": cmd_resume,
        "compare": cmd_compare,
        "sync": cmd_sync,
        "ui": cmd_ui,
        "serve": cmd_serve,
        "promote": cmd_promote,
        "sweep": cmd_sweep,
    }
    from infra.jobs import TrainingFailed
    from infra.runconfig import ConfigError
    from infra.tracking import TrackingUnavailable
    from infra.writer import RunDirBusy

    try:
        return handlers[options.command](options)
    except (ConfigError, TrackingUnavailable, FileNotFoundError, RunDirBusy) as err:
        print(f"rloo-pipeline {options.command}: error: {err}", file=sys.stderr)
        return 2
    # the job died (killed, OOM, a node lost): what it saved is resumable
    except TrainingFailed as err:
        print(
            f"rloo-pipeline {options.command}: error: {err}\n  `rloo-pipeline resume RUN` trains "
            "on from the last complete checkpoint (`rloo-pipeline status` lists the "
            "runs).",
            file=sys.stderr,
        )
        return 1


def entry() -> None:
    """The `rloo-pipeline` command: main(), then an exit that skips the native teardown (seconds
    after torch)."""
    from rloo.process import exit_without_native_teardown

    exit_without_native_teardown(main())


if __name__ == "__main__":
    entry()
