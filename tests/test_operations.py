"""Promotion and comparison against real services: a Prefect API (prefect_test_harness runs a real server process),
an MLflow tracking server with its model registry, the real huggingface_hub client talking to a loopback stand-in of
the Hub's HTTP routes (tests/hub_standin.py), two real tiny pipeline runs that differ in one knob. The tests build
on each other in file order (one registry, one Hub)."""

import json
import os
import subprocess
import sys
import time

import pytest

from hub_standin import HubStandin

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
TOKEN = "hf_promoteSECRET1234567890"
REPO = "acme/rloo-tiny"
MODEL = "rloo-tiny"


@pytest.fixture(scope="module")
def prefect_api():
    import prefect.settings
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield prefect.settings.get_current_settings().api.url


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    standin = HubStandin(str(tmp_path_factory.mktemp("hub")), TOKEN).start()
    yield standin
    standin.stop()


@pytest.fixture(scope="module")
def environment(prefect_api, mlflow_server, hub):
    """What a user's shell has: the Prefect server, the Hub endpoint and a write token (the client's own
    variables; the Xet protocol is not spoken by the stand-in)."""
    import huggingface_hub.constants as constants

    saved, frozen = dict(os.environ), (constants.HF_HUB_DISABLE_XET, constants.HF_HUB_OFFLINE)
    # HF_HUB_OFFLINE (conftest) would refuse the loopback Hub too; nothing here goes anywhere else.
    os.environ.update(
        PREFECT_API_URL=prefect_api,
        HF_ENDPOINT=hub.url,
        HF_TOKEN=TOKEN,
        HF_HUB_DISABLE_XET="1",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        HF_HUB_OFFLINE="0",
    )
    constants.HF_HUB_DISABLE_XET, constants.HF_HUB_OFFLINE = (
        True,
        False,
    )  # read at import, for this process
    yield dict(os.environ)
    os.environ.clear()
    os.environ.update(saved)
    constants.HF_HUB_DISABLE_XET, constants.HF_HUB_OFFLINE = frozen


@pytest.fixture(scope="module")
def runs(environment, mlflow_server, tmp_path_factory):
    """Two tiny pipeline runs that differ in the learning rate."""
    import asyncio

    from flows.pipeline import rloo_pipeline
    from infra.runconfig import load_run_config

    root = str(tmp_path_factory.mktemp("runs"))
    keys = []
    for rate in ("0.001", "0.003"):
        assignments = [
            f"run_root={root}",
            f"tracking.tracking_uri={mlflow_server.uri}",
            f"data.source={ROOT}/data/arithmetic.jsonl",
            f"training.learning_rate={rate}",
            f"promotion.hub_repo={REPO}",
        ]
        state = asyncio.run(rloo_pipeline(TINY, overrides=assignments, return_state=True))
        assert state.is_completed(), state
        keys.append(load_run_config(TINY, assignments).run_key)
    return root, keys


def promote(root, key, *extra):
    from flows.cli import main

    return main(["promote", key, "--run-root", root, *extra])


def registry(mlflow_server):
    from mlflow import MlflowClient

    return MlflowClient(mlflow_server.uri, registry_uri=mlflow_server.uri)


def champion(mlflow_server):
    from infra import tracking

    return tracking.version_by_alias(mlflow_server.uri, MODEL, "champion")


def start_waiting_promotion(environment, root, key, *extra):
    """`rloo-pipeline promote` in its own process, as a person starts it; returns once its flow run waits."""
    from flows.cli import _paused_promotion

    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flows.cli",
            "promote",
            key,
            "--run-root",
            root,
            "--set",
            "promotion.require_approval=true",
            "--set",
            "promotion.min_gain=-1",
            *extra,
        ],
        cwd=ROOT,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.time() + 180
    while (waiting := _paused_promotion(f"promote-{key}")) is None:
        if process.poll() is not None or time.time() > deadline:
            process.kill()
            pytest.fail(
                "the promotion never paused for approval:\n" + process.communicate()[0][-4000:]
            )
        time.sleep(1)
    return process, waiting


def best_checkpoint(root, key, metric="reward"):
    """The evaluate stage's best checkpoint of a run (its row of the checkpoints' table)."""
    from infra import checkpoints

    table = json.load(open(os.path.join(root, key, "eval", "metrics.json")))["checkpoints"]
    return checkpoints.best(table, metric)


def hub_tag(key, row):
    return key if row["name"] == "final" else f"{key}-step{row['step']}"


