import os
import tempfile

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# trackio reads its folder once, at import: the suite's runs go to a folder of their own, not ~/.cache
os.environ.setdefault("TRACKIO_DIR", tempfile.mkdtemp(prefix="rloo-tests-trackio-"))

import torch  # noqa: E402

from tiny_models import tiny_causal_lm, tiny_tokenizer  # noqa: E402

# The suite runs many processes at once on a few cores (ranks, sweep trials, SLURM "nodes" that share
# this machine, servers): each child's torch taking a thread per core oversubscribes the cores (the
# 4+1 SLURM test ran 30% slower). Children get one thread each; this process keeps torch's default,
# shared with the other pytest-xdist workers running beside it.
_threads = torch.get_num_threads()
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(max(1, _threads // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))


# The files that take longest, longest first. With `-n 2 --dist loadfile` a file runs whole on one
# worker, in the collected order: a heavy file that starts last keeps one worker busy while the
# other has nothing left (longest-processing-time-first scheduling). The order is that of the files'
# total time in a full run on 2 cores (`--durations=0`); the rest follow in the usual order.
SLOWEST_FILES = (
    "test_slurm.py",
    "test_deepspeed.py",
    "test_vllm_colocate.py",
    "test_deployments.py",
    "test_pipeline.py",
    "test_async_kill_points.py",
    "test_kill_points.py",
    "test_sweep.py",
    "test_pipeline_kill.py",
    "test_vllm_server.py",
    "test_team_database.py",
    "test_prefect_outages.py",
    "test_packaging.py",
    "test_operations.py",
    "test_vision.py",
)


def pytest_configure(config):
    # pytest-xdist would otherwise reorder the files by their number of tests
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    rank = {name: index for index, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: in-file order kept


def pytest_generate_tests(metafunc):
    """A test marked `engines` runs twice: with the speed layer on and off (RLOO_ENGINE=reference)."""
    if metafunc.definition.get_closest_marker("engines"):
        metafunc.fixturenames.append("engine_mode")
        metafunc.parametrize("engine_mode", ["fast", "reference"], indirect=True)


@pytest.fixture
def engine_mode(request, monkeypatch):
    monkeypatch.setenv("RLOO_ENGINE", request.param)
    return request.param


@pytest.fixture
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture
def model(tokenizer):
    return tiny_causal_lm(tokenizer)


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real MLflow tracking server (SQLite store) for one test module."""
    from services import MlflowServer

    server = MlflowServer(str(tmp_path_factory.mktemp("mlflow"))).start()
    yield server
    server.stop()
