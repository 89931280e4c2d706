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