def test_gate_rules_by_hand():
    from types import SimpleNamespace

    from infra.promotion import gate

    rules = SimpleNamespace(
        metric="reward", min_gain=0.05, max_regression={"accuracy/format": 0.1}, min_prompts=20
    )
    reference = {"reward": 0.40, "accuracy/format": 0.90}
    passed = gate(
        {"reward": 0.46, "accuracy/format": 0.85}, reference, rules, 40
    )  # +0.06 gain, -0.05 drop
    assert passed.passed and [ok for _, ok, _ in passed.checks] == [True, True, True]
    small = gate({"reward": 0.44, "accuracy/format": 0.95}, reference, rules, 40)  # +0.04 < +0.05
    assert not small.passed and small.decided_by == "min_gain"
    dropped = gate(
        {"reward": 0.60, "accuracy/format": 0.75}, reference, rules, 40
    )  # -0.15 > 0.1 allowed
    assert not dropped.passed and dropped.decided_by == "max_regression.accuracy/format"
    few = gate({"reward": 0.60, "accuracy/format": 0.95}, reference, rules, 8)
    assert not few.passed and few.decided_by == "min_prompts"  # the first failing rule decides
    missing = gate({"accuracy/format": 0.95}, reference, rules, 40)
    assert not missing.passed and missing.decided_by == "metric reward"


def test_bad_input_fails_before_anything_is_registered(
    runs, mlflow_server, hub, monkeypatch, capsys
):
    root, (key, _) = runs
    evaluate = os.path.join(root, key, "stages", "evaluate.json")
    os.rename(evaluate, evaluate + ".away")  # as if the evaluation had not finished
    try:
        assert promote(root, key) == 2
        assert "has no finished evaluation" in capsys.readouterr().err
    finally:
        os.rename(evaluate + ".away", evaluate)
    assert promote(root, key, "--checkpoint", "99") == 2
    assert (
        "no complete checkpoint-99 (it has: checkpoint-2, checkpoint-3; or best, last)"
        in capsys.readouterr().err
    )
    assert promote(root, key, "--checkpoint", "newest") == 2
    assert (
        "use best (the checkpoint with the highest held-out promotion.metric), last"
        in capsys.readouterr().err
    )
    assert promote(root, key, "--set", "promotion.metric=acuracy") == 2
    assert "promotion.metric='acuracy' is not a held-out metric of run" in capsys.readouterr().err
    assert promote(root, key, "--set", "evaluation.checkpoint_interval=1") == 2
    assert "only promotion.* settings" in capsys.readouterr().err
    record = json.load(
        open(evaluate)
    )  # as if evaluation.checkpoint_interval had been 0: the final model only
    os.rename(evaluate, evaluate + ".away")
    try:
        table = record["result"]["checkpoints"]
        record["result"]["checkpoints"] = [row for row in table if row["name"] == "final"]
        json.dump(record, open(evaluate, "w"))
        assert promote(root, key) == 2
        assert (
            "--checkpoint best: run "
            + key
            + "'s checkpoints were not evaluated (evaluation.checkpoint_interval=1; "
            "evaluated: the final model only). Fix: --checkpoint last, or a step of 2, 3."
        ) in capsys.readouterr().err
    finally:
        os.replace(evaluate + ".away", evaluate)
    assert promote(root, key, "--set", "promotion.model_name=team/policy") == 2
    assert "not a valid MLflow registered-model name" in capsys.readouterr().err
    assert promote(root, key, "--set", "training.learning_rate=1") == 2
    assert "only promotion.* settings" in capsys.readouterr().err
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setenv("HF_HOME", str(os.path.join(root, "no-login")))  # no cached login either
    import huggingface_hub.constants

    monkeypatch.setattr(
        huggingface_hub.constants, "HF_TOKEN_PATH", os.path.join(root, "no-login", "token")
    )
    assert promote(root, key) == 2
    assert "no Hugging Face token" in capsys.readouterr().err
    assert registry(mlflow_server).search_registered_models() == [] and hub.requests == []


