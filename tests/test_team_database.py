"""A team's shared databases, for real: a PostgreSQL server the test starts itself (Debian's package, run as its
`postgres` user when the tests run as root), the Prefect server and MLflow's tracking server as `rloo-pipeline serve`
starts them, each on its own PostgreSQL database, and a sweep whose Optuna study lives there too: two trials writing
at once, the tracking server restarted while they train, nothing lost."""

import os
import time
import urllib.request

import pytest

from services import PostgresServer, free_port
from sweeps import (
    PRUNED_SWEEP,
    check_pruned_sweep,
    checkpoint_steps,
    cli,
    study,
    sweep_config,
    trial_dirs,
    wait_for,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def postgres():
    server = PostgresServer().start()
    yield server
    server.stop()


def healthy(url, timeout=180):
    def answers():
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    wait_for(answers, timeout, what=url)


def test_a_sweep_on_the_teams_postgresql_survives_a_tracking_server_restart(postgres, tmp_path):
    from flows import serve
    from infra import tracking
    from infra.launch import stop_process_groups

    run_root = str(tmp_path / "runs")
    prefect_port, mlflow_port = free_port(), free_port()
    env = serve.service_environment(
        str(tmp_path / "services"),
        prefect_port,
        mlflow_port,
        prefect_db=postgres.url("prefect"),
        mlflow_db=postgres.url("mlflow"),
    )
    processes = [
        serve.start_prefect(str(tmp_path / "services"), prefect_port, env),
        serve.start_mlflow(str(tmp_path / "services"), mlflow_port, env),
    ]
    uri = f"http://127.0.0.1:{mlflow_port}"
    try:
        healthy(f"{env['PREFECT_API_URL']}/health")
        healthy(f"{uri}/health")
        assert {"flow_run", "deployment"} <= postgres.tables(
            "prefect"
        )  # the servers' tables are there
        assert {"runs", "metrics", "logged_models"} <= postgres.tables("mlflow")
        path = sweep_config(str(tmp_path), **PRUNED_SWEEP, storage=postgres.url("optuna"))
        process = cli(
            "sweep",
            path,
            "--set",
            "training.max_steps=30",
            "--set",
            "training.save_steps=5",
            "--set",
            f"tracking.tracking_uri={uri}",
            wait=False,
            prefect_api=env["PREFECT_API_URL"],
        )
        # both first trials training (each writing its reports and metrics): the tracking server goes away
        wait_for(
            lambda: (
                os.path.isdir(run_root)
                and sum(
                    bool(checkpoint_steps(d)) for d in trial_dirs(run_root, "sweep-tiny").values()
                )
                >= 2
            ),
            what="two trials with a checkpoint",
        )
        stop_process_groups([processes[1]], timeout_s=20)
        time.sleep(3)
        processes[1] = serve.start_mlflow(str(tmp_path / "services"), mlflow_port, env)
        healthy(f"{uri}/health")
        assert process.wait(timeout=900) == 0, open(os.path.join(tmp_path, "sweep.log")).read()[
            -4000:
        ]

        assert {"studies", "trials", "trial_intermediate_values"} <= postgres.tables("optuna")
        check_pruned_sweep(str(tmp_path), uri, 30, prefect_api=env["PREFECT_API_URL"])
        found = study(run_root, "sweep-tiny")
        first, second = (
            found.trials[0],
            found.trials[1],
        )  # the two first trials wrote at the same time
        assert (
            first.datetime_start < second.datetime_complete
            and second.datetime_start < first.datetime_complete
        )
        client = tracking.client(uri)
        experiment = client.get_experiment_by_name("rloo").experiment_id
        for trial in found.trials[
            :3
        ]:  # every step's training metrics arrived, the outage's included
            train = client.search_runs(
                [experiment],
                f"tags.`rloo.run_key` = '{trial.user_attrs['rloo.run_key']}' "
                "and tags.`rloo.stage` = 'train'",
            )
            steps = sorted(
                {m.step for m in client.get_metric_history(train[0].info.run_id, "reward")}
            )
            assert steps == list(range(1, 31)), (trial.number, steps)

        import json

        request = urllib.request.Request(
            f"{env['PREFECT_API_URL']}/flow_runs/filter",
            data=json.dumps({"flow_runs": {"name": {"like_": "sweep-tiny-t"}}}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request) as response:
            names = sorted(
                run["name"] for run in json.load(response) if run["name"].startswith("sweep-tiny-t")
            )
        assert names == [
            "sweep-tiny-t0",
            "sweep-tiny-t1",
            "sweep-tiny-t2",
            "sweep-tiny-t3",
        ]  # (and promote-...)
    finally:
        stop_process_groups(processes, timeout_s=20)
