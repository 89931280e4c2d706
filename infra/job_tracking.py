"""The training job's side of tracking: on global rank 0, `RunDirTrackingCallback` keeps every log
line in the run directory first (`train/metrics.jsonl`) and sends it to the train stage's MLflow run
when it can; whatever MLflow refuses (an outage, a restart, a server paused past the client timeout)
is queued in `mlflow-pending.jsonl` and sent in order later (`flush_pending`: at the next log line,
when the stage ends, `rloo-pipeline sync RUN`). Metrics carry the time they were logged, so a resend
of one that had in fact arrived adds nothing.

Sending is off the training step: every item is appended to that queue first (durable: a killed job
leaves it for the stage to send), and a `Sender` thread empties the queue into MLflow while training
goes on (a metrics line costs ~0.3 s and a completions table ~0.7 s of HTTP and serialisation on 2
cores, at every logging step)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time

from transformers import TrainerCallback

from infra.tracking import (
    client,
    log_metrics,
    numeric_metrics,
    start_system_metrics,
    stop_system_metrics,
)
from rloo.callbacks import image_columns

logger = logging.getLogger(__name__)

ENV_RUN_ID = "RLOO_MLFLOW_RUN_ID"  # not MLFLOW_RUN_ID: mlflow consumes and deletes that one
ENV_TRAIN_DIR = "RLOO_TRAIN_DIR"
PENDING = "mlflow-pending.jsonl"
CHECKPOINTS = "checkpoints.jsonl"


def tracking_environment(tracking_uri: str, run_id: str, train_dir: str) -> dict[str, str]:
    """What the training job needs to log into the train stage's run (rank 0 only), failing fast on
    outages."""
    return {
        "MLFLOW_TRACKING_URI": tracking_uri,
        ENV_RUN_ID: run_id,
        ENV_TRAIN_DIR: train_dir,
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
        "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
    }


class RunDirTrackingCallback(TrainerCallback):
    """On global rank 0: every log line goes to `<train_dir>/metrics.jsonl`, then to the MLflow run
    named by RLOO_MLFLOW_RUN_ID; completion tables to `<train_dir>/completions/` then MLflow; each
    checkpoint saved is recorded in `<train_dir>/checkpoints.jsonl`; system metrics go to the run
    from every node. Whatever MLflow refuses is queued in
    `mlflow-pending.jsonl`. A resumed attempt replays the steps after its checkpoint: a log line an
    earlier attempt already wrote (same step, same keys) is not written or sent again, so every step
    is in metrics.jsonl and MLflow once."""

    def __init__(self):
        self.train_dir = os.environ.get(ENV_TRAIN_DIR)
        self.run_id = os.environ.get(ENV_RUN_ID)
        self.tracking_uri = os.environ.get("MLFLOW_TRACKING_URI")
        self.logged = (
            {_line_key(record) for record in read_metrics(self.train_dir)}
            if self.train_dir
            else set()
        )
        self.sender: Sender | None = None  # started at the first item to send
        self.monitor = None  # MLflow's system-metrics thread on a node's local rank 0

    def _active(self, state) -> bool:
        return state.is_world_process_zero and self.train_dir is not None

    def _send(self, item: dict) -> None:
        if not (self.run_id and self.tracking_uri):
            return
        if self.sender is None:
            self.sender = Sender(self.train_dir, self.tracking_uri, self.run_id)
        self.sender.put(item)

    def wait_sent(self, timeout: float | None = None) -> bool:
        """One more attempt at everything queued, waited for (False: still sending after `timeout`
        seconds)."""
        return self.sender.wait_sent(timeout) if self.sender is not None else True

    def on_train_end(self, args, state, control, **kwargs):
        if self.monitor is not None:
            try:
                stop_system_metrics(self.monitor)
            except Exception as err:
                logger.warning("rloo: the last system metrics were not sent: %s", err)
            self.monitor = None
        if self._active(state):
            # what is left (MLflow down, slow) stays queued for the stage to send
            self.wait_sent(timeout=60)

    def on_step_end(self, args, state, control, **kwargs):
        if self._active(state):  # every optimizer step, whatever logging_steps logs
            write_step(self.train_dir, state.global_step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not self._active(state) or not logs:
            return
        record = {"step": state.global_step, "time": time.time(), **logs}
        if _line_key(record) in self.logged:
            return
        _append(os.path.join(self.train_dir, "metrics.jsonl"), record)
        item = metrics_item(record)
        if item["metrics"]:
            self._send(item)

    def on_completions(self, args, state, control, rows=None, **kwargs):
        if not self._active(state) or not rows:
            return

        path = os.path.join(self.train_dir, "completions", f"step_{state.global_step:07d}.json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        columns = {key: [row[key] for row in rows] for key in rows[0] if key != "images"}
        # a VLM's images (log_multimodal): PNG files beside the table, which names them
        images = image_columns(rows)
        for column, values in images.items():
            columns[column] = []
            for index, image in enumerate(values):
                name = f"step_{state.global_step:07d}_{index}_{column}.png"
                image.save(os.path.join(os.path.dirname(path), name))
                columns[column].append(name)
        with open(path, "w") as handle:
            json.dump(columns, handle, default=str)
        self._send(
            {
                "kind": "table",
                "path": path,
                "artifact_file": f"completions/{os.path.basename(path)}",
                "image_columns": list(images),
            }
        )

    def on_save(self, args, state, control, **kwargs):
        """Each checkpoint saved, recorded once (a resumed attempt saves none twice) in
        `checkpoints.jsonl`: the train stage makes each a LoggedModel (infra.checkpoints), also one
        that save_total_limit deletes later."""
        if not self._active(state):
            return
        path = os.path.join(self.train_dir, CHECKPOINTS)
        if any(record["step"] == state.global_step for record in read_jsonl(path)):
            return
        _append(
            path,
            {
                "step": state.global_step,
                "time": time.time(),
                "path": os.path.join(args.output_dir, f"checkpoint-{state.global_step}"),
            },
        )

    def on_train_begin(self, args, state, control, **kwargs):
        """MLflow's system metrics (CPU, memory, disk, network; GPU where present) into the train
        run, one monitor per node (its local rank 0), named by the node on a multi-node run; and
        this attempt's first step (0, or the one of the checkpoint it resumed from)."""
        if self._active(state):
            write_step(self.train_dir, state.global_step)
        if not (state.is_local_process_zero and self.run_id and self.tracking_uri):
            return
        nodes = int(os.environ.get("WORLD_SIZE", 1)) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        node = f"node{os.environ.get('GROUP_RANK', 0)}" if nodes > 1 else None
        try:
            self.monitor = start_system_metrics(self.tracking_uri, self.run_id, node)
        except Exception as err:  # MLflow away: training goes on without these charts
            logger.warning("rloo: no system metrics for MLflow run %s: %s", self.run_id, err)
            self.monitor = None


