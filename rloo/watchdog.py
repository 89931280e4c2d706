"""No silent hang: a watchdog thread in every training process fails the optimizer step in which
nothing progressed for `stall_timeout_s` (no timing section entered or left, no progress reported
from inside one: a chunk pushed, a token decoded, a reward function or a forward micro-batch done;
rloo.timing), with one message naming what the step was waiting in (e.g. `train > generation` and
the vLLM server) and a report per process that fired holding the Python stacks of every process of
the job on its machine (faulthandler, on a real-time signal; a stopped process is named as not
answering). Time the process spent suspended (SIGSTOP, SLURM's suspend) does not count. The step
fails by an exception raised in the main thread (TrainingStalled); where the main thread is blocked
in native code (a collective waiting for a frozen peer), the process exits with STALLED_EXIT_CODE
after the report. Either way the run resumes from its last checkpoint."""

from __future__ import annotations

import faulthandler
import os
import signal
import socket
import sys
import threading
import time
from typing import Callable

from transformers import TrainerCallback

from rloo.timing import StepTimer

STALLED_EXIT_CODE = 75  # EX_TEMPFAIL: try again (resume)
# Real-time signals nobody else uses (SIGUSR2 is SLURM's / submitit's pre-termination signal, which
# rloo.callbacks.PreemptionCallback handles; SIGUSR1 is a common choice for the same): one asks a
# process for its stacks, the other raises TrainingStalled in its own main thread.
if hasattr(signal, "SIGRTMIN"):
    DUMP_SIGNAL, RAISE_SIGNAL = signal.SIGRTMIN + 1, signal.SIGRTMIN + 2
else:  # (macOS: no real-time signals, and no SLURM either)
    DUMP_SIGNAL, RAISE_SIGNAL = signal.SIGUSR1, signal.SIGUSR2
REPORTS = "stall-report-*.txt"  # in output_dir, one per process that found its step stalled
ANSWER_S = 2.0  # how long the other processes get to write their stacks
GRACE_S = 15.0  # how long the main thread gets to unwind before the process exits
# A watchdog poll that comes this much later than asked means the process was not running (SIGSTOP,
# SLURM's suspend, a laptop's sleep): that time is not the step's.
SUSPENDED_S = 5.0


def report_path(output_dir: str, rank: int) -> str:
    """Where a process's stall report goes: named by machine and rank, so that the ranks of a
    multi-node run, which share output_dir, each keep theirs."""
    return os.path.join(output_dir, f"stall-report-{socket.gethostname()}-rank{rank}.txt")


class TrainingStalled(BaseException):
    """An optimizer step made no progress for stall_timeout_s (the message says where). An
    interruption, like KeyboardInterrupt: handlers of ordinary errors (the reward runner's, a
    user's `except Exception`) let it through."""


