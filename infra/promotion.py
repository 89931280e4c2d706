"""Promotion of a run's trained policy (`rloo-pipeline promote`, flows/promote.py): checks that need
nothing registered (`prepare`), registration as an MLflow model version with the alias `candidate`
(`register`), the evidence gate against the current `champion` on the same held-out prompts (`gate`,
`judge`, the promotion.md report), and publication to the Hub followed by the move of `champion`
(`publish`). Each step can be retried: an upload that went through is found again (the Hub tag, the
run directory's record) and never repeated."""

from __future__ import annotations

import dataclasses
import os

from infra import checkpoints, evaluation, stages, tracking
from infra.runconfig import ConfigError, RunConfig, load_run_config
from rloo.checkpoint import is_complete
from rloo.hub import HfHubPublisher, get_publisher

# model aliases with a public counterpart
HUB_IDS = {"smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct"}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)


class PromotionError(ValueError):
    """A problem found before anything is registered or uploaded, named with its fix."""


@dataclasses.dataclass
class Candidate:
    config: RunConfig
    weights: str  # the folder with the adapter or the full weights
    step: int
    checkpoint: str  # "final" or "checkpoint-N"
    adapter: bool
    policy: str  # the base model the adapter applies to (the model stage's policy)
    tokenizer: str | None
    evaluation: dict
    rows: list
    eval_fingerprint: str
    parent_run_id: str
    model_id: str  # the checkpoint's LoggedModel (the registry version points at it)
    train_run_id: str  # the train stage's run, the LoggedModel's source
    reason: str  # why this checkpoint: the model card and the gate's report say it
    table: list  # every evaluated checkpoint's held-out metrics (the evaluate stage's table)
    metrics: dict | None  # its held-out metrics, when the evaluate stage scored it

    @property
    def hub_tag(self) -> str:
        key = self.config.run_key
        return key if self.checkpoint == "final" else f"{key}-step{self.step}"

    @property
    def identity(self) -> dict[str, str]:
        return {"rloo.run_key": self.config.run_key, "rloo.checkpoint": self.checkpoint}


@dataclasses.dataclass
class Verdict:
    passed: bool
    decided_by: str
    checks: list  # (rule, passed, detail)


def load_config(config_path: str, overrides: list[str]) -> RunConfig:
    """A finished run's config with promotion.* overrides (anything else would name another run)."""
    for assignment in overrides:
        if not assignment.startswith("promotion."):
            raise ConfigError(
                f"--set {assignment!r}: only promotion.* settings can change at promotion (the "
                "rest is the run's identity)."
            )
    return load_run_config(config_path, overrides)


def _uses_hub() -> bool:

    return isinstance(get_publisher(), HfHubPublisher)


def parse_checkpoint(value: str | int | None) -> str:
    """`--checkpoint`: 'best' (the default), 'last' (the final model) or a checkpoint's step."""
    text = "best" if value is None else str(value).strip()
    if text in ("best", "last") or (text.isdigit() and int(text) > 0):
        return text
    raise PromotionError(
        f"--checkpoint {value!r}: use best (the checkpoint with the highest held-out "
        "promotion.metric), last (the final model) or a checkpoint's step, e.g. 20."
    )


