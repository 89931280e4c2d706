"""transformers continuous batching as the generation backend."""

import pytest
import torch

from helpers import (
    assert_step_timing,
    conversational,
    length_reward,
    logged,
    make_args,
    position_reward,
)
from rloo import RLOOTrainer
from rloo.generation import ContinuousBatchingGenerator, TransformersGenerator


def test_greedy_continuous_batching_equals_generate(tmp_path, tokenizer, model):
    args = make_args(
        tmp_path,
        use_transformers_continuous_batching=True,
        generation_kwargs={"do_sample": False},
        max_completion_length=8,
    )
    trainer = RLOOTrainer(
        model=model,
        reward_funcs=length_reward,
        args=args,
        train_dataset=conversational(),
        processing_class=tokenizer,
    )
    assert isinstance(trainer.generator, ContinuousBatchingGenerator)
    prompts = [
        tokenizer(text)["input_ids"] for text in ["the dog sat", "one two three four", "red"]
    ]
    paged = trainer.generator.generate(model, prompts)
    reference = TransformersGenerator(
        trainer.generator.generation_config, trainer.pad_token_id, trainer.eos_token_ids
    ).generate(model, prompts)
    assert paged == reference
    eos = tokenizer.eos_token_id
    assert all(len(ids) <= 8 and eos not in ids[:-1] for ids in paged)


def test_trains_with_continuous_batching_and_user_config(tmp_path, tokenizer, model):
    before = [p.detach().clone() for p in model.parameters()]
    args = make_args(
        tmp_path,
        use_transformers_continuous_batching=True,
        max_steps=2,
        transformers_continuous_batching_config={"num_blocks": 64, "page_size": 8},
    )
    trainer = RLOOTrainer(
        model=model,
        reward_funcs=position_reward,
        args=args,
        train_dataset=conversational(),
        processing_class=tokenizer,
    )
    engine = trainer.generator._engine_config([[1, 2, 3]])
    assert (engine.num_blocks, engine.page_size) == (64, 8)
    trainer.train()
    assert len(logged(trainer, "reward")) == 2
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert_step_timing(trainer.state.log_history)


def test_paged_alias_is_deprecated_but_works(tmp_path, tokenizer, model):
    with pytest.warns(FutureWarning, match="use_transformers_paged is deprecated"):
        args = make_args(tmp_path, use_transformers_paged=True)
    trainer = RLOOTrainer(
        model=model,
        reward_funcs=length_reward,
        args=args,
        train_dataset=conversational(),
        processing_class=tokenizer,
    )
    assert isinstance(trainer.generator, ContinuousBatchingGenerator)


def test_default_cache_is_sized_to_the_batch(tmp_path, tokenizer, model):
    from transformers import GenerationConfig

    generator = ContinuousBatchingGenerator(GenerationConfig(max_new_tokens=20), [2])
    engine = generator._engine_config([[1] * 10, [1] * 30])
    assert engine.num_blocks == 2 + 4 + 2  # ceil(30/16) + ceil(50/16) pages + one spare per request
