"""kill -9 anywhere, resume with `latest`: the same final weights and the same reward history as the uninterrupted
run, no step missing or doubled (tests/faults/harness.py). `python tests/faults/many.py --many 50` draws random
kill moments instead, for a long local run."""

import pytest
import torch

from harness import MAX_STEPS, final_weights, reward_history, run, write_recipe

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    folder = tmp_path_factory.mktemp("reference")
    recipes = {nproc: write_recipe(str(folder), nproc) for nproc in (1, 2)}
    runs = {}
    for nproc, recipe in recipes.items():
        output_dir = str(folder / f"out-{nproc}")
        done = run(recipe, output_dir, nproc)
        assert done.returncode == 0, done.stdout[-3000:]
        runs[nproc] = (final_weights(output_dir), reward_history(output_dir))
    return recipes, runs


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
    weights, history = runs[nproc]
    got = final_weights(output_dir)
    assert got.keys() == weights.keys()
    for key in weights:
        assert torch.allclose(got[key], weights[key], atol=1e-6), key
    steps = [step for step, _ in reward_history(output_dir)]
    assert steps == list(range(1, MAX_STEPS + 1))  # none missing, none doubled
    assert [r for _, r in reward_history(output_dir)] == pytest.approx([r for _, r in history])