def prepare(config: RunConfig, checkpoint: str | int | None = "best") -> Candidate:
    """Everything knowable before registering: a finished evaluation, the checkpoint and why it is
    the one (best: the highest held-out promotion.metric of the evaluated checkpoints), its
    LoggedModel, the Hub repo and token."""
    choice = parse_checkpoint(checkpoint)
    result = {
        stage: stages.load_stage_result(config, stage)
        for stage in ("dataset", "model", "train", "evaluate")
    }
    if result["evaluate"] is None:
        missing = [stage for stage, value in result.items() if value is None]
        raise PromotionError(
            f"run {config.run_key} has no finished evaluation (stages not done: "
            f"{', '.join(missing)}). Fix: rloo-pipeline resume {config.run_key} --run-root "
            f"{config.run_root}, with evaluation.enabled: true."
        )
    train, table = result["train"], result["evaluate"].get("checkpoints") or []
    metric = config.promotion.metric
    known = sorted(result["evaluate"]["trained"])
    if metric not in known:
        raise PromotionError(
            f"promotion.metric={metric!r} is not a held-out metric of run {config.run_key} (it "
            f"has: {', '.join(known)}). Fix: --set promotion.metric=<one of them>."
        )
    chosen, reason = _choose(config, train, table, choice, metric)
    settings = config.promotion
    if _uses_hub():
        if not settings.hub_repo:
            raise PromotionError(
                "promotion.hub_repo is not set: where should the model go? Fix: --set "
                "promotion.hub_repo=<user or org>/<name> (or RLOO_HUB_PUBLISHER=local:/dir)."
            )
        from huggingface_hub import get_token

        if not get_token():
            raise PromotionError(
                "no Hugging Face token: publishing to the Hub needs one. Fix: export HF_TOKEN=... "
                "(a write token) or `hf auth login`; RLOO_HUB_PUBLISHER=local:/dir publishes to a "
                "directory instead."
            )
    summary = stages.read_json(stages.stage_path(config, "summary.json")) or {}
    if not summary.get("mlflow_run_id"):
        raise PromotionError(
            f"run {config.run_key} has no MLflow run recorded in summary.json (did the pipeline "
            "finish?). Fix: rloo-pipeline resume it."
        )
    if not chosen.model_id:
        raise PromotionError(
            f"{chosen.name} of run {config.run_key} is not a model in MLflow (the train stage "
            "logs one per checkpoint). Fix: rloo-pipeline resume it with MLflow reachable."
        )
    rows = evaluation.held_out_rows(result["dataset"])
    row = next((row for row in table if row["name"] == chosen.name), None)
    return Candidate(
        config=config,
        weights=chosen.path,
        step=chosen.step,
        checkpoint=chosen.name,
        adapter=chosen.adapter,
        policy=result["model"]["policy"],
        tokenizer=result["model"]["tokenizer"],
        evaluation=result["evaluate"],
        rows=rows,
        eval_fingerprint=evaluation.evaluation_fingerprint(config, rows),
        parent_run_id=summary["mlflow_run_id"],
        model_id=chosen.model_id,
        train_run_id=train["mlflow_run_id"],
        reason=reason,
        table=table,
        metrics=row["held_out"] if row else None,
    )


def _choose(config: RunConfig, train: dict, table: list[dict], choice: str, metric: str):
    """(the checkpoints.Checkpoint asked for, why it is the one), or a PromotionError naming what
    exists."""
    saved = checkpoints.saved_checkpoints(config, train)
    final = saved[-1]
    kept = [c for c in saved if c.name != checkpoints.FINAL and c.exists]
    if choice == "last":
        return final, f"the final model (step {final.step}), as asked (--checkpoint last)"
    if choice == "best":
        evaluated = [row for row in table if row["name"] != checkpoints.FINAL]
        if not evaluated:
            raise PromotionError(
                f"--checkpoint best: run {config.run_key}'s checkpoints were not evaluated "
                f"(evaluation.checkpoint_interval={config.evaluation.checkpoint_interval}; "
                "evaluated: the final model only). Fix: --checkpoint last, or a step of "
                f"{', '.join(str(c.step) for c in kept) or 'none kept'}."
            )
        top = checkpoints.best(table, metric)
        if top is None:
            raise PromotionError(
                f"--checkpoint best: no evaluated checkpoint of run {config.run_key} has a "
                f"held-out {metric}. Fix: --checkpoint last or a step."
            )
        chosen = next(c for c in saved if c.name == top["name"])
        if not chosen.exists:
            raise PromotionError(
                f"--checkpoint best: {chosen.name}'s folder is gone "
                f"({chosen.path}). Fix: --checkpoint last or a kept step."
            )
        return chosen, (
            f"the best held-out {metric} ({top['held_out'][metric]:.4f}) of the {len(table)} "
            f"evaluated checkpoints (--checkpoint best; never the training reward)"
        )
    step = int(choice)
    chosen = next((c for c in kept if c.step == step), None)
    if chosen is None or not is_complete(chosen.path):
        raise PromotionError(
            f"--checkpoint {step}: run {config.run_key} has no complete checkpoint-{step} (it "
            f"has: {', '.join(c.name for c in kept) or 'none'}; or best, last)."
        )
    return chosen, f"checkpoint-{step}, as asked (--checkpoint {step})"