class Sender:
    """A daemon thread that sends the run directory's queue to MLflow whenever items are added, so
    the training step never waits on the tracking server. `put` appends to the queue (the only write
    the step does); an unreachable server leaves the queue as it is until the next `put` or
    `wait_sent`."""

    def __init__(self, train_dir: str, tracking_uri: str, run_id: str):
        self.train_dir, self.tracking_uri, self.run_id = train_dir, tracking_uri, run_id
        self.condition = threading.Condition()  # its lock also guards the queue file
        self.requested = self.attempted = 0
        threading.Thread(target=self._loop, name="rloo-mlflow-sender", daemon=True).start()

    def put(self, item: dict) -> None:
        with self.condition:
            enqueue(self.train_dir, item)
            self.requested += 1
            self.condition.notify_all()

    def wait_sent(self, timeout: float | None = None) -> bool:
        with self.condition:
            self.requested += 1
            target = self.requested
            self.condition.notify_all()
            return self.condition.wait_for(lambda: self.attempted >= target, timeout)

    def _loop(self) -> None:
        while True:
            with self.condition:
                self.condition.wait_for(lambda: self.requested > self.attempted)
                target = self.requested
            try:
                flush_pending(self.train_dir, self.tracking_uri, self.run_id, lock=self.condition)
            # a damaged queue line: the stage's flush reports it; training goes on
            except Exception as err:
                logger.warning("rloo: sending the MLflow queue %s failed: %s", self.train_dir, err)
            with self.condition:
                self.attempted = target
                self.condition.notify_all()


