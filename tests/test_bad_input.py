"""Bad input fails early, names the field and the fix, and writes nothing."""

import os

import pytest
from datasets import Dataset

from rloo import RLOOConfig, RLOOTrainer
from tiny_models import tiny_tokenizer

PROMPTS = [
    {"prompt": [{"role": "user", "content": w}]} for w in ["the dog", "a cat", "one two", "boom"]
]


def args(tmp_path, **kwargs):
    settings = dict(
        output_dir=str(tmp_path / "out"),
        bf16=False,
        use_cpu=True,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=4,
        max_steps=1,
        report_to="none",
        save_strategy="no",
        beta=0.0,
        disable_tqdm=True,
        shuffle_dataset=False,
    )
    settings.update(kwargs)
    return RLOOConfig(**settings)


def ok_reward(completions, **kwargs):
    return [1.0] * len(completions)


def build(tmp_path, model, tokenizer, reward_funcs=ok_reward, dataset=None, **kwargs):
    return RLOOTrainer(
        model=model,
        reward_funcs=reward_funcs,
        args=kwargs.pop("config", None) or args(tmp_path),
        train_dataset=Dataset.from_list(PROMPTS) if dataset is None else dataset,
        processing_class=tokenizer,
        **kwargs,
    )


@pytest.fixture(autouse=True)
def nothing_written(tmp_path):
    yield
    assert not os.path.exists(tmp_path / "out"), (
        "a failed start must not write the output directory"
    )


def test_dataset_without_prompt_column(tmp_path, model, tokenizer):
    with pytest.raises(ValueError, match="no 'prompt' column.*question.*rename_column"):
        build(tmp_path, model, tokenizer, dataset=Dataset.from_list([{"question": "x"}]))


def test_empty_dataset(tmp_path, model, tokenizer):
    with pytest.raises(ValueError, match="empty"):
        build(tmp_path, model, tokenizer, dataset=Dataset.from_dict({"prompt": []}))


def test_reward_weights_length(tmp_path, model, tokenizer):
    with pytest.raises(ValueError, match="reward_weights has 2 entries but there are 1"):
        build(tmp_path, model, tokenizer, config=args(tmp_path, reward_weights=[1.0, 2.0]))


def test_reward_processing_classes_length(tmp_path, model, tokenizer):
    with pytest.raises(ValueError, match="reward_processing_classes has 2 entries.*must match"):
        build(tmp_path, model, tokenizer, reward_processing_classes=[tokenizer, tokenizer])


def test_missing_model_path(tmp_path, tokenizer):
    missing = str(tmp_path / "no" / "such" / "model")
    with pytest.raises(FileNotFoundError, match="no such directory"):
        build(tmp_path, missing, tokenizer)


def test_tokenizer_without_pad_or_eos(tmp_path, model):
    tokenizer = tiny_tokenizer()
    tokenizer.pad_token = None
    tokenizer.eos_token = None
    with pytest.raises(ValueError, match="neither a pad token nor an EOS token.*Fix"):
        build(tmp_path, model, tokenizer)


def test_batch_not_divisible_by_num_generations(tmp_path):
    with pytest.raises(ValueError, match="divisible by num_generations"):
        args(tmp_path, per_device_train_batch_size=3, num_generations=2)


def test_max_completion_length_not_positive(tmp_path):
    with pytest.raises(ValueError, match="max_completion_length=0"):
        args(tmp_path, max_completion_length=0)


def test_iterable_dataset_needs_max_steps(tmp_path, model, tokenizer):
    iterable = Dataset.from_list(PROMPTS).to_iterable_dataset()
    with pytest.raises(ValueError, match="max_steps"):
        build(tmp_path, model, tokenizer, dataset=iterable, config=args(tmp_path, max_steps=-1))
