"""Sampler semantics, the generation buffer, and how RLOOConfig reaches generation."""

import pytest
import torch
from datasets import Dataset

from rloo import RLOOConfig, RLOOTrainer
from rloo.generation.transformers_backend import build_generation_config
from rloo.models import prepare_tokenizer
from rloo.sampling import RepeatSampler, shuffle_rows, split_rows
from tiny_models import tiny_causal_lm, tiny_tokenizer


def test_repeat_sampler_order_and_length():
    sampler = RepeatSampler(5, mini_repeat_count=2, batch_size=2, repeat_count=2, shuffle=False)
    assert list(sampler) == [
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
    ]  # index 4: incomplete chunk dropped
    assert len(sampler) == 16


def test_repeat_sampler_is_reproducible_per_epoch():
    a = RepeatSampler(10, 2, batch_size=5, seed=3)
    b = RepeatSampler(10, 2, batch_size=5, seed=3)
    first = list(a)
    a.set_epoch(1)
    second = list(a)
    assert first != second
    b.set_epoch(1)
    assert list(b) == second  # a resumed run replays the same epoch order


def test_shuffle_and_split_keep_rows_together():
    batch = {"x": torch.arange(6), "y": [f"r{i}" for i in range(6)]}
    chunks = split_rows(shuffle_rows(batch, torch.Generator().manual_seed(0)), 3)
    assert len(chunks) == 3 and all(len(c["y"]) == 2 for c in chunks)
    for chunk in chunks:
        assert [f"r{int(v)}" for v in chunk["x"]] == chunk["y"]


def test_buffering_matches_trl_worked_example(tmp_path):
    """17 prompts, pdbs=6, G=4, spg=4, GA=3, mu=2, 3 epochs: 6 generation rounds of 24 rows, 18 optimizer steps."""
    tokenizer = tiny_tokenizer()
    calls = []

    def reward(prompts, trainer_state, **kwargs):
        if trainer_state is not None:
            calls.append(list(prompts))
        return [0.0] * len(prompts)

    data = Dataset.from_list([{"prompt": f"{i} {i}"} for i in range(17)])
    args = RLOOConfig(
        output_dir=str(tmp_path),
        bf16=False,
        use_cpu=True,
        per_device_train_batch_size=6,
        num_generations=4,
        steps_per_generation=4,
        gradient_accumulation_steps=3,
        num_iterations=2,
        shuffle_dataset=False,
        num_train_epochs=3,
        max_completion_length=2,
        report_to="none",
        save_strategy="no",
        beta=0.0,
        disable_tqdm=True,
        logging_steps=1,
    )
    trainer = RLOOTrainer(
        model=tiny_causal_lm(tokenizer),
        reward_funcs=reward,
        args=args,
        train_dataset=data,
        processing_class=tokenizer,
    )
    trainer.train()
    assert trainer.state.global_step == 18
    assert len(calls) == 6 and all(len(c) == 24 for c in calls)
    assert set(calls[0]) == {f"{i} {i}" for i in range(6)}
    assert set(calls[1]) == {f"{i} {i}" for i in range(6, 12)}
    # off-policy micro-steps (spg > GA, mu = 2): the clipped ratio is live, old log-probs were recorded
    assert trainer._pi_old["train"].kept


def test_off_policy_steps_use_recorded_old_logps(tmp_path):
    """The first step is on-policy (ratio exactly 1, nothing clipped); every later step replays rows sampled before
    an update, so some get clipped. The reward differs inside every group (the row index), so every step moves the
    policy. Measured over 10 seeds (model and training seed): step 1 clips 0.0, steps 2-4 clip 0.25-0.75 each. (A
    length reward, as before, gave all-zero advantages and no clipping at all for 4 of 10 seeds.)"""
    tokenizer = tiny_tokenizer()

    def reward(completion_ids, **kwargs):
        return [float(i) for i in range(len(completion_ids))]

    data = Dataset.from_list([{"prompt": w} for w in ["the dog", "a cat", "one two", "red mat"]])
    args = RLOOConfig(
        output_dir=str(tmp_path),
        bf16=False,
        use_cpu=True,
        per_device_train_batch_size=4,
        num_generations=2,
        steps_per_generation=2,
        num_iterations=2,
        max_steps=4,
        learning_rate=0.5,
        max_completion_length=6,
        report_to="none",
        save_strategy="no",
        beta=0.0,
        disable_tqdm=True,
        logging_steps=1,
        epsilon=0.01,
    )
    trainer = RLOOTrainer(
        model=tiny_causal_lm(tokenizer),
        reward_funcs=reward,
        args=args,
        train_dataset=data,
        processing_class=tokenizer,
    )
    trainer.train()
    regions = [
        log["clip_ratio/region_mean"]
        for log in trainer.state.log_history
        if "clip_ratio/region_mean" in log
    ]
    assert regions[0] == 0.0 and min(regions[1:]) > 0, regions


