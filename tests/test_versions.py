"""The library versions: a dependency outside rloo's ranges is refused at import with the fix, and what
transformers 4.x (the oldest releases in range) cannot do here is refused by name, not failed mid-run. Run
on the lowest versions of every range and on the newest releases too (tests/test_packaging.py)."""

import os
import subprocess
import sys

import pytest
import transformers

from helpers import conversational, length_reward, make_args
from rloo import RLOOTrainer
from rloo.versions import TRANSFORMERS_4, check_installed


def test_a_dependency_outside_its_range_is_refused_at_import_with_the_fix(tmp_path, monkeypatch):
    """Read from the installed distribution's own requirements (pyproject.toml's ranges): one source."""
    info = tmp_path / "someapp-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: someapp\nVersion: 1.0\n"
        "Requires-Dist: transformers>=99\nRequires-Dist: torch>=1\n"
        'Requires-Dist: wandb>=99; extra == "trackers"\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        ImportError,
        match=rf"someapp needs transformers>=99; transformers "
        rf"{transformers.__version__} is installed\. Fix: pip install "
        r"'transformers>=99'\.",
    ):
        check_installed("someapp")
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: someapp\nVersion: 1.0\n"
        'Requires-Dist: transformers>=1\nRequires-Dist: wandb>=99; extra == "trackers"\n'
    )
    check_installed("someapp")  # an extra's requirement is the extra's business


def test_rloo_imports_on_the_versions_installed_here():
    """The import check passes on each environment the suite runs in (the lowest, the pinned, the newest)."""
    result = subprocess.run(
        [sys.executable, "-c", "import rloo"],
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.dirname(__file__)),
    )
    assert result.returncode == 0, result.stderr


def test_each_trainer_takes_its_own_mixed_precision(tmp_path, tokenizer, model):
    """transformers 4.x hands the precision to accelerate through the process environment: a bf16 run before a
    float32 one in the same process (a notebook) must not make the second train in bf16."""
    for bf16 in (True, False):
        trainer = RLOOTrainer(
            model=model,
            reward_funcs=length_reward,
            args=make_args(tmp_path / str(bf16), bf16=bf16),
            train_dataset=conversational(),
            processing_class=tokenizer,
        )
        assert trainer.accelerator.mixed_precision == ("bf16" if bf16 else "no")


def test_continuous_batching_needs_transformers_5(tmp_path):
    if TRANSFORMERS_4:
        with pytest.raises(
            ValueError,
            match=rf"use_transformers_continuous_batching=True needs transformers 5.*"
            rf"transformers {transformers.__version__} is installed.*Fix: pip "
            r"install -U 'transformers>=5'",
        ):
            make_args(tmp_path, use_transformers_continuous_batching=True)
    else:
        assert make_args(
            tmp_path, use_transformers_continuous_batching=True
        ).use_transformers_continuous_batching


@pytest.mark.skipif(
    not TRANSFORMERS_4, reason="transformers 5 trains vision-language models (tests/test_vision.py)"
)
def test_a_vision_language_model_is_refused_on_transformers_4(tmp_path, tokenizer):
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    config = LlavaConfig(
        text_config=dict(
            model_type="llama",
            vocab_size=len(tokenizer),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
        ),
        vision_config=dict(
            model_type="clip_vision_model",
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=16,
            patch_size=8,
        ),
        image_token_index=3,
    )
    with pytest.raises(
        ValueError,
        match=r"LlavaForConditionalGeneration is a vision-language model.*transformers "
        rf"{transformers.__version__} is installed\. Fix: pip install -U "
        r"'transformers>=5'",
    ):
        RLOOTrainer(
            model=LlavaForConditionalGeneration(config),
            reward_funcs=length_reward,
            args=make_args(tmp_path),
            train_dataset=conversational(),
            processing_class=tokenizer,
        )
