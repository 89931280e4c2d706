import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import final_weights, reward_history, run, write_recipe  # noqa: E402


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """The uninterrupted runs every fault test compares with: {nproc: recipe}, {nproc: (weights, rewards)}."""
    folder = tmp_path_factory.mktemp("reference")
    recipes = {nproc: write_recipe(str(folder), nproc) for nproc in (1, 2)}
    runs = {}
    for nproc, recipe in recipes.items():
        output_dir = str(folder / f"out-{nproc}")
        done = run(recipe, output_dir, nproc)
        assert done.returncode == 0, done.stdout[-3000:]
        runs[nproc] = (final_weights(output_dir), reward_history(output_dir))
    return recipes, runs