def test_generation_config_carries_sampling_parameters(tmp_path):
    args = RLOOConfig(
        output_dir=str(tmp_path),
        bf16=False,
        temperature=0.7,
        top_p=0.9,
        top_k=5,
        min_p=0.05,
        repetition_penalty=1.3,
        max_completion_length=17,
        cache_implementation="static",
        generation_kwargs={"top_p": 0.8, "suppress_tokens": [7]},
    )
    config = build_generation_config(args, pad_token_id=0, bos_token_id=None, eos_ids=[2, 3])
    assert (config.temperature, config.top_k, config.min_p, config.repetition_penalty) == (
        0.7,
        5,
        0.05,
        1.3,
    )
    assert config.top_p == 0.8  # generation_kwargs override
    assert config.suppress_tokens == [7] and config.max_new_tokens == 17 and config.do_sample
    assert config.eos_token_id == [2, 3] and config.cache_implementation == "static"
    no_top_k = build_generation_config(
        RLOOConfig(output_dir=str(tmp_path), bf16=False), 0, None, [2]
    )
    assert not no_top_k.top_k  # top_k=0 disables the filter


def test_pad_defaults_to_eos_and_padding_is_left():
    tokenizer = tiny_tokenizer()
    tokenizer.pad_token = None
    tokenizer.padding_side = "right"
    prepare_tokenizer(tokenizer)
    assert tokenizer.pad_token == tokenizer.eos_token and tokenizer.padding_side == "left"


def test_chat_template_kwargs_reach_the_template():
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = (
        "{% if greeting %}hello {% endif %}{% for m in messages %}{{ m['content'] }} {% endfor %}"
    )
    from rloo.data import tokenize_prompts

    ids = tokenize_prompts(
        tokenizer, [[{"role": "user", "content": "the dog"}]], {"greeting": True}
    )
    assert tokenizer.decode(ids[0]).startswith(
        "<unk>"
    )  # 'hello' is not in the tiny vocabulary -> unk first
    plain = tokenize_prompts(tokenizer, [[{"role": "user", "content": "the dog"}]], None)
    assert len(ids[0]) == len(plain[0]) + 1


@pytest.mark.parametrize("backend", ["generate", "decode loop"])
def test_top_k_zero_means_no_top_k_whatever_the_model_config_says(tmp_path, backend):
    """top_k=0 (the default) is "no top-k" on every in-process backend, also for a model whose
    generation config sets top_k (Qwen2-0.5B-Instruct's says 20; here 1, i.e. greedy): 16 samples of
    one prompt differ. Before, model.generate read top_k=None as "the model's"."""
    from rloo.generation import in_process_generator
    from rloo.generation.transformers_backend import TransformersGenerator

    tokenizer = tiny_tokenizer()
    model = tiny_causal_lm(tokenizer)
    model.generation_config.top_k = 1
    args = RLOOConfig(output_dir=str(tmp_path), bf16=False, max_completion_length=6)
    config = build_generation_config(args, tokenizer.pad_token_id, None, [tokenizer.eos_token_id])
    generator = in_process_generator(
        config,
        tokenizer.pad_token_id,
        [tokenizer.eos_token_id],
        model,
        fast=backend == "decode loop",
    )
    assert isinstance(generator, TransformersGenerator)
    assert (type(generator) is TransformersGenerator) == (backend == "generate")
    torch.manual_seed(0)
    completions = generator.generate(model, [[5, 6, 7]] * 16, 16)
    assert len({tuple(ids) for ids in completions}) > 8


def test_max_completion_length_none_runs_to_the_models_context(tmp_path):
    """max_completion_length=None (its type allows it, as in TRL): no cap of ours; a completion
    without EOS stops where the model's context ends (vLLM's max_tokens=None does the same)."""
    tokenizer = tiny_tokenizer()
    model = tiny_causal_lm(tokenizer, max_position_embeddings=40)
    args = RLOOConfig(
        output_dir=str(tmp_path),
        bf16=False,
        use_cpu=True,
        max_completion_length=None,
        per_device_train_batch_size=4,
        num_generations=2,
        max_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        beta=0.0,
    )
    seen = []

    def reward(prompts, completion_ids, **kwargs):
        seen.extend(completion_ids)
        return [float(i) for i in range(len(completion_ids))]

    dataset = Dataset.from_list([{"prompt": "the cat sat on the mat"}] * 2)
    RLOOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
    ).train()
    prompt = len(tokenizer("the cat sat on the mat")["input_ids"])
    assert max(len(ids) for ids in seen) <= 40 - prompt
    assert any(len(ids) == 40 - prompt for ids in seen if tokenizer.eos_token_id not in ids)
    with pytest.raises(
        ValueError, match="max_completion_length=None with use_transformers_continuous"
    ):
        RLOOConfig(
            output_dir=str(tmp_path),
            bf16=False,
            max_completion_length=None,
            use_transformers_continuous_batching=True,
        )