def read_metrics(train_dir: str) -> list[dict]:
    """The log lines of `<train_dir>/metrics.jsonl`, in order (none yet: [])."""
    return read_jsonl(os.path.join(train_dir, "metrics.jsonl"))


STEP_FILE = "step.json"  # in the train directory: the running attempt's last optimizer step


def write_step(train_dir: str, step: int) -> None:
    """The attempt's optimizer step, replaced in one rename (a reader never sees half of it)."""
    path = os.path.join(train_dir, STEP_FILE)
    os.makedirs(train_dir, exist_ok=True)
    with open(path + ".tmp", "w") as handle:
        json.dump({"step": step, "time": time.time()}, handle)
    os.replace(path + ".tmp", path)


def read_step(train_dir: str) -> dict | None:
    """{"step", "time"} of write_step, or None before the job's first."""
    try:
        with open(os.path.join(train_dir, STEP_FILE)) as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return None


def read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _line_key(record: dict) -> tuple:
    return record.get("step"), frozenset(key for key in record if key != "time")


def metrics_item(record: dict) -> dict:
    """What is sent (or queued) for one metrics.jsonl record, stamped with the time it was logged: a
    resend of an item that had in fact arrived (its answer lost) adds nothing."""
    logs = {key: value for key, value in record.items() if key not in ("step", "time")}
    return {
        "kind": "metrics",
        "step": record["step"],
        "metrics": numeric_metrics(logs),
        "time_ms": int(record["time"] * 1000),
    }


def enqueue(train_dir: str, item: dict) -> None:
    _append(os.path.join(train_dir, PENDING), item)


def _append(path: str, item: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as handle:
        handle.write(json.dumps(item, default=str) + "\n")


def _upload(item: dict, tracking_uri: str, run_id: str) -> bool:
    try:
        mlflow_client = client(tracking_uri)
        if item["kind"] == "metrics":
            log_metrics(tracking_uri, run_id, item["metrics"], item["step"], item.get("time_ms"))
        elif item["kind"] == "table":
            with open(item["path"]) as handle:
                data = json.load(handle)
            for column in item.get("image_columns", []):  # MLflow stores PIL cells as images
                from PIL import Image

                folder = os.path.dirname(item["path"])
                data[column] = [Image.open(os.path.join(folder, name)) for name in data[column]]
            mlflow_client.log_table(run_id, data=data, artifact_file=item["artifact_file"])
        return True
    except Exception:
        return False


def _read_queue(path: str) -> list[str]:
    if not os.path.exists(path):
        return []
    with open(path) as handle:
        return [line for line in handle if line.strip()]


def flush_pending(train_dir: str, tracking_uri: str, run_id: str, lock=None) -> bool:
    """Upload queued items in order, stopping at the first refused; True when every item read was
    sent. `lock` guards the queue file against a concurrent `enqueue` (held for reads and the
    rewrite, not the uploads)."""
    lock = lock if lock is not None else contextlib.nullcontext()
    path = os.path.join(train_dir, PENDING)
    with lock:
        lines = _read_queue(path)
    sent = 0
    for line in lines:
        if not _upload(json.loads(line), tracking_uri, run_id):
            break
        sent += 1
    if sent:
        with lock:
            rest = _read_queue(path)[sent:]  # items appended meanwhile stay, after the unsent ones
            if rest:
                with open(path + ".tmp", "w") as handle:
                    handle.writelines(rest)
                os.replace(path + ".tmp", path)
            else:
                os.remove(path)
    return sent == len(lines)


def pending_count(train_dir: str) -> int:
    path = os.path.join(train_dir, PENDING)
    if not os.path.exists(path):
        return 0
    with open(path) as handle:
        return sum(1 for line in handle if line.strip())
