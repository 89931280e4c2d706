"""Datasets: evaluation sets in every documented form, streaming training, shuffling, padding, columns, cache."""

import pytest
import torch
from datasets import DatasetDict, IterableDataset

from helpers import conversational, length_reward, logged, make_args, position_reward, standard
from rloo import RLOOTrainer
from rloo.sampling import repeat_iterable


def evaluate_with(tmp_path, tokenizer, model, eval_dataset, **kwargs):
    args = make_args(tmp_path, per_device_eval_batch_size=4, **kwargs)
    trainer = RLOOTrainer(
        model=model,
        reward_funcs=length_reward,
        args=args,
        train_dataset=conversational(),
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
    )
    return trainer, trainer.evaluate()


def test_eval_dataset_single(tmp_path, tokenizer, model):
    trainer, metrics = evaluate_with(tmp_path, tokenizer, model, conversational(4))
    for key in ("eval_loss", "eval_reward", "eval_completions/mean_length", "eval_entropy"):
        assert key in metrics, key
    assert metrics["eval_reward"] == pytest.approx(metrics["eval_completions/mean_length"])
    assert trainer.state.log_history[-1]["eval_reward"] == metrics["eval_reward"]


@pytest.mark.parametrize("kind", ["dict", "DatasetDict"])
def test_eval_dataset_dict_prefixes_metrics_per_name(tmp_path, tokenizer, model, kind):
    datasets_ = {"math": conversational(4), "chat": standard(4)}
    _, metrics = evaluate_with(
        tmp_path, tokenizer, model, datasets_ if kind == "dict" else DatasetDict(datasets_)
    )
    for name in ("math", "chat"):
        assert f"eval_{name}_loss" in metrics and f"eval_{name}_reward" in metrics
        assert f"eval_{name}_completions/mean_length" in metrics
    assert "eval_reward" not in metrics


def test_iterable_eval_dataset_and_num_generations_eval(tmp_path, tokenizer, model):
    groups = []

    def reward(prompts, **kwargs):
        groups.append(list(prompts))
        return [1.0] * len(prompts)

    args = make_args(tmp_path, per_device_eval_batch_size=3, num_generations_eval=3)
    trainer = RLOOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=conversational(),
        eval_dataset=conversational(2).to_iterable_dataset(),
        processing_class=tokenizer,
    )
    groups.clear()
    metrics = trainer.evaluate()
    assert "eval_reward" in metrics
    assert len(groups) == 2 and all(
        len(batch) == 3 and all(p == batch[0] for p in batch) for batch in groups
    )
    assert groups[0] != groups[1]


def test_a_stream_handed_to_evaluate_later_is_evaluated(tmp_path, tokenizer, model):
    """Built with map-style sets only, then evaluate() of an IterableDataset, an IterableDatasetDict or a dict of
    streams (what TRL's tests do): each process reads its slice, nothing is dispatched from rank 0."""
    from datasets import IterableDatasetDict

    trainer = RLOOTrainer(
        model=model,
        reward_funcs=length_reward,
        args=make_args(tmp_path, per_device_eval_batch_size=4),
        train_dataset=conversational(),
        processing_class=tokenizer,
    )
    assert "eval_reward" in trainer.evaluate(conversational(4).to_iterable_dataset())
    for streams in (
        {"a": conversational(4).to_iterable_dataset()},
        IterableDatasetDict({"a": conversational(4).to_iterable_dataset()}),
    ):
        assert "eval_a_reward" in trainer.evaluate(streams)


def test_eval_during_training(tmp_path, tokenizer, model):
    args = make_args(
        tmp_path, eval_strategy="steps", eval_steps=1, max_steps=2, per_device_eval_batch_size=2
    )
    trainer = RLOOTrainer(
        model=model,
        reward_funcs=length_reward,
        args=args,
        train_dataset=conversational(),
        eval_dataset=conversational(2),
        processing_class=tokenizer,
    )
    trainer.train()
    assert len(logged(trainer, "eval_reward")) == 2 and len(logged(trainer, "reward")) == 2


def test_eval_batch_must_hold_whole_groups(tmp_path, tokenizer, model):
    args = make_args(tmp_path, per_device_eval_batch_size=3, num_generations_eval=2)
    trainer = RLOOTrainer(
        model=model,
        reward_funcs=length_reward,
        args=args,
        train_dataset=conversational(),
        eval_dataset=conversational(2),
        processing_class=tokenizer,
    )
    with pytest.raises(
        ValueError, match="per_device_eval_batch_size 3.*divisible by num_generations_eval"
    ):
        trainer.evaluate()


def test_eval_strategy_without_eval_dataset(tmp_path, tokenizer, model):
    with pytest.raises(ValueError, match="eval_strategy='steps' but no eval_dataset"):
        RLOOTrainer(
            model=model,
            reward_funcs=length_reward,
            args=make_args(tmp_path, eval_strategy="steps"),
            train_dataset=conversational(),
            processing_class=tokenizer,
        )


def test_repeat_iterable_matches_the_sampler_order():
    stream = standard(5).to_iterable_dataset()
    rows = [
        row["tag"]
        for row in repeat_iterable(stream, batch_size=2, mini_repeat_count=2, repeat_count=2)
    ]
    assert rows == [
        0,
        0,
        1,
        1,
        0,
        0,
        1,
        1,
        2,
        2,
        3,
        3,
        2,
        2,
        3,
        3,
    ]  # trailing incomplete chunk (4) dropped


