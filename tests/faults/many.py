"""Random kill moments: `python tests/faults/many.py --many 50` runs the uninterrupted reference once, then N times
starts `rloo train`, SIGKILLs its process group after a random delay (anywhere: start-up, generation, the update,
a save), resumes it with `latest`, and checks the final weights and reward history against the reference. Prints
one line per trial and the count that survived."""

import argparse
import os
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import MAX_STEPS, final_weights, reward_history, run, write_recipe  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--many", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-delay",
        type=float,
        default=None,
        help="kill within this many seconds of the start "
        "(default: the uninterrupted run's wall time, so that every kill lands before it ends)",
    )
    options = parser.parse_args()
    draw = random.Random(options.seed)
    folder = tempfile.mkdtemp(prefix="rloo-faults-")
    recipe = write_recipe(folder, 1)
    start = time.time()
    done = run(recipe, os.path.join(folder, "reference"))
    assert done.returncode == 0, done.stdout[-3000:]
    max_delay = options.max_delay or time.time() - start
    weights, history = (
        final_weights(os.path.join(folder, "reference")),
        reward_history(os.path.join(folder, "reference")),
    )
    survived = 0
    for trial in range(options.many):
        delay = draw.uniform(0.5, max_delay)
        output_dir = os.path.join(folder, f"trial-{trial}")
        killed = run(recipe, output_dir, kill_after_s=delay)
        resumed = run(recipe, output_dir)
        ok = resumed.returncode == 0
        if ok:
            got = final_weights(output_dir)
            ok = (
                all(torch.allclose(got[k], weights[k], atol=1e-6) for k in weights)
                and [s for s, _ in reward_history(output_dir)] == list(range(1, MAX_STEPS + 1))
                and all(
                    abs(a - b) < 1e-6 for (_, a), (_, b) in zip(reward_history(output_dir), history)
                )
            )
        survived += ok
        print(
            f"trial {trial}: killed after {delay:.2f} s ({'died' if killed.returncode else 'had finished'}), "
            f"resumed: {'same weights and history' if ok else 'DIFFERENT or failed'}",
            flush=True,
        )
    print(
        f"survived {survived}/{options.many} random kill points in {time.time() - start:.0f} s ({folder})"
    )
    return 0 if survived == options.many else 1


if __name__ == "__main__":
    sys.exit(main())
