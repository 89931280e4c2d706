"""Reward forms end to end: weights, clipping, normalisation, truncation masking, mixed function/model lists,
TR-DPO reference sync. Advantages are read back from the completion log and recomputed by hand."""

import copy
import math

import pytest
import torch

from helpers import conversational, length_reward, logged, make_args
from rloo import RLOOTrainer
from tiny_models import tiny_reward_model


def const_one(completions, **kwargs):
    return [1.0] * len(completions)


def loo(rewards, group):
    advantages = []
    for i, r in enumerate(rewards):
        start = (i // group) * group
        siblings = [rewards[j] for j in range(start, start + group) if j != i]
        advantages.append(r - sum(siblings) / len(siblings))
    return advantages


def run(tmp_path, tokenizer, model, reward_funcs, reward_processing_classes=None, **kwargs):
    args = make_args(
        tmp_path, log_completions=True, shuffle_dataset=False, **{"max_steps": 1, **kwargs}
    )
    trainer = RLOOTrainer(
        model=model,
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=conversational(),
        processing_class=tokenizer,
        reward_processing_classes=reward_processing_classes,
    )
    trainer.train()
    return trainer


def test_reward_weights(tmp_path, tokenizer, model):
    trainer = run(
        tmp_path,
        tokenizer,
        model,
        [const_one, length_reward],
        reward_weights=[2.0, 0.5],
        num_generations=4,
    )
    lengths = list(trainer._logs.rewards["length_reward"])
    combined = [2.0 + 0.5 * n for n in lengths]
    assert list(trainer._logs.rewards["const_one"]) == [1.0] * 4
    assert logged(trainer, "reward")[0] == pytest.approx(sum(combined) / 4)
    assert list(trainer._logs.advantages) == pytest.approx(loo(combined, 4))


def test_reward_clip_range_clips_before_the_baseline(tmp_path, tokenizer, model):
    trainer = run(
        tmp_path,
        tokenizer,
        model,
        length_reward,
        reward_clip_range=(0.0, 3.0),
        num_generations=4,
        per_device_train_batch_size=8,
        max_completion_length=8,
    )
    lengths = list(trainer._logs.rewards["length_reward"])
    assert max(lengths) > 3  # the clip is exercised
    assert list(trainer._logs.advantages) == pytest.approx(loo([min(n, 3.0) for n in lengths], 4))
    assert logged(trainer, "reward")[0] == pytest.approx(
        sum(lengths) / 8
    )  # logged unclipped, like TRL


def test_normalize_advantages_over_the_whole_batch(tmp_path, tokenizer, model):
    trainer = run(
        tmp_path,
        tokenizer,
        model,
        length_reward,
        normalize_advantages=True,
        per_device_train_batch_size=8,
        max_completion_length=8,
    )
    raw = loo(list(trainer._logs.rewards["length_reward"]), 2)
    mean = sum(raw) / len(raw)
    std = math.sqrt(sum((a - mean) ** 2 for a in raw) / (len(raw) - 1))
    assert list(trainer._logs.advantages) == pytest.approx(
        [(a - mean) / (std + 1e-4) for a in raw], abs=1e-5
    )


def test_all_truncated_batch_makes_no_update(tmp_path, tokenizer, model):
    eos = tokenizer.eos_token_id
    settings = dict(
        mask_truncated_completions=True,
        generation_kwargs={"suppress_tokens": [eos]},
        max_completion_length=3,
        max_steps=2,
    )
    before = copy.deepcopy(model.state_dict())
    trainer = run(tmp_path, tokenizer, model, length_reward, **settings)
    assert logged(trainer, "completions/clipped_ratio") == [1.0, 1.0]
    assert all(g == 0.0 for g in logged(trainer, "grad_norm"))
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    # The same run without masking does move the weights (so the check above is not vacuous).
    unmasked = copy.deepcopy(model)
    run(
        tmp_path / "b",
        tokenizer,
        unmasked,
        lambda completion_ids, **k: [float(i) for i in range(len(completion_ids))],
        **{**settings, "mask_truncated_completions": False},
    )
    assert any(not torch.equal(v, before[n]) for n, v in unmasked.state_dict().items())


def test_mixed_functions_and_reward_models(tmp_path, tokenizer, model):
    reward_model = tiny_reward_model(tokenizer)
    trainer = run(
        tmp_path,
        tokenizer,
        model,
        [length_reward, reward_model],
        reward_weights=[1.0, 3.0],
        num_generations=4,
        reward_processing_classes=[None, tokenizer],
    )
    lengths = list(trainer._logs.rewards["length_reward"])
    scores = list(trainer._logs.rewards[trainer.reward_func_names[1]])
    texts = [
        [{"role": "user", "content": p.split(": ", 1)[1]}, {"role": "assistant", "content": c}]
        for p, c in zip(trainer._logs.prompt, trainer._logs.completion)
    ]
    with torch.no_grad():  # the reward model's scores, recomputed directly from the logged text
        for conversation, score in zip(texts, scores):
            text = tokenizer.apply_chat_template(conversation, tokenize=False)
            ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")
            assert reward_model(**ids).logits[0, 0].item() == pytest.approx(score, abs=1e-5)
    combined = [n + 3.0 * s for n, s in zip(lengths, scores)]
    assert list(trainer._logs.advantages) == pytest.approx(loo(combined, 4), abs=1e-5)


def test_sync_ref_model_mixes_policy_into_reference(tmp_path, tokenizer, model):
    initial = copy.deepcopy(model)
    args = make_args(
        tmp_path,
        beta=0.1,
        sync_ref_model=True,
        ref_model_sync_steps=2,
        ref_model_mixup_alpha=0.25,
        max_steps=2,
    )
    trainer = RLOOTrainer(
        model=model,
        reward_funcs=length_reward,
        args=args,
        train_dataset=conversational(),
        processing_class=tokenizer,
    )
    trainer.train()
    reference = dict(trainer.ref_model.named_parameters())
    changed = 0
    for (name, theta), theta0 in zip(model.named_parameters(), initial.parameters()):
        expected = 0.25 * theta.detach() + 0.75 * theta0.detach()
        assert torch.allclose(reference[name], expected, atol=1e-7), name
        changed += not torch.equal(reference[name], theta0)
    assert changed == len(reference)


def test_sync_ref_model_needs_kl_and_no_peft(tmp_path, tokenizer, model):
    from peft import LoraConfig

    with pytest.raises(ValueError, match="sync_ref_model=True but beta=0.0"):
        RLOOTrainer(
            model=model,
            reward_funcs=length_reward,
            args=make_args(tmp_path, sync_ref_model=True),
            train_dataset=conversational(),
            processing_class=tokenizer,
        )
    with pytest.raises(NotImplementedError, match="not supported with PEFT"):
        RLOOTrainer(
            model=model,
            reward_funcs=length_reward,
            args=make_args(tmp_path, sync_ref_model=True, beta=0.1),
            train_dataset=conversational(),
            processing_class=tokenizer,
            peft_config=LoraConfig(r=4, target_modules=["q_proj"]),
        )
