"""kill -9 anywhere, resume with `latest`: the same final weights and the same reward history as the uninterrupted
run, no step missing or doubled (tests/faults/harness.py). `python tests/faults/many.py --many 50` draws random
kill moments instead, for a long local run."""

import pytest
from harness import assert_same_as_reference, run

pytestmark = pytest.mark.slow

POINTS = [  # (id, processes, kill settings, what the killed run's exit looks like)
    ("during-generation", 1, dict(point="generation", at=3)),
    ("optimizer-step", 1, dict(point="optimizer-step", at=3)),
    ("after-a-step", 1, dict(point="step-end", at=4)),
    ("mid-save", 1, dict(point="mid-save", at=3)),
    ("save-before-its-marker", 1, dict(point="before-marker", at=2)),
    ("after-the-last-step", 1, dict(point="train-end", at=1)),
    ("torchrun-agent", 2, dict(point="step-end", at=3, target="agent")),
    ("one-of-two-ranks", 2, dict(point="optimizer-step", at=3, rank=1)),
]


@pytest.mark.parametrize("name,nproc,kill", POINTS, ids=[p[0] for p in POINTS])
def test_killed_and_resumed_matches_the_uninterrupted_run(reference, tmp_path, name, nproc, kill):
    recipes, runs = reference
    output_dir = str(tmp_path / "out")
    killed = run(recipes[nproc], output_dir, nproc, **kill)
    assert killed.returncode != 0, killed.stdout[-3000:]  # it really died there
    resumed = run(recipes[nproc], output_dir, nproc)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert_same_as_reference(output_dir, runs[nproc])