def test_train_on_iterable_dataset(tmp_path, tokenizer, model):
    seen = []

    def reward(tag, completion_ids, **kwargs):
        seen.append(list(tag))
        return position_reward(completion_ids)

    def stream():
        for row in conversational(16):
            yield row

    before = [p.detach().clone() for p in model.parameters()]
    args = make_args(tmp_path, max_steps=3, shuffle_dataset=False, dataloader_num_workers=2)
    trainer = RLOOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=IterableDataset.from_generator(stream),
        processing_class=tokenizer,
    )
    assert trainer.args.accelerator_config.dispatch_batches is False
    assert (
        trainer.args.dataloader_num_workers == 0
    )  # one reader keeps the groups together, as TRL sets it
    trainer.train()
    assert seen == [[0, 0, 1, 1], [2, 2, 3, 3], [4, 4, 5, 5]]
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_iterable_dataset_refuses_dispatch_batches(tmp_path, tokenizer, model):
    args = make_args(tmp_path, accelerator_config={"dispatch_batches": True})
    # (TRL's words first: its users and tests match on them)
    with pytest.raises(ValueError, match="^Iterable datasets require `dispatch_batches=False`: "):
        RLOOTrainer(
            model=model,
            reward_funcs=length_reward,
            args=args,
            train_dataset=conversational().to_iterable_dataset(),
            processing_class=tokenizer,
        )
    # before the missing max_steps, as TRL orders its checks
    args = make_args(tmp_path, accelerator_config={"dispatch_batches": True}, max_steps=-1)
    with pytest.raises(ValueError, match="dispatch_batches"):
        RLOOTrainer(
            model=model,
            reward_funcs=length_reward,
            args=args,
            train_dataset=conversational().to_iterable_dataset(),
            processing_class=tokenizer,
        )


def test_shuffle_dataset(tmp_path, tokenizer, model):
    def order(shuffle):
        seen = []

        def reward(tag, trainer_state, **kwargs):
            if trainer_state is not None:  # not the pre-flight call
                seen.extend(tag[::2])
            return [0.0] * len(tag)

        trainer = RLOOTrainer(
            model=model,
            reward_funcs=reward,
            args=make_args(tmp_path, max_steps=4, shuffle_dataset=shuffle, learning_rate=0.0),
            train_dataset=conversational(8),
            processing_class=tokenizer,
        )
        trainer.train()
        return seen

    assert order(False) == list(range(8))
    shuffled = order(True)
    assert sorted(shuffled) == list(range(8)) and shuffled != list(range(8))
    assert order(True) == shuffled  # seeded


def test_pad_to_multiple_of(tmp_path, tokenizer, model):
    shapes = []
    trainer = RLOOTrainer(
        model=model,
        reward_funcs=length_reward,
        args=make_args(tmp_path, pad_to_multiple_of=16, max_steps=1),
        train_dataset=conversational(),
        processing_class=tokenizer,
    )
    original = trainer.compute_loss

    def spy(model_, inputs, *args, **kwargs):
        shapes.append((inputs.prompt_ids.shape[1], inputs.completion_ids.shape[1]))
        return original(model_, inputs, *args, **kwargs)

    trainer.compute_loss = spy
    trainer.train()
    assert shapes and all(p % 16 == 0 and c % 16 == 0 for p, c in shapes)


@pytest.mark.parametrize("remove", [True, False])
def test_remove_unused_columns(tmp_path, tokenizer, model, remove):
    seen = {}

    def reward(prompts, **kwargs):
        seen.update(kwargs)
        return [0.0] * len(prompts)

    RLOOTrainer(
        model=model,
        reward_funcs=reward,
        args=make_args(tmp_path, remove_unused_columns=remove, max_steps=1),
        train_dataset=conversational(),
        processing_class=tokenizer,
    ).train()
    assert ("tag" in seen) is not remove


def test_cache_implementation_reaches_generation(tmp_path, tokenizer, model):
    trainer = RLOOTrainer(
        model=model,
        reward_funcs=length_reward,
        args=make_args(tmp_path, cache_implementation="static", max_steps=1),
        train_dataset=conversational(),
        processing_class=tokenizer,
    )
    assert trainer.generator.generation_config.cache_implementation == "static"
    trainer.train()
    assert logged(trainer, "completions/mean_length")


def test_prompt_from_a_text_column_and_a_system_prompt():
    """rloo train's dataset_prompt_column / system_prompt (the TRL docs' example scripts map their data so)."""
    from datasets import Dataset

    from rloo.data import with_prompt

    rows = Dataset.from_list([{"problem": "2+2?", "solution": "4"}])
    assert with_prompt(rows, "problem", "think first")[0]["prompt"] == [
        {"role": "system", "content": "think first"},
        {"role": "user", "content": "2+2?"},
    ]
    with pytest.raises(
        ValueError, match=r"dataset_prompt_column='question': no such column \(columns: \['problem'"
    ):
        with_prompt(rows, "question", None)
    with pytest.raises(ValueError, match="system_prompt needs conversational prompts"):
        with_prompt(Dataset.from_list([{"prompt": "2+2?"}]), None, "think first")
