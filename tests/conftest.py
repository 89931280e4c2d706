import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from rloo.testing import tiny_causal_lm, tiny_tokenizer  # noqa: E402


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
