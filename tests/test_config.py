"""RLOOConfig: the TRL docs' defaults and the validation rules."""

import dataclasses

import pytest
from accelerate.parallelism_config import ParallelismConfig

from rloo import RLOOConfig
from rloo.config_checks import LEGACY_PARAMETERS


def config(tmp_path, **kwargs):
    kwargs.setdefault("bf16", False)
    return RLOOConfig(output_dir=str(tmp_path), report_to="none", **kwargs)


def test_spec_defaults(tmp_path):
    c = config(tmp_path)
    expected = dict(
        learning_rate=1e-6,
        logging_steps=10,
        gradient_checkpointing=True,
        num_generations=2,
        num_generations_eval=None,
        max_completion_length=512,
        beta=0.05,
        num_iterations=1,
        epsilon=0.2,
        epsilon_high=0.2,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        min_p=None,
        repetition_penalty=1.0,
        remove_unused_columns=False,
        shuffle_dataset=True,
        pad_to_multiple_of=None,
        vllm_mode="colocate",
        vllm_server_host="0.0.0.0",
        vllm_server_port=8000,
        vllm_server_timeout=240.0,
        vllm_group_port=51216,
        vllm_gpu_memory_utilization=0.3,
        vllm_tensor_parallel_size=1,
        vllm_model_impl="vllm",
        reward_weights=None,
        normalize_advantages=False,
        reward_clip_range=None,
        mask_truncated_completions=False,
        sync_ref_model=False,
        ref_model_mixup_alpha=0.6,
        ref_model_sync_steps=512,
        log_completions=False,
        log_multimodal=True,
        num_completions_to_print=None,
        log_unique_prompts=False,
        use_transformers_continuous_batching=False,
        ds3_gather_for_generation=True,
        disable_dropout=False,
        trust_remote_code=False,
        router_aux_loss_coef=None,
        per_device_train_batch_size=8,
        generation_batch_size=8,
        steps_per_generation=1,
        seed=42,
    )
    for name, value in expected.items():
        assert getattr(c, name) == value, name


def test_every_spec_parameter_is_a_field():
    names = {f.name for f in dataclasses.fields(RLOOConfig)}
    spec = """model_init_kwargs trust_remote_code router_aux_loss_coef disable_dropout num_generations
    num_generations_eval max_completion_length ds3_gather_for_generation shuffle_dataset pad_to_multiple_of
    generation_batch_size steps_per_generation temperature top_p top_k min_p generation_kwargs chat_template_kwargs
    repetition_penalty cache_implementation use_vllm vllm_mode vllm_model_impl vllm_enable_sleep_mode
    vllm_structured_outputs_regex vllm_server_base_url vllm_server_host vllm_server_port vllm_server_timeout
    vllm_group_port vllm_gpu_memory_utilization vllm_max_model_length vllm_tensor_parallel_size beta num_iterations
    epsilon epsilon_high reward_weights normalize_advantages reward_clip_range mask_truncated_completions
    sync_ref_model ref_model_mixup_alpha ref_model_sync_steps log_completions log_multimodal
    num_completions_to_print log_unique_prompts use_transformers_continuous_batching
    transformers_continuous_batching_config use_transformers_paged""".split()
    assert not set(spec) - names


def test_bf16_default_without_gpu_names_the_fix(tmp_path):
    with pytest.raises(ValueError, match="bf16=False"):
        RLOOConfig(output_dir=str(tmp_path))
    assert RLOOConfig(output_dir=str(tmp_path), use_cpu=True).bf16 is True
    assert RLOOConfig(output_dir=str(tmp_path), fp16=False, bf16=False).bf16 is False