def test_gate_failure_registers_the_candidate_and_publishes_nothing(
    runs, mlflow_server, hub, capsys
):
    root, (key, _) = runs
    assert promote(root, key, "--set", "promotion.min_gain=5") == 1
    assert "gate failed" in capsys.readouterr().out
    candidate = registry(mlflow_server).get_model_version_by_alias(MODEL, "candidate")
    tags = candidate.tags
    assert (
        tags["rloo.run_key"] == key
        and tags["rloo.gate"] == "failed: min_gain"
        and "eval.reward" in tags
    )
    best = best_checkpoint(root, key)
    assert tags["rloo.checkpoint"] == best["name"] and tags["rloo.dataset_digest"]
    assert tags["rloo.weights_path"].endswith(
        "train/output" + ("" if best["name"] == "final" else f"/{best['name']}")
    )
    assert champion(mlflow_server) is None and hub.commits(REPO) == []
    report = open(
        os.path.join(root, key, "promotion", f"{MODEL}-v{candidate.version}", "promotion.md")
    ).read()
    assert (
        "**Verdict: FAILED**, decided by `min_gain`" in report
        and "base model (no champion yet)" in report
    )
    from prefect.artifacts import Artifact

    assert "Verdict: FAILED" in Artifact.get("tiny-promotion").data


def test_rejection_leaves_the_champion_alone(runs, environment, mlflow_server, hub):
    root, (key, _) = runs
    process, waiting = start_waiting_promotion(environment, root, key)
    from prefect.input import read_flow_run_input
    from prefect.input.run_input import keyset_from_paused_state

    keys = keyset_from_paused_state(waiting.state)
    schema = read_flow_run_input(keys["schema"], flow_run_id=waiting.id)
    assert {"approve", "comment"} <= set(schema["properties"])  # the typed form the UI shows
    assert "Verdict: PASSED" in read_flow_run_input(keys["description"], flow_run_id=waiting.id)
    assert promote(root, key, "--reject", "--comment", "not this one") == 0
    output = process.communicate(timeout=120)[0]
    assert process.returncode == 0 and "rejected: not this one" in output, output[-3000:]
    assert champion(mlflow_server) is None and hub.commits(REPO) == []
    version = registry(mlflow_server).get_model_version_by_alias(MODEL, "candidate")
    assert (
        version.tags["rloo.decision"] == "rejected"
        and version.tags["rloo.decision_comment"] == "not this one"
    )


def test_upload_failure_keeps_the_champion_and_a_retry_publishes_once(
    runs, environment, mlflow_server, hub
):
    root, (key, _) = runs
    hub.fail_commits(1_000)  # the Hub answers 500 to every commit
    assert promote(root, key, "--approve", "--set", "promotion.min_gain=-1") == 1
    assert champion(mlflow_server) is None and hub.commits(REPO) == []
    hub.fail_commits(0)
    process, _ = start_waiting_promotion(environment, root, key)
    assert promote(root, key, "--approve", "--comment", "ship it") == 0
    output = process.communicate(timeout=180)[0]
    assert process.returncode == 0 and "published acme/rloo-tiny" in output, output[-3000:]
    assert TOKEN not in output
    assert len(hub.commits(REPO)) == 1 and hub.repos[REPO]["private"]
    assert hub.repos[REPO]["tags"] == {
        hub_tag(key, best_checkpoint(root, key)): hub.commits(REPO)[0]["oid"]
    }
    version = champion(mlflow_server)
    assert (
        version.tags["hub.commit"] == hub.commits(REPO)[0]["oid"]
        and version.tags["hub.repo"] == REPO
    )
    assert version.tags["rloo.decision_comment"] == "ship it"
    assert {"adapter_model.safetensors": True} == {
        f["path"]: f["lfs"] for f in hub.commits(REPO)[0]["files"] if f["lfs"]
    }  # the weights went through the LFS routes

    # What arrived loads and describes itself.
    from huggingface_hub import ModelCard
    from peft import PeftModel

    from rloo.models import load_causal_lm

    tree = hub.tree(REPO)
    base_path = version.tags["rloo.base_model"]
    model = PeftModel.from_pretrained(load_causal_lm(base_path, {}, False), tree)
    assert sum(p.numel() for n, p in model.named_parameters() if "lora_" in n) > 0
    card = ModelCard.load(os.path.join(tree, "README.md"))
    results = {r.metric_type: r.metric_value for r in card.data.eval_results}
    evaluation = json.load(open(os.path.join(root, key, "eval", "metrics.json")))
    assert results["reward"] == pytest.approx(
        best_checkpoint(root, key)["held_out"]["reward"]
    )  # the one published
    assert results["base/reward"] == pytest.approx(
        evaluation["base"]["reward"]
    )  # the base model, same prompts
    assert (
        card.data.library_name == "peft" and "rloo" in card.data.tags and "| reward |" in card.text
    )
    assert (
        "Why this checkpoint: the best held-out reward" in card.text and "| **best** |" in card.text
    )
    for directory, _, files in os.walk(hub.root):  # the token is in no uploaded file ...
        for name in files:
            assert TOKEN.encode() not in open(os.path.join(directory, name), "rb").read()
    client = registry(mlflow_server)  # ... no tag, param or artifact
    assert TOKEN not in json.dumps(
        [dict(v.tags) for v in client.search_model_versions(f"name = '{MODEL}'")]
    )
    parent = json.load(open(os.path.join(root, key, "summary.json")))[
        "mlflow_run_id"
    ]  # the pipeline's run
    run = client.get_run(parent)
    assert (
        TOKEN not in json.dumps(run.data.to_dictionary())
        and run.data.tags["rloo.promoted"] == "true"
    )
    assert TOKEN not in client.download_artifacts(
        parent, f"promotion/{MODEL}-v{version.version}/promotion.md", root
    )

    assert promote(root, key, "--approve") == 0  # a second promotion of the same run: a no-op
    assert len(hub.commits(REPO)) == 1