def candidate_metrics(candidate: Candidate) -> dict:
    """The candidate's held-out metrics from the evaluate stage; a checkpoint it did not score,
    measured now, the same way."""
    if candidate.metrics is not None:
        return candidate.metrics
    scored = evaluation.score_policies(
        candidate.config,
        candidate.policy,
        candidate.tokenizer,
        candidate.rows,
        {"candidate": candidate.weights},
        {"candidate": candidate.step},
        candidate.step,
    )
    return scored["candidate"]["metrics"]


def metric_tags(metrics: dict) -> dict[str, str]:
    return {
        f"eval.{key}": repr(float(value)) for key, value in metrics.items() if value is not None
    }


def tagged_metrics(tags: dict[str, str]) -> dict:
    return {
        key[len("eval.") :]: float(value) for key, value in tags.items() if key.startswith("eval.")
    }


def find_registered(candidate: Candidate):
    versions = tracking.find_versions(
        candidate.config.tracking_uri, candidate.config.registered_model, candidate.identity
    )
    return versions[0] if versions else None


def register(candidate: Candidate, metrics: dict) -> str:
    """The candidate as a model version (reused when this run's checkpoint was registered before),
    alias `candidate` on it. Its tags: run key, config fingerprint, dataset digest, evaluation
    fingerprint, where the weights lie, the held-out metrics."""
    config = candidate.config
    existing = find_registered(candidate)
    if existing is not None:
        version = str(existing.version)
    else:
        dataset = stages.load_stage_result(config, "dataset")
        tags = {
            **candidate.identity,
            "rloo.fingerprint": config.fingerprint(),
            "rloo.dataset_digest": dataset["digest"],
            "rloo.eval_fingerprint": candidate.eval_fingerprint,
            "rloo.step": str(candidate.step),
            "rloo.weights_path": candidate.weights,
            "rloo.base_model": candidate.policy,
            "rloo.tokenizer": candidate.tokenizer or "",
            "rloo.adapter": str(candidate.adapter).lower(),
            "rloo.num_prompts": str(len(candidate.rows)),
            "rloo.chosen_because": candidate.reason,
            **metric_tags(metrics),
        }
        version = tracking.register_version(
            config.tracking_uri,
            config.registered_model,
            candidate.train_run_id,
            candidate.model_id,
            tags,
            f"RLOO policy of run {config.run_key}, {candidate.checkpoint}: {candidate.reason}",
        )
    tracking.set_alias(config.tracking_uri, config.registered_model, "candidate", version)
    return version


def reference_metrics(candidate: Candidate, champion) -> tuple[str, dict]:
    """What the candidate must beat: the champion's metrics on the same prompts and settings
    (measured again when its stored evaluation used others), or the base model's when there is no
    champion yet."""
    if champion is None:
        return "base model (no champion yet)", candidate.evaluation["base"]
    tags = champion.tags
    label = (
        f"champion v{champion.version} ({tags.get('rloo.run_key')}, {tags.get('rloo.checkpoint')})"
    )
    if champion.tags.get("rloo.eval_fingerprint") == candidate.eval_fingerprint:
        return label, tagged_metrics(champion.tags)
    weights = champion.tags.get("rloo.weights_path", "")
    if not os.path.isdir(weights):
        raise PromotionError(
            f"the champion v{champion.version}'s weights are gone ({weights!r}) and its stored "
            "evaluation used other prompts or settings, so it cannot be compared fairly."
        )
    scored = evaluation.score_policies(
        candidate.config,
        champion.tags["rloo.base_model"],
        champion.tags.get("rloo.tokenizer") or None,
        candidate.rows,
        {"champion": weights},
        {"champion": int(champion.tags.get("rloo.step", 0))},
        int(champion.tags.get("rloo.step", 0)),
    )
    return label + ", re-evaluated on this run's held-out prompts", scored["champion"]["metrics"]


def gate(candidate: dict, reference: dict, settings, num_prompts: int) -> Verdict:
    """The promotion rules, in order; the first that fails decides."""
    checks = [
        (
            "min_prompts",
            num_prompts >= settings.min_prompts,
            f"{num_prompts} held-out prompts, at least {settings.min_prompts} required",
        )
    ]
    for name, allowed in [(settings.metric, None), *settings.max_regression.items()]:
        ours, theirs = candidate.get(name), reference.get(name)
        if ours is None or theirs is None:
            checks.append(
                (
                    f"metric {name}",
                    False,
                    f"{name} is missing (candidate {ours}, reference {theirs})",
                )
            )
        elif allowed is None:
            checks.append(
                (
                    "min_gain",
                    ours - theirs >= settings.min_gain,
                    f"{name} {theirs:.4f} -> {ours:.4f}: change {ours - theirs:+.4f}, at least "
                    f"{settings.min_gain:+.4f} required",
                )
            )
        else:
            checks.append(
                (
                    f"max_regression.{name}",
                    theirs - ours <= allowed,
                    f"{name} {theirs:.4f} -> {ours:.4f}: drop {theirs - ours:+.4f}, at most "
                    f"{allowed:.4f} allowed",
                )
            )
    failed = [check for check in checks if not check[1]]
    return Verdict(
        passed=not failed, decided_by=(failed[0] if failed else checks[-1])[0], checks=checks
    )


