"""`rloo_promote`: register a run's trained policy in MLflow, gate it against the champion on the
same held-out prompts, wait for a person's approval (a typed Prefect input form), publish it to the
Hub, move `champion`. A failed gate or a rejection leaves `champion` where it was; a failed upload
too, and a retry finishes it."""

from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_link_artifact, create_markdown_artifact
from prefect.flow_runs import pause_flow_run
from prefect.input import RunInput
from pydantic import Field

from infra import promotion, publish


class Approval(RunInput):
    """Publish this candidate to the Hub and make it the champion?"""

    approve: bool = Field(
        False, description="Approve: publish to the Hub, then move the champion alias to it."
    )
    comment: str = Field("", description="Why (kept on the model version).")


PAUSE_KEY = "approval"


def wait_for_approval(report: str, timeout_s: int) -> Approval:
    """Pause with the typed form (the gate's report as its description) until someone answers. When
    the Prefect API goes away meanwhile (longer than the client's own retries), keep waiting for it
    to come back and read the answer then: the flow run stays paused on the server and can be
    answered later."""
    import time

    from prefect.exceptions import FlowPauseTimeout

    deadline = time.time() + timeout_s
    try:
        return pause_flow_run(
            wait_for_input=Approval.with_initial_data(
                description=f"{report}\n\nApprove to publish it to the Hub and move `champion`.",
                approve=False,
            ),
            timeout=timeout_s,
            poll_interval=5,
            key=PAUSE_KEY,
        )
    except FlowPauseTimeout:
        raise
    except Exception as err:  # the API is unreachable (connection refused, 5xx after retries)
        print(
            "[promote] the Prefect API went away while waiting for approval "
            f"({type(err).__name__}); waiting for it to come back"
        )
    from prefect.client.orchestration import get_client
    from prefect.input.run_input import keyset_from_base_key
    from prefect.runtime import flow_run

    while time.time() < deadline:
        time.sleep(5)
        try:
            with get_client(sync_client=True) as client:
                state = client.read_flow_run(flow_run.id).state
            if state is not None and state.is_running():  # answered
                return Approval.load(
                    keyset_from_base_key(f"paused-{PAUSE_KEY}"), flow_run_id=flow_run.id
                )
        except Exception:
            continue  # still away
    raise FlowPauseTimeout("nobody answered the promotion's approval in time")


def flow_run_name(run: str, checkpoint: str) -> str:
    suffix = {"best": "", "last": "-last"}.get(str(checkpoint), f"-step{checkpoint}")
    return f"promote-{run}{suffix}"


@flow(name="rloo-promote", log_prints=True)
def rloo_promote(
    config_path: str = Field(description="The run's config (runs/<run>/config.yaml)."),
    checkpoint: str = Field(
        "best",
        pattern=r"^(best|last|[1-9][0-9]*)$",
        description="best: the checkpoint with the highest held-out promotion.metric; last: the "
        "final model; or a checkpoint's step.",
    ),
    approved: bool = Field(
        False, description="Approval given up front (rloo-pipeline promote --approve)."
    ),
    comment: str = Field("", description="The approver's comment."),
    overrides: list[str] = Field(
        default_factory=list, description="promotion.* overrides, e.g. promotion.min_gain=0.05"
    ),
) -> dict:
    config = promotion.load_config(config_path, overrides)
    candidate = promotion.prepare(config, checkpoint)
    done = promotion.already_promoted(candidate)
    if done is not None:
        print(
            f"[promote] {config.run_key} ({candidate.checkpoint}) is already the champion: "
            f"{config.registered_model} v{done.version} at {done.tags.get('hub.url')}; nothing to "
            "do."
        )
        return {
            "status": "already promoted",
            "version": str(done.version),
            "url": done.tags.get("hub.url"),
        }
    metrics = promotion.candidate_metrics(candidate)
    version = promotion.register(candidate, metrics)
    print(f"[promote] registered {config.registered_model} v{version} (alias candidate)")
    verdict, report = promotion.judge(candidate, version, metrics)
    create_markdown_artifact(
        report, key=f"{config.name}-promotion", description=f"Promotion gate of {config.run_key}"
    )
    check = next(detail for rule, _, detail in verdict.checks if rule == verdict.decided_by)
    print(
        f"[promote] gate {'passed' if verdict.passed else 'FAILED'} ({verdict.decided_by}: {check})"
    )
    base = {
        "version": version,
        "report": f"{promotion.promotion_dir(candidate, version)}/promotion.md",
    }
    if not verdict.passed:
        promotion.record_decision(candidate, version, "gate failed")
        return {"status": "gate failed", "decided_by": verdict.decided_by, **base}
    if config.promotion.approval_required() and not approved:
        print(
            "[promote] waiting for approval: the Prefect UI's flow run, or rloo-pipeline promote "
            f"{config.run_key} --run-root {config.run_root} --approve (or --reject)"
        )
        answer = wait_for_approval(report, config.promotion.approval_timeout_s)
        approved, comment = answer.approve, answer.comment
        if not approved:
            promotion.record_decision(candidate, version, "rejected", comment)
            print(f"[promote] rejected{': ' + comment if comment else ''}; champion unchanged")
            return {"status": "rejected", **base}
    promotion.record_decision(candidate, version, "approved", comment)
    result = publish.publish(candidate, version, metrics)
    create_link_artifact(
        result["url"], link_text=f"{result['repo']} @ {result['tag']}", key=f"{config.name}-hub"
    )
    print(
        f"[promote] published {result['repo']} commit {result['commit']} (tag {result['tag']}"
        f"{'' if result['uploaded'] else ', upload found from an earlier attempt'}); champion -> "
        f"v{version}"
    )
    return {**result, **base}
