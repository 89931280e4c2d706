"""`rloo_sweep`: an Optuna study over a pipeline config's keys, each trial a `rloo_pipeline` run of
its own (a subflow in Prefect), at most `sweep.parallel` at once (a global concurrency limit), the
losing ones pruned while they train. A rerun of the same sweep continues it: finished trials stay,
interrupted ones resume from their checkpoints, and the study ends with exactly n_trials trials."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Annotated

from prefect import flow
from prefect.runtime import flow_run
from pydantic import Field

from flows.pipeline import rloo_pipeline
from infra import stages, sweep, sweep_report, tracking
from infra.runconfig import load_run_config, shipped_sweeps
from infra.writer import sole_writer


class TrialFailed(RuntimeError):
    """Some trials did not finish; rerunning the sweep resumes them."""


async def _limit(name: str, slots: int) -> None:
    """The sweep's global concurrency limit, made afresh at `parallel` slots: only one orchestrator
    runs a sweep (its folder's lock), so slots still held are a killed orchestrator's."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectNotFound

    async with get_client() as client:
        try:
            await client.delete_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            pass
        await client.create_global_concurrency_limit(
            GlobalConcurrencyLimitCreate(name=name, limit=slots, active=True)
        )


@flow(name="rloo-sweep", log_prints=True)
async def rloo_sweep(
    recipe: Annotated[
        str,
        Field(
            json_schema_extra={"enum": shipped_sweeps()},
            description="A pipeline config with a `sweep:` section (configs/*.yaml; from the "
            "command line, any path).",
        ),
    ] = "configs/sweep-tiny.yaml",
    n_trials: Annotated[
        int | None,
        Field(
            ge=1, description="sweep.n_trials: trials in the study when done (empty: the config's)."
        ),
    ] = None,
    parallel: Annotated[
        int | None, Field(ge=1, description="sweep.parallel: trials at once (empty: the config's).")
    ] = None,
    overrides: list[str] = (),
) -> dict:
    """A sweep: trials of one config with keys drawn from its search space, pruned early, ranked by
    a held-out objective.

    Args:
        recipe: A pipeline config with a `sweep:` section.
        n_trials: Trials in the study when the sweep is done.
        parallel: Trials running at once.
        overrides: More key=value settings, e.g. sweep.objective=accuracy/numeric_accuracy_reward.
    """
    overrides = list(overrides) + [
        f"sweep.{key}={value}"
        for key, value in (("n_trials", n_trials), ("parallel", parallel))
        if value
    ]
    config = load_run_config(recipe, overrides)
    sweep.check_sweep(config)  # every trial's values, before any trial starts
    name = sweep.study_name(config)
    folder = sweep.sweep_dir(config.run_root, name)
    os.makedirs(folder, exist_ok=True)
    with sole_writer(folder, "refuse", str(flow_run.id) if flow_run.id else None):
        return await _run(config, recipe, overrides, folder)


async def _run(config, recipe: str, overrides: list[str], folder: str) -> dict:
    from prefect.concurrency.asyncio import concurrency

    name, settings = sweep.study_name(config), config.sweep
    tracking.check_reachable(config.tracking_uri)
    study = sweep.open_study(config)
    stages.write_json(
        os.path.join(folder, "sweep.json"),
        {
            "name": name,
            "recipe": os.path.abspath(recipe),
            "overrides": overrides,
            "storage": sweep.storage_url(config),
            "tracking_uri": config.tracking_uri,
            "experiment": config.tracking.experiment,
        },
    )
    run_id = tracking.sweep_run(
        config.tracking_uri, config.tracking.experiment, name, sweep_report.sweep_params(config)
    )
    limit = f"rloo-sweep-{name}"
    await _limit(limit, settings.parallel)
    states = sweep.trial_states(study)
    interrupted = [number for number, state in states.items() if state == "RUNNING"]
    fresh = settings.n_trials - len(states)
    print(
        f"[sweep] {name}: {len(states)} of {settings.n_trials} trials exist "
        f"({', '.join(f'{n} {s}' for s, n in sweep.count(states).items()) or 'none'}); "
        f"{len(interrupted)} to resume, {max(fresh, 0)} to start, {settings.parallel} at once. "
        f"Study: {sweep.storage_url(config)}"
    )
    lock = asyncio.Lock()  # one ask at a time: the sampler sees every earlier trial

    async def one(number: int | None) -> None:
        async with concurrency(limit, occupy=1, strict=True):
            async with lock:
                trial = sweep.ask(study, config) if number is None else sweep.resume(study, number)
            trial_overrides = sweep.trial_overrides(config, trial.number, trial.params)
            shown = ", ".join(
                f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                for k, v in sorted(trial.params.items())
            )
            print(
                f"[sweep] trial {trial.number} {'resumed' if number is not None else 'started'}"
                f": {shown}"
            )
            try:
                summary = await rloo_pipeline.with_options(
                    flow_run_name=sweep.trial_name(config, trial.number)
                )(recipe, overrides=list(overrides) + trial_overrides, if_running="wait")
            except Exception as err:
                sweep.record_failure(study, trial.number, err)
                print(
                    f"[sweep] trial {trial.number} interrupted ({type(err).__name__}: "
                    f"{str(err)[:200]}); rerun the sweep to resume it from its checkpoint"
                )
                raise
            async with lock:
                outcome = sweep.finish(study, config, trial.number, trial.params, summary)
            print(f"[sweep] trial {trial.number} {outcome}")

    results = await asyncio.gather(
        *[one(n) for n in interrupted],
        *[one(None) for _ in range(max(fresh, 0))],
        return_exceptions=True,
    )
    report = sweep_report.write(config, study, run_id, folder)
    failed = [r for r in results if isinstance(r, BaseException)]
    tracking.client(config.tracking_uri).set_terminated(
        run_id, status="FAILED" if failed else "FINISHED"
    )
    print(f"[sweep] {name}: {report['summary']}")
    if failed:
        raise TrialFailed(
            f"{len(failed)} trial(s) did not finish (first: {failed[0]}); rerun the "
            "same sweep command to resume them from their checkpoints."
        )
    return json.loads(json.dumps(report, default=str))