def test_the_champion_is_the_best_checkpoints_logged_model_and_loads_with_mlflow(
    runs, mlflow_server
):
    """Promotion by evidence: MLflow's own ranking of the run's LoggedModels on the held-out set names the checkpoint
    that `promote` (--checkpoint best) registered; the version points at that LoggedModel (and it at the version);
    the champion loads with mlflow.transformers and generates."""
    import mlflow

    from infra import stages, tracking
    from infra.runconfig import load_run_config

    root, (key, _) = runs
    config = load_run_config(os.path.join(root, key, "config.yaml"))
    held_out = stages.pipeline_datasets(config, stages.load_stage_result(config, "dataset"))[1]
    version = champion(mlflow_server)
    for metric in ("reward", "completion_length"):  # the gate's metric, and one whose values differ
        ranked = tracking.ranked_logged_models(
            mlflow_server.uri, "rloo", {"rloo.run_key": key}, metric, held_out
        )
        assert ranked[0].name == best_checkpoint(root, key, metric)["name"], [
            (m.name, m.metrics) for m in ranked
        ]
        assert len(ranked) == 3  # checkpoint-2, checkpoint-3 and the final model, each scored
        if metric == "reward":
            assert version.tags["rloo.checkpoint"] == ranked[0].name
            assert version.source == f"models:/{ranked[0].model_id}"
            assert json.loads(ranked[0].tags["mlflow.modelVersions"]) == [
                {"name": MODEL, "version": int(version.version)}
            ]
            assert (
                version.run_id == ranked[0].source_run_id
            )  # lineage: version -> model -> train run -> datasets
            train = registry(mlflow_server).get_run(version.run_id)
            assert train.data.tags["rloo.stage"] == "train"
            assert held_out.digest in {d.dataset.digest for d in train.inputs.dataset_inputs}
    assert "the best held-out reward" in version.tags["rloo.chosen_because"]
    report = open(
        os.path.join(root, key, "promotion", f"{MODEL}-v{version.version}", "promotion.md")
    ).read()
    assert "Why this checkpoint: the best held-out reward" in report and "| **best** |" in report
    with tracking._fluent_uri(mlflow_server.uri):  # what a user's MLFLOW_TRACKING_URI does
        pipeline = mlflow.transformers.load_model(f"models:/{MODEL}@champion")
    out = pipeline(
        "What is 2+2?", max_new_tokens=4, min_new_tokens=4, do_sample=False, return_full_text=False
    )
    assert out[0]["generated_text"].strip()
    assert (
        sum(p.numel() for n, p in pipeline.model.named_parameters() if "lora_" in n) > 0
    )  # the trained adapter


def test_second_run_checkpoint_is_gated_against_the_champion(runs, mlflow_server, hub, capsys):
    root, (first, second) = runs
    assert (
        promote(
            root,
            second,
            "--checkpoint",
            "2",
            "--approve",
            "--set",
            "promotion.min_gain=-1",
            "--set",
            "promotion.publish=merged",
        )
        == 0
    )
    assert "published" in capsys.readouterr().out
    version = champion(mlflow_server)
    assert (
        version.tags["rloo.run_key"] == second and version.tags["rloo.checkpoint"] == "checkpoint-2"
    )
    report = open(
        os.path.join(root, second, "promotion", f"{MODEL}-v{version.version}", "promotion.md")
    ).read()
    assert (
        "Reference: champion v" in report
        and f"({first}, {best_checkpoint(root, first)['name']})" in report
    )
    assert "re-evaluated" not in report
    assert hub.repos[REPO]["tags"].keys() == {
        hub_tag(first, best_checkpoint(root, first)),
        f"{second}-step2",
    }
    assert len(hub.commits(REPO)) == 2
    # Merged weights replace the adapter: the repository holds exactly the new model, which loads as a full one.
    deleted = {f["path"] for f in hub.commits(REPO)[1]["files"] if f["deleted"]}
    assert {"adapter_model.safetensors", "adapter_config.json"} <= deleted
    from huggingface_hub import ModelCard
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hub.tree(REPO))
    assert not any("lora" in name for name, _ in model.named_parameters())
    assert (
        ModelCard.load(os.path.join(hub.tree(REPO), "README.md")).data.library_name
        == "transformers"
    )


