"""The offline stand-ins that scripts/trl_suite.py runs TRL's own RLOO test file on (the run itself
needs a TRL checkout, so it is not part of this suite): the Hub cache they fill loads with the Hub
unreachable, and the zen datasets have TRL's shapes."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))

import trl_suite  # noqa: E402


def test_the_zen_stand_ins_have_trls_splits_and_columns():
    standard = trl_suite.zen_dataset("zen", "standard_prompt_only")
    assert (len(standard["train"]), len(standard["test"])) == (17, 2)
    assert all(isinstance(p, str) and p for p in standard["train"]["prompt"])
    chat = trl_suite.zen_dataset("zen-image", "conversational_prompt_only")["train"]
    assert chat[0]["prompt"][0]["role"] == "user" and chat[0]["image"].size[0] >= 32
    multi = trl_suite.zen_dataset("zen-multi-image", "conversational_prompt_only")["train"]
    for row in multi:
        parts = row["prompt"][0]["content"]
        assert sum(part["type"] == "image" for part in parts) == len(row["images"]) >= 1
    with pytest.raises(ValueError, match="no stand-in for trl-internal-testing/zen-image"):
        trl_suite.zen_dataset("zen-image", "standard_prompt_only")


def test_the_stand_in_models_load_from_the_hub_cache_offline(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    hub = str(tmp_path / "hub")
    trl_suite.build_models(hub)
    repo = f"{trl_suite.ORG}/tiny-Qwen2ForCausalLM-2.5"
    offline = dict(cache_dir=hub, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(repo, **offline)
    # Qwen2.5's special-token ids (TRL's mask_truncated_completions test writes them), and a prompt
    # that tokenizes (a tokenizer class re-reading another's files gives no ids)
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id) == (151643, 151645)
    ids = tokenizer("Complex is better")["input_ids"]
    assert len(ids) == len("Complex is better")
    model = AutoModelForCausalLM.from_pretrained(repo, **offline)
    assert model.config.vocab_size > 151645
    out = model.generate(tokenizer("Complex", return_tensors="pt")["input_ids"], max_new_tokens=2)
    assert out.shape == (1, len("Complex") + 2)
    vlm = AutoConfig.from_pretrained(
        f"{trl_suite.ORG}/tiny-Qwen2_5_VLForConditionalGeneration", **offline
    )
    assert vlm.model_type == "qwen2_5_vl"
