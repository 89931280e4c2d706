"""A disk that fills up during a checkpoint save or the final save, and a reward function that raises only
sometimes: `rloo train`
stops with an error naming the cause and how to go on, only complete checkpoints are left, and once the cause is
gone the resumed run ends with the uninterrupted run's weights and rewards (tests/faults/harness.py)."""

import os
import re
import subprocess

import pytest
from harness import assert_same_as_reference, run

from rloo.checkpoint import CHECKPOINT, is_complete

pytestmark = pytest.mark.slow


def _checkpoints(output_dir: str) -> list[str]:
    return sorted(
        (name for name in os.listdir(output_dir) if CHECKPOINT.fullmatch(name)),
        key=lambda name: int(name.split("-")[1]),
    )


@pytest.fixture
def small_disk(tmp_path):
    """A 900 KiB tmpfs: two checkpoints of the harness's tiny run (~356 KiB each) fit, a third does not."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=900k", "tmpfs", str(mount)], check=True)
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint_and_resumes(reference, small_disk):
    recipes, runs = reference
    output_dir = str(small_disk / "out")
    full = run(recipes[1], output_dir)
    assert full.returncode == 1, full.stdout[-3000:]
    message = re.search(r"rloo train: error: (.*)\n(.*)", full.stdout)
    assert message, full.stdout[-3000:]
    assert (
        f"no space left on the device of {output_dir} while saving {output_dir}/checkpoint-3"
        in message[1]
    )
    assert re.search(
        r"MiB are free, a checkpoint of this run takes 0\.3 MiB \(checkpoint-2 is intact\)\. Fix: free "
        r"space",
        message[1],
    )
    assert (
        "checkpoint-2 is complete" in message[2] and "--resume_from_checkpoint latest" in message[2]
    )
    assert "Traceback" not in full.stdout
    assert _checkpoints(output_dir) == [
        "checkpoint-1",
        "checkpoint-2",
    ]  # the partial checkpoint-3 was removed
    assert all(is_complete(os.path.join(output_dir, name)) for name in _checkpoints(output_dir))
    subprocess.run(["mount", "-o", "remount,size=16m", str(small_disk)], check=True)  # space freed
    resumed = run(recipes[1], output_dir)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert_same_as_reference(output_dir, runs[1])


def test_a_full_disk_at_the_final_save_leaves_no_partial_model_and_resumes(reference, small_disk):
    recipes, runs = reference
    output_dir, filler = str(small_disk / "out"), small_disk / "filler"
    subprocess.run(["mount", "-o", "remount,size=16m", str(small_disk)], check=True)
    full = run(recipes[1], output_dir, env={"RLOO_TEST_FILL_DISK_AT_END": str(filler)})
    assert full.returncode == 1, full.stdout[-3000:]
    assert (
        f"rloo train: error: [Errno 28] no space left on the device of {output_dir} while saving the final "
        "model" in full.stdout
    ), full.stdout[-3000:]
    assert "checkpoint-6 is complete" in full.stdout and "Traceback" not in full.stdout
    assert not [
        name for name in os.listdir(output_dir) if not CHECKPOINT.fullmatch(name)
    ]  # no partial model
    filler.unlink()  # space freed
    resumed = run(recipes[1], output_dir)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert_same_as_reference(output_dir, runs[1])


def test_a_reward_that_raises_once_stops_the_step_and_the_run_resumes(reference, tmp_path):
    recipes, runs = reference
    output_dir = str(tmp_path / "out")
    failed = run(recipes[1], output_dir, env={"RLOO_TEST_REWARD_RAISES_AT": "4"})
    assert failed.returncode == 1, failed.stdout[-3000:]
    assert (
        "rloo train: error in step 4: reward function 'position_reward' raised ConnectionError: the grading "
        "service dropped the connection (on the batch of 4 rows; no single row reproduces it)"
    ) in failed.stdout
    assert f"{output_dir}/checkpoint-3 is complete: fix the cause" in failed.stdout
    assert "Traceback" not in failed.stdout
    resumed = run(recipes[1], output_dir)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert_same_as_reference(output_dir, runs[1])