def render_report(
    candidate: Candidate,
    version: str,
    reference_label: str,
    reference: dict,
    metrics: dict,
    verdict: Verdict,
) -> str:
    config = candidate.config
    lines = [
        f"# Promotion of `{config.run_key}` ({candidate.checkpoint}, step {candidate.step})",
        "",
        f"Candidate: `{config.registered_model}` version {version}. Reference: {reference_label}.",
        "",
        f"**Verdict: {'PASSED' if verdict.passed else 'FAILED'}**, decided by "
        f"`{verdict.decided_by}`.",
        "",
        f"{len(candidate.rows)} held-out prompts (evaluation fingerprint "
        f"`{candidate.eval_fingerprint}`).",
        "",
        f"Why this checkpoint: {candidate.reason}. MLflow model `{candidate.model_id}`.",
        "",
        "| metric | reference | candidate | change |",
        "| --- | --- | --- | --- |",
    ]
    for key in sorted(set(metrics) | set(reference)):
        ours, theirs = metrics.get(key), reference.get(key)
        change = "-" if ours is None or theirs is None else f"{ours - theirs:+.4f}"
        lines.append(
            f"| {key} | {evaluation.format_number(theirs)} | {evaluation.format_number(ours)} | "
            f"{change} |"
        )
    lines += ["", "| rule | result | detail |", "| --- | --- | --- |"]
    lines += [
        f"| {rule} | {'pass' if ok else 'FAIL'} | {detail} |" for rule, ok, detail in verdict.checks
    ]
    if candidate.table:
        lines += [
            "",
            "## Evaluated checkpoints",
            "",
            *checkpoints.render_table(
                candidate.table, config.promotion.metric, list(config.evaluation.extra_sets)
            ),
        ]
    return "\n".join(lines) + "\n"


def promotion_dir(candidate: Candidate, version: str) -> str:
    return stages.stage_path(
        candidate.config, "promotion", f"{candidate.config.registered_model}-v{version}"
    )


def judge(candidate: Candidate, version: str, metrics: dict) -> tuple[Verdict, str]:
    """Gate the candidate against the champion; the report goes to the run directory and to
    MLflow."""
    config = candidate.config
    champion = tracking.version_by_alias(config.tracking_uri, config.registered_model, "champion")
    label, reference = reference_metrics(candidate, champion)
    verdict = gate(metrics, reference, config.promotion, len(candidate.rows))
    report = render_report(candidate, version, label, reference, metrics, verdict)
    path = os.path.join(promotion_dir(candidate, version), "promotion.md")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as handle:
        handle.write(report)
    tracking.log_text(
        config.tracking_uri,
        candidate.parent_run_id,
        report,
        f"promotion/{config.registered_model}-v{version}/promotion.md",
    )
    tracking.tag_version(
        config.tracking_uri,
        config.registered_model,
        version,
        {"rloo.gate": "passed" if verdict.passed else f"failed: {verdict.decided_by}"},
    )
    return verdict, report


def record_decision(candidate: Candidate, version: str, decision: str, comment: str = "") -> None:
    tracking.tag_version(
        candidate.config.tracking_uri,
        candidate.config.registered_model,
        version,
        {"rloo.decision": decision, **({"rloo.decision_comment": comment} if comment else {})},
    )


def already_promoted(candidate: Candidate):
    """The champion version when it is this candidate, already published (a second promotion does
    nothing)."""
    config = candidate.config
    champion = tracking.version_by_alias(config.tracking_uri, config.registered_model, "champion")
    if (
        champion is not None
        and champion.tags.get("hub.commit")
        and all(champion.tags.get(k) == v for k, v in candidate.identity.items())
    ):
        return champion
    return None
