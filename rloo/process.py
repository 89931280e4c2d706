"""What every rloo process shares and that needs no torch: where the project caches what it builds,
and how a command line exits. The launchers and `rloo-pipeline`'s light commands import it without
paying for torch and transformers."""

from __future__ import annotations

import os
import sys


def cache_root() -> str:
    """Where built assets live (converted models, compiled kernels): $RLOO_CACHE or
    ~/.cache/rloo."""
    return os.environ.get("RLOO_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "rloo"))


def exit_without_native_teardown(code: int) -> None:
    """Exit as Python would (join the non-daemon threads, run the exit handlers, flush), without the
    interpreter's final teardown of native modules. Native threads outlive it and abort it now and
    then ("terminate called without an active exception", exit -6, after everything was saved: once
    in CI on one of 4 DeepSpeed ranks, which failed the whole job; 2 in ~50 runs of
    tests/distributed_train.py's two gloo ranks): a core of the latter shows a gloo worker thread
    (`ProcessGroupGloo::runLoop`) dropping a finished all-gather's tensors, whose decref takes the
    GIL; during finalization that ends the thread (`pthread_exit`) through C++ frames that cannot
    unwind. And after torch, transformers and Prefect were imported the teardown takes ~2.5 s that a
    command line spends doing nothing."""
    import atexit
    import logging
    import threading

    # what the interpreter does first: threading's exit callbacks, non-daemon threads joined
    threading._shutdown()
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