def test_batch_math(tmp_path):
    c = config(
        tmp_path, per_device_train_batch_size=3, num_generations=3, gradient_accumulation_steps=2
    )
    assert (c.steps_per_generation, c.generation_batch_size) == (2, 6)
    c = config(tmp_path, per_device_train_batch_size=2, num_generations=4, generation_batch_size=8)
    assert c.steps_per_generation == 4
    c = config(tmp_path, per_device_train_batch_size=2, num_generations=2, steps_per_generation=3)
    assert c.generation_batch_size == 6


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(generation_batch_size=8, steps_per_generation=2), "can not be both configured"),
        (dict(per_device_train_batch_size=3, num_generations=2), "divisible by num_generations"),
        (
            dict(per_device_train_batch_size=4, generation_batch_size=6),
            "divisible by the global batch size",
        ),
        (dict(num_generations=1), "at least 2 generations"),
        (dict(vllm_mode="remote"), "vllm_mode='remote'"),
        (dict(max_completion_length=0), "max_completion_length=0"),
        (dict(max_completion_length=-5), "max_completion_length=-5"),
        (dict(auto_find_batch_size=True), "auto_find_batch_size"),
        (dict(reward_clip_range=(1.0, -1.0)), "reward_clip_range"),
        (dict(generation_kwargs="{not json"), "generation_kwargs"),
        # the TRL docs: incompatible with vLLM (which loads full weights anyway)
        (
            dict(use_vllm=True, ds3_gather_for_generation=False),
            "ds3_gather_for_generation=False with use_vllm",
        ),
        # no generation gather / reference handling under FSDP: refused, ZeRO-3 named
        (dict(fsdp="full_shard"), "FSDP .* is not supported.*ZeRO-3"),
        # accepted by TrainingArguments, refused as TRL refuses it (not ignored)
        (dict(parallelism_config=ParallelismConfig(cp_size=2)), "context or sequence parallelism"),
        # would change the training forward's log-probs away from the sampler's
        (dict(neftune_noise_alpha=5.0), "neftune_noise_alpha=5.0"),
    ],
)
def test_invalid_values(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        config(tmp_path, **kwargs)


@pytest.mark.parametrize("legacy", sorted(LEGACY_PARAMETERS))
def test_legacy_names_rejected_with_the_new_name(tmp_path, legacy):
    with pytest.raises(TypeError, match=legacy) as info:
        config(tmp_path, **{legacy: 1})
    assert LEGACY_PARAMETERS[legacy].split()[0] in str(info.value)


def test_json_strings_and_deprecated_alias(tmp_path):
    c = config(
        tmp_path,
        generation_kwargs='{"suppress_tokens": [5]}',
        model_init_kwargs='{"dtype": "float32"}',
    )
    assert c.generation_kwargs == {"suppress_tokens": [5]} and c.model_init_kwargs == {
        "dtype": "float32"
    }
    with pytest.warns(FutureWarning, match="use_transformers_continuous_batching"):
        c = config(tmp_path, use_transformers_paged=True)
    assert c.use_transformers_continuous_batching
    assert config(tmp_path, pad_to_multiple_of="16").pad_to_multiple_of == 16


# RLOOConfig fields that no module outside rloo/config.py reads, each with the reason it is allowed.
UNREAD_ALLOWED = {
    "use_transformers_paged": "deprecated alias, folded into use_transformers_continuous_batching in __post_init__",
}


def test_every_config_field_is_read_somewhere():
    """A field nobody reads is a setting that silently does nothing: each RLOOConfig field of its own (those not
    inherited from TrainingArguments, which transformers reads) must be read by some module of rloo/ besides
    config.py, or be listed above with its reason."""
    import dataclasses
    import pathlib
    import re

    from transformers import TrainingArguments

    inherited = {f.name for f in dataclasses.fields(TrainingArguments)}
    own = [f.name for f in dataclasses.fields(RLOOConfig) if f.name not in inherited]
    root = pathlib.Path(__file__).resolve().parent.parent
    sources = [p.read_text() for p in (root / "rloo").rglob("*.py") if p.name != "config.py"]
    unread = {
        name
        for name in own
        if not any(re.search(rf"\.{name}\b|[\"']{name}[\"']", text) for text in sources)
    }
    assert unread == set(UNREAD_ALLOWED), (
        f"read nowhere: {sorted(unread - set(UNREAD_ALLOWED))}; allowed but "
        f"now read: {sorted(set(UNREAD_ALLOWED) - unread)}"
    )


def test_fsdp_from_accelerate_launch_is_refused_too(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ValueError, match="FSDP .* is not supported"):
        config(tmp_path)
