"""Named fault-injection points for the kill tests (tests/faults): with RLOO_TEST_KILL_POINT=<name>
and RLOO_TEST_KILL_AT=<n> in the environment, the process (or, with RLOO_TEST_KILL_TARGET=agent, its
parent: the torchrun agent) is killed with SIGKILL the n-th time it reaches that point;
RLOO_TEST_KILL_RANK picks the rank (default 0). Without those variables, `point` does nothing."""

from __future__ import annotations

import os
import signal
from collections import Counter

_reached: Counter = Counter()


def point(name: str) -> None:
    if os.environ.get("RLOO_TEST_KILL_POINT") != name:
        return
    if os.environ.get("RANK", "0") != os.environ.get("RLOO_TEST_KILL_RANK", "0"):
        return
    _reached[name] += 1
    if _reached[name] == int(os.environ.get("RLOO_TEST_KILL_AT", "1")):
        target = os.getppid() if os.environ.get("RLOO_TEST_KILL_TARGET") == "agent" else os.getpid()
        os.kill(target, signal.SIGKILL)