def _started(pid: int) -> str:
    """The process's start time (Linux; "" elsewhere): a pid file names this very process, not a
    later one that reused its pid."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def collect_stacks(folder: str, wait_s: float = ANSWER_S) -> str:
    """Every registered process on this machine dumps its Python stacks (DUMP_SIGNAL ->
    faulthandler into its file in `folder`); their new text, per rank."""
    host, processes = socket.gethostname(), []
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".pid"):
            continue
        with open(os.path.join(folder, name)) as handle:
            their_host, pid, started = (handle.read().split() + [""])[:3]
        stacks = os.path.join(folder, name[:-4] + ".stacks")
        before = os.path.getsize(stacks) if os.path.exists(stacks) else 0
        state = "signalled"
        if their_host != host:
            state = f"on {their_host}: its own watchdog reports it"
        elif _started(int(pid)) != started:
            state = "gone"
        else:
            try:
                os.kill(int(pid), DUMP_SIGNAL)
            except ProcessLookupError:
                state = "gone"
        processes.append((name[:-4], int(pid), stacks, before, state))
    time.sleep(wait_s)
    parts = []
    for rank, pid, stacks, before, state in processes:
        text = ""
        if state == "signalled" and os.path.exists(stacks):
            with open(stacks, errors="replace") as handle:
                handle.seek(before)
                text = handle.read().strip()
        if state == "signalled" and not text:
            state = f"no answer within {wait_s:g} s: stopped (SIGSTOP) or stuck outside Python"
        parts.append(f"--- {rank} (pid {pid}): " + (text and "\n" + text or state))
    return "\n".join(parts)


def watchdog_folder(output_dir: str) -> str:
    """Where a run's processes on this machine register (pid, stack file): a local temporary folder
    per output_dir, so the output_dir holds nothing of it unless a step stalls (the report)."""
    import hashlib
    import tempfile

    key = hashlib.sha1(os.path.abspath(output_dir).encode()).hexdigest()[:12]
    return os.path.join(tempfile.gettempdir(), f"rloo-watchdog-{key}")


def awaiting(generator, sections: list[str]) -> str:
    """What a step stuck in `sections` waits for beyond this process: a generation server."""
    url = getattr(generator, "url", None)
    if url and ("generation" in sections or "weight_sync" in sections):
        return f" (the vLLM server at {url})"
    return ""


class StallWatchdog(TrainerCallback):
    """Watches `timer` from on_train_begin to on_train_end (optimizer steps only: an evaluation or
    a checkpoint between steps is not timed)."""

    def __init__(
        self,
        timer: StepTimer,
        args,
        rank: int,
        describe: Callable[[list[str]], str] = lambda sections: "",
    ):
        """`args`: stall_timeout_s and output_dir (RLOOConfig)."""
        self.timer, self.timeout_s, self.rank, self.describe = (
            timer,
            args.stall_timeout_s,
            rank,
            describe,
        )
        self.output_dir = args.output_dir
        self.folder = watchdog_folder(args.output_dir)
        self.stop_event, self.delivered = threading.Event(), threading.Event()
        self.thread: threading.Thread | None = None
        self.message, self.step = "", 0
        self._stack_file = self._previous_handler = None

    def on_train_begin(self, args, state, control, **kwargs):
        os.makedirs(self.folder, exist_ok=True)
        self._stack_file = open(os.path.join(self.folder, f"rank{self.rank}.stacks"), "w")
        faulthandler.register(DUMP_SIGNAL, file=self._stack_file, all_threads=True)
        with open(os.path.join(self.folder, f"rank{self.rank}.pid"), "w") as handle:
            handle.write(f"{socket.gethostname()} {os.getpid()} {_started(os.getpid())}")
        if threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(RAISE_SIGNAL, self._raise)
        self.stop_event.clear()
        self.thread = threading.Thread(target=self._watch, daemon=True, name="rloo-watchdog")
        self.thread.start()

    def on_step_begin(self, args, state, control, **kwargs):
        self.step = state.global_step + 1

    def on_train_end(self, args, state, control, **kwargs):
        self.close()

    def close(self) -> None:
        self.stop_event.set()
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self._stack_file is not None:
            faulthandler.unregister(DUMP_SIGNAL)
            self._stack_file.close()
            self._stack_file = None
            for suffix in (".pid", ".stacks"):
                path = os.path.join(self.folder, f"rank{self.rank}{suffix}")
                if os.path.exists(path):
                    os.remove(path)
            try:
                os.rmdir(self.folder)
            except OSError:  # another rank's files are still there
                pass
        if self._previous_handler is not None:
            signal.signal(RAISE_SIGNAL, self._previous_handler)
            self._previous_handler = None

    def _watch(self) -> None:
        poll = min(1.0, self.timeout_s / 10)
        last, cpu = time.monotonic(), time.process_time()
        suspended: list[tuple[float, float]] = []  # (when the process ran again, seconds stopped)
        while not self.stop_event.wait(poll):
            now, cpu_now = time.monotonic(), time.process_time()
            # woken late and the process used (almost) no CPU meanwhile: it was stopped (a main
            # thread computing without releasing the GIL also wakes this one late, but uses CPU)
            if now - last > poll + SUSPENDED_S and cpu_now - cpu < 0.25 * (now - last):
                suspended.append((now, now - last - poll))
            last, cpu, progress = now, cpu_now, self.timer.progress
            suspended = [(at, gap) for at, gap in suspended if at > progress]
            # only the time this process ran counts: a suspension is nobody's stall
            idle = now - progress - sum(min(gap, at - progress) for at, gap in suspended)
            if self.timer.in_step and idle > self.timeout_s:
                self._fire()
                return

    def _fire(self) -> None:
        sections = list(self.timer.open)
        where = " > ".join(sections) or "the optimizer step (between sections)"
        report = report_path(self.output_dir, self.rank)
        self.message = (
            f"training stalled: rank {self.rank} made no progress for {self.timeout_s:g} s "
            f"(stall_timeout_s) in step {self.step}, waiting in {where}{self.describe(sections)}. "
            f"The stacks of every process: {report}. The run resumes from its last checkpoint."
        )
        text = self.message + "\n\n" + collect_stacks(self.folder) + "\n"
        os.makedirs(self.output_dir, exist_ok=True)
        temporary = f"{report}.tmp"
        with open(temporary, "w") as handle:
            handle.write(text)
        os.replace(temporary, report)
        print(self.message, file=sys.stderr, flush=True)
        signal.pthread_kill(threading.main_thread().ident, RAISE_SIGNAL)
        # a main thread blocked in native code runs no Python signal handler until that returns
        if not self.delivered.wait(min(GRACE_S, self.timeout_s)):
            sys.stderr.flush()
            os._exit(STALLED_EXIT_CODE)

    def _raise(self, signum, frame):
        if not self.message:  # not ours
            return
        self.delivered.set()
        raise TrainingStalled(self.message)
