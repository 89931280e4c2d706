"""Starting and scheduling runs from the Prefect UI, for real: `rloo-pipeline serve` (a Prefect server process, a
`process` work pool, prefect.yaml's deployments through `prefect deploy --all`, a worker process, an MLflow UI), a
flow run created through the REST API exactly as the UI's Run button does, a schedule, and a headless Chromium
(Debian's `chromium`) looking at the form and at the finished run (screenshots in docs/img/)."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import yaml

from services import chromium, free_port

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMAGES = os.path.join(ROOT, "docs", "img")


def api(base, path, payload=None):
    """(status, body) of a JSON request to the Prefect API. A 503 is the server's "retry": SQLite refused a write
    (SQLITE_BUSY_SNAPSHOT while its own services write, which no busy timeout waits out), and Prefect's own client
    retries it with a backoff; so does this one, up to 5 times."""
    request = urllib.request.Request(
        f"{base}/api{path}",
        data=None if payload is None else json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
        method="GET" if payload is None else "POST",
    )
    for attempt in range(6):
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, json.loads(response.read() or b"null")
        except urllib.error.HTTPError as err:
            status, body = err.code, json.loads(err.read() or b"null")
        if status != 503:
            break
        time.sleep(0.5 * 2**attempt)
    return status, body


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    run_root = str(tmp_path_factory.mktemp("served"))
    prefect_port, mlflow_port = free_port(), free_port()
    log = open(os.path.join(run_root, "serve.log"), "w")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flows.cli",
            "serve",
            "--run-root",
            run_root,
            "--prefect-port",
            str(prefect_port),
            "--mlflow-port",
            str(mlflow_port),
        ],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PREFECT_WORKER_QUERY_SECONDS": "2"},
    )
    base = f"http://127.0.0.1:{prefect_port}"
    deadline = time.time() + 300
    deployments = {}
    while len(deployments) < 4:
        assert process.poll() is None and time.time() < deadline, open(log.name).read()[-4000:]
        time.sleep(2)
        try:
            status, found = api(base, "/deployments/filter", {})
        except OSError:
            continue
        deployments = {d["name"]: d for d in found} if status == 200 else {}
    yield {
        "base": base,
        "mlflow": f"http://127.0.0.1:{mlflow_port}",
        "run_root": run_root,
        "deployments": deployments,
        "log": log.name,
    }
    process.send_signal(signal.SIGINT)
    process.wait(timeout=120)


def flow_runs(base, deployment_id, states=None):
    flow_filter = {"deployment_id": {"any_": [deployment_id]}}
    if states:
        flow_filter["state"] = {"type": {"any_": states}}
    return api(base, "/flow_runs/filter", {"flow_runs": flow_filter})[1]


def test_every_deployment_form_is_prefilled_with_its_recipes_values():
    from infra.runconfig import RunSettings, load_run_config

    with open(os.path.join(ROOT, "prefect.yaml")) as handle:
        deployments = yaml.safe_load(handle)["deployments"]
    for deployment in deployments:
        parameters = deployment["parameters"]
        config = load_run_config(os.path.join(ROOT, parameters["recipe"]))
        if deployment["name"] == "sweep":  # the sweep's own settings
            assert (parameters["n_trials"], parameters["parallel"]) == (
                config.sweep.n_trials,
                config.sweep.parallel,
            )
            continue
        assert RunSettings(**parameters["settings"]).assignments(config) == [], deployment["name"]
        assert set(parameters["settings"]) >= {
            "model",
            "max_steps",
            "learning_rate",
            "num_generations",
        }


def test_runs_started_like_the_ui_run_button_run_at_once_each_in_its_own_mlflow_run(served):
    """Three flow runs created at once, as three clicks on the Run button do: two configs (learning rates), each
    completes with its own MLflow run and nothing of another's; the second repeats the first config, so one of that
    pair refuses to write the run directory the other is writing."""
    from mlflow import MlflowClient

    from infra.runconfig import load_run_config

    base, tiny = served["base"], served["deployments"]["tiny"]
    rates = [0.001, 0.001, 0.002]  # the first two the same config, created one after the other
    started, created = time.time(), []
    for rate in rates:
        parameters = dict(
            tiny["parameters"],
            settings={**tiny["parameters"]["settings"], "max_steps": 2, "learning_rate": rate},
        )
        status, run = api(
            base,
            f"/deployments/{tiny['id']}/create_flow_run",
            {
                "parameters": parameters,
                "state": {"type": "SCHEDULED", "message": "Run from the Prefect UI"},
            },
        )
        assert status == 201, run
        created.append(run["id"])
    deadline, states = time.time() + 600, {}
    while len(states) < len(created):
        assert time.time() < deadline, open(served["log"]).read()[-4000:]
        time.sleep(2)
        for run_id in created:
            run = api(base, f"/flow_runs/{run_id}")[1]
            if run["state_type"] in ("COMPLETED", "FAILED", "CRASHED"):
                states[run_id] = run["state"]
    print(
        f"three deployment-started tiny runs at once: {time.time() - started:.0f} s from the Run buttons to done"
    )
    pair = [created[0], created[1]]
    assert [states[i]["type"] for i in created[2:]] == ["COMPLETED"], (
        [states[i]["message"] for i in created[2:]],
        open(served["log"]).read()[-4000:],
    )
    assert sorted(states[i]["type"] for i in pair) == ["COMPLETED", "FAILED"], [
        states[i] for i in pair
    ]
    winner, loser = pair if states[pair[0]]["type"] == "COMPLETED" else pair[::-1]
    assert "is being written by process" in states[loser]["message"]
    assert f"Prefect flow run {winner}" in states[loser]["message"]

    client = MlflowClient(served["mlflow"])  # through `serve`'s MLflow UI
    for run_id, rate in zip([winner, *created[2:]], rates[1:]):
        config = load_run_config(
            os.path.join(ROOT, "configs", "tiny.yaml"),
            [
                f"run_root={served['run_root']}",
                "training.max_steps=2",
                f"training.learning_rate={rate}",
            ],
        )
        summary = json.load(
            open(os.path.join(config.run_dir, "summary.json"))
        )  # RLOO_RUN_ROOT of the worker
        run = client.get_run(summary["mlflow_run_id"])
        assert (
            run.data.tags["prefect.flow_run_id"] == run_id
            and run.data.tags["rloo.run_key"] == config.run_key
        )
        assert (
            run.data.params["training.learning_rate"] == str(rate) and run.info.status == "FINISHED"
        )
        train = client.search_runs(
            [run.info.experiment_id],
            filter_string=f"tags.`rloo.run_key` = "
            f"'{config.run_key}' and tags.`rloo.stage` = 'train'",
        )
        assert len(train) == 1 and train[0].data.params["training.learning_rate"] == str(rate)
        assert [m.step for m in client.get_metric_history(train[0].info.run_id, "reward")] == [
            1,
            2,
        ]  # its own only


def test_invalid_form_values_are_refused_before_any_work(served):
    base, tiny = served["base"], served["deployments"]["tiny"]
    before = len(flow_runs(base, tiny["id"]))
    for settings, recipe, reason in (
        ({"max_steps": 0}, "configs/tiny.yaml", "0 is less than the minimum of 1"),
        ({"learning_rate": 2.0}, "configs/tiny.yaml", "greater than the maximum"),
        ({"max_step": 3}, "configs/tiny.yaml", "max_step"),
        ({}, "configs/nope.yaml", "is not one of"),
    ):
        status, answer = api(
            base,
            f"/deployments/{tiny['id']}/create_flow_run",
            {"parameters": {"recipe": recipe, "settings": settings, "overrides": []}},
        )
        assert status == 409 and reason in answer["detail"], answer
    assert len(flow_runs(base, tiny["id"])) == before


def test_the_nightly_schedule_creates_the_next_runs(served):
    nightly = served["deployments"]["nightly-tiny"]
    assert [s["schedule"]["cron"] for s in nightly["schedules"]] == ["0 2 * * *"]
    deadline = time.time() + 120
    while not (scheduled := flow_runs(served["base"], nightly["id"], ["SCHEDULED"])):
        assert time.time() < deadline, "the scheduler created no run"
        time.sleep(2)
    assert all(run["expected_start_time"][11:19] == "02:00:00" for run in scheduled)
    assert scheduled[0]["parameters"]["recipe"] == "configs/tiny.yaml"


def test_the_browser_shows_the_typed_form_and_the_finished_run(served, tmp_path):
    base, tiny = served["base"], served["deployments"]["tiny"]
    with urllib.request.urlopen(
        f"{base}/ui-settings"
    ) as response:  # the UI calls its own port's API
        assert json.load(response)["api_url"] == f"{base}/api"
    form_url = f"{base}/v2/deployments/deployment/{tiny['id']}/run"
    page = chromium("--dump-dom", form_url, profile=tmp_path / "a").stdout
    for field in (
        "Max Steps",
        "Learning Rate",
        "Num Generations",
        "Max Completion Length",
        "Beta",
        "Lora R",
        "Executor",
        "Trainer Nodes",
        "configs/tiny.yaml",
        "optimizer steps",
    ):
        assert field in page, field
    assert "Can't connect" not in page
    os.makedirs(IMAGES, exist_ok=True)
    chromium(f"--screenshot={IMAGES}/deployment-form.png", form_url, profile=tmp_path / "b")
    finished = [run for run in flow_runs(base, tiny["id"], ["COMPLETED"])]
    assert finished, (
        "run test_runs_started_like_the_ui_run_button_run_at_once_each_in_its_own_mlflow_run first"
    )
    run_url = f"{base}/v2/runs/flow-run/{finished[0]['id']}"
    page = chromium("--dump-dom", run_url, profile=tmp_path / "c").stdout
    assert finished[0]["name"] in page and "Completed" in page and "evaluate" in page
    chromium(f"--screenshot={IMAGES}/flow-run.png", run_url, profile=tmp_path / "d")
    assert (
        os.path.getsize(f"{IMAGES}/deployment-form.png") > 20_000
        and os.path.getsize(f"{IMAGES}/flow-run.png") > 20_000
    )


def test_serve_installs_the_stalled_run_automation_and_it_flags_a_run_without_steps(served):
    """`rloo-pipeline serve` installs the automation (Prefect's proactive trigger, 30 minutes by default); installed
    again with 10 s (Prefect's least), a flow run whose training emitted a start and one step, then nothing, is flagged
    `Stalled` by the server itself and put back to Running by its next step, while one that said it finished is left
    alone."""
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run
    from prefect.settings import PREFECT_API_URL, PREFECT_LOGGING_TO_API_ENABLED, temporary_settings

    from infra import stall_alert

    deadline, installed = time.monotonic() + 60, []
    while not installed and time.monotonic() < deadline:  # serve installs it after the deployments
        installed = [
            a
            for a in api(served["base"], "/automations/filter", {})[1]
            if a["name"] == stall_alert.AUTOMATION
        ]
        time.sleep(0.5)
    [installed] = installed
    assert installed["trigger"]["posture"] == "Proactive" and installed["trigger"]["within"] == 1800
    assert installed["trigger"]["expect"] == sorted(
        [stall_alert.STEP, stall_alert.FINISHED]
    ) or set(installed["trigger"]["expect"]) == {stall_alert.STEP, stall_alert.FINISHED}

    @flow(name="stall-watch")
    def training(key: str, finish: bool) -> tuple[str | None, str | None]:
        """The Stalled message (None: never flagged) and, after a step reported then, the state's name."""
        stall_alert.emit(stall_alert.STARTED, key, key)
        report = stall_alert.StepReporter(key, key)
        report(1, 0.5)
        if finish:
            stall_alert.emit(stall_alert.FINISHED, key, key)
        deadline = time.monotonic() + (30 if finish else 120)
        with get_client(sync_client=True) as client:
            while time.monotonic() < deadline:
                state = client.read_flow_run(flow_run.id).state
                if state.name == "Stalled":
                    report(2, 0.5)  # the job trains again
                    return state.message, client.read_flow_run(flow_run.id).state.name
                time.sleep(1)
        return None, None

    # (no log shipping: it would outlive the server and complain at exit)
    with temporary_settings(
        {PREFECT_API_URL: served["base"] + "/api", PREFECT_LOGGING_TO_API_ENABLED: False}
    ):
        stall_alert.install(10)
        assert training("stuck-run", False) == ("no training step for 10 s (rloo)", "Running")
        assert training("finished-run", True) == (None, None)


def test_a_sweep_started_from_its_form_shows_its_trials_as_flow_runs(served, tmp_path):
    """The `sweep` deployment's typed form, a sweep started from it as the Run button does, its trials as flow
    runs of their own under it (screenshots in docs/img/)."""
    base, deployment = served["base"], served["deployments"]["sweep"]
    form_url = f"{base}/v2/deployments/deployment/{deployment['id']}/run"
    page = chromium("--dump-dom", form_url, profile=tmp_path / "a").stdout
    for field in (
        "n_trials",
        "Trials in the study when the sweep is done",
        "parallel",
        "Trials running at once",
        "configs/sweep-tiny.yaml",
        "sweep.objective=",
    ):
        assert field in page, field
    chromium(f"--screenshot={IMAGES}/sweep-form.png", form_url, profile=tmp_path / "b")
    parameters = dict(
        deployment["parameters"],
        n_trials=2,
        parallel=2,
        overrides=["training.max_steps=3", "training.save_steps=3", "sweep.name=ui"],
    )
    status, run = api(
        base,
        f"/deployments/{deployment['id']}/create_flow_run",
        {
            "parameters": parameters,
            "state": {"type": "SCHEDULED", "message": "Run from the Prefect UI"},
        },
    )
    assert status == 201, run
    deadline = time.time() + 600
    while (found := api(base, f"/flow_runs/{run['id']}")[1])["state_type"] not in (
        "COMPLETED",
        "FAILED",
        "CRASHED",
    ):
        assert time.time() < deadline, open(served["log"]).read()[-4000:]
        time.sleep(2)
    assert found["state_type"] == "COMPLETED", (found["state"], open(served["log"]).read()[-4000:])
    trials = api(
        base, "/flow_runs/filter", {"flow_runs": {"parent_flow_run_id": {"any_": [run["id"]]}}}
    )[1]
    assert sorted(t["name"] for t in trials) == ["ui-t0", "ui-t1"]
    assert all(t["state_type"] == "COMPLETED" for t in trials)
    run_url = f"{base}/v2/runs/flow-run/{run['id']}"
    page = chromium("--dump-dom", run_url, profile=tmp_path / "c").stdout
    assert found["name"] in page and "Completed" in page
    chromium(f"--screenshot={IMAGES}/sweep-run.png", run_url, profile=tmp_path / "d")
    assert os.path.getsize(f"{IMAGES}/sweep-form.png") > 20_000
