"""The pipeline's console: its own lines only (the stage lines, training's progress, the summary,
errors). What other libraries log below ERROR (MLflow creating its tables, Prefect's run states and
server notices, DeepSpeed's accelerator notice, Python warnings) goes to the run root's
`pipeline.log`; Prefect's database still keeps every flow run's log for its UI."""

from __future__ import annotations

import logging
import os
import re
import sys

from infra.tracking import log_to

OWN = re.compile(r"\[(pipeline|dataset|model|train|evaluate|promote|sweep)\] ")
LOG_NAME = "pipeline.log"


class OwnLines(logging.Filter):
    """Passes the pipeline's stage lines (`[stage] ...`) and any library's errors, nothing else."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or bool(OWN.match(record.getMessage()))


def _on_console(handler: logging.Handler) -> bool:
    """A handler that writes to this process's terminal. A host's own capture (a StringIO, a
    file, pytest's caplog) keeps every record: quieting it would hide its logs for good."""
    streams = {id(stream) for stream in (sys.stderr, sys.stdout, sys.__stderr__, sys.__stdout__)}
    return (
        isinstance(handler, logging.StreamHandler)
        and not isinstance(handler, logging.FileHandler)
        and id(getattr(handler, "stream", None)) in streams
    )


def before_imports() -> None:
    """What must be set before the libraries load: without a GPU, DeepSpeed is told it runs on the
    CPU (instead of detecting it and saying so on stdout at import). MLflow's client writes a "View
    run ... at" link to stdout each time a run on a tracking server ends: the pipeline prints its
    own links."""
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    if "DS_ACCELERATOR" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["DS_ACCELERATOR"] = "cpu"


def quiet(run_root: str) -> None:
    """Console handlers keep only the pipeline's own lines, printed as they are (no logger prefix);
    every record also goes to `<run_root>/pipeline.log`. Called again after a library (re)configures
    logging: idempotent."""
    os.makedirs(run_root, exist_ok=True)
    path = os.path.abspath(os.path.join(run_root, LOG_NAME))
    root = logging.getLogger()
    log_file = next((h for h in root.handlers if getattr(h, "baseFilename", None) == path), None)
    if log_file is None:
        log_file = logging.FileHandler(path)
        log_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(log_file)
    # warnings.warn -> the "py.warnings" logger -> the file, not the console
    logging.captureWarnings(True)

    log_to(log_file)  # MLflow's own loggers do not propagate to the root
    consoles = [
        handler
        for logger in [root, *map(logging.getLogger, list(root.manager.loggerDict))]
        for handler in getattr(logger, "handlers", [])
        if _on_console(handler)
    ]
    if not any(handler in root.handlers for handler in consoles):
        # (Prefect installs its console handler only on a root logger without handlers: ours stands
        # in)
        consoles.append(logging.StreamHandler(sys.stderr))
        root.addHandler(consoles[-1])
    for handler in consoles:
        if not any(isinstance(existing, OwnLines) for existing in handler.filters):
            handler.addFilter(OwnLines())
            handler.setFormatter(logging.Formatter("%(message)s"))