def test_a_champion_evaluated_on_other_prompts_is_evaluated_again(runs, mlflow_server):
    from types import SimpleNamespace

    from infra import promotion
    from infra.runconfig import load_run_config

    root, (first, second) = runs
    config = load_run_config(os.path.join(root, second, "config.yaml"))
    candidate = promotion.prepare(config, None)
    stored = champion(mlflow_server)
    other = SimpleNamespace(
        version=stored.version,
        tags={**stored.tags, "rloo.eval_fingerprint": "other-prompts", "eval.reward": "123.0"},
    )
    label, metrics = promotion.reference_metrics(candidate, other)
    assert "re-evaluated on this run's held-out prompts" in label
    assert metrics["reward"] != 123.0 and set(metrics) == set(candidate.evaluation["trained"])


def test_compare_two_runs_that_differ_in_one_knob(runs, mlflow_server, capsys):
    from flows.cli import main

    root, (first, second) = runs
    assert main(["compare", first, second, "--run-root", root]) == 0
    output = capsys.readouterr().out
    differences = output.split("held-out evaluation")[0]
    keys = [line.split("│")[1].strip() for line in differences.splitlines() if line.startswith("│")]
    assert keys == ["training.learning_rate"]  # the one knob; nothing else differs
    assert "0.003" in differences and "trained_reward" in output and "rloo.promoted" in output
    plot = os.path.join(root, "comparisons", f"{first}-vs-{second}", "reward_curves.png")
    assert os.path.getsize(plot) > 0 and f"reward curves: {plot}" in output
    link = next(line for line in output.splitlines() if line.startswith("MLflow comparison: "))
    assert link.startswith(f"MLflow comparison: {mlflow_server.uri}/#/compare-runs?runs=")
    client = registry(mlflow_server)
    comparison = client.search_runs(
        [client.get_experiment_by_name("rloo").experiment_id],
        filter_string="tags.`rloo.comparison` = 'true'",
    )[0]
    assert [a.path for a in client.list_artifacts(comparison.info.run_id, "comparison")] == [
        "comparison/reward_curves.png"
    ]
    parents = client.search_runs(
        [comparison.info.experiment_id],
        filter_string="tags.`rloo.model` = 'tiny' and "
        "tags.`rloo.promoted` = 'true' and tags.`rloo.recipe` LIKE '%tiny.yaml'",
    )
    assert {run.data.tags["rloo.run_key"] for run in parents} == {
        first,
        second,
    }  # both promoted by now


def test_an_air_gapped_cluster_promotes_into_a_directory(
    runs, mlflow_server, monkeypatch, tmp_path, capsys
):
    root, (first, _) = runs
    monkeypatch.setenv("RLOO_HUB_PUBLISHER", f"local:{tmp_path}/hub")
    monkeypatch.delenv("HF_TOKEN")  # none needed
    assert (
        promote(
            root,
            first,
            "--approve",
            "--set",
            "promotion.model_name=rloo-tiny-airgapped",
            "--set",
            "promotion.min_gain=-1",
        )
        == 0
    )
    assert "published" in capsys.readouterr().out
    tree = tmp_path / "hub" / REPO / "main"
    assert {
        "adapter_model.safetensors",
        "adapter_config.json",
        "README.md",
        "tokenizer.json",
    } <= set(os.listdir(tree))
    assert json.load(open(tmp_path / "hub" / REPO / "tags.json")) == {
        hub_tag(first, best_checkpoint(root, first)): "0000"
    }
    version = registry(mlflow_server).get_model_version_by_alias("rloo-tiny-airgapped", "champion")
    assert version.tags["hub.url"].startswith("file://")


def test_approval_is_required_by_default_with_a_server_only(monkeypatch):
    from infra.runconfig import PromotionSettings

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    assert (
        not PromotionSettings().approval_required()
    )  # the embedded default publishes after the gate
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:4200/api")
    assert PromotionSettings().approval_required()
    assert not PromotionSettings(require_approval=False).approval_required()
