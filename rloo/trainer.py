"""RLOOTrainer: one step = sample prompts -> generate -> score -> leave-one-out advantages -> clipped loss.

The mathematics lives in `rloo.algorithm`; this module wires it into `transformers.Trainer`
(optimiser, DDP/DeepSpeed, checkpoints, callbacks) with TRL's public API.
"""

from __future__ import annotations

import copy
import logging
import os
import time
import warnings
from typing import Any

import torch
from accelerate.utils import gather_object, set_seed
from datasets import Dataset, IterableDataset
from torch import nn
from transformers import PreTrainedModel, Trainer
from transformers.trainer_utils import get_last_checkpoint

from rloo import algorithm
from rloo.callbacks import SyncRefModelCallback
from rloo.completion_log import CompletionLog, log_table_to_mlflow, print_table
from rloo.config import RLOOConfig
from rloo.data import as_completion, check_prompt_dataset, is_conversational, pad_rows, tokenize_prompts
from rloo.hub import get_publisher, is_secret, render_model_card
from rloo.generation import ContinuousBatchingGenerator, TransformersGenerator
from rloo.generation.transformers_backend import build_generation_config
from rloo.generation.vllm_colocate import VLLMColocateGenerator, check_colocate_possible
from rloo.generation.vllm_server import VLLMServerGenerator
from rloo.metrics import MetricBuffer, nanmean, nanstd_value, tensor_stats
from rloo.models import (add_reference_adapter, create_reference_model, disable_dropout, eos_token_ids, is_peft_model,
                         load_causal_lm, load_reward_model, load_tokenizer, model_identity, per_token_logps,
                         prepare_tokenizer, reference_adapter, resolve_router_aux_loss_coef, reward_tokenizers,
                         text_tokenizer_of, check_quantization_supported, wrap_with_peft)
from rloo.rewards.runner import RewardFunctionError, RewardRunner, is_async_reward
from rloo.sampling import RepeatSampler, repeat_iterable, shuffle_rows, split_rows
from rloo.zero import gathered_parameters, is_partitioned, prepare_frozen, zero_stage

logger = logging.getLogger(__name__)

STATE_DIR = "rloo_state"
REFERENCE_FILE = "ref_model.pt"


def _to_device(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {key: _to_device(item, device) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(item, device) for item in value)
    return value


def _atomic_save(obj, path: str) -> None:
    torch.save(obj, path + ".tmp")
    os.replace(path + ".tmp", path)


def _identity(batch):
    return batch


class RLOOTrainer(Trainer):
    """Trainer for REINFORCE Leave-One-Out (Ahmadian et al., 2024), API-compatible with TRL's RLOOTrainer."""

    _tag_names = ["rloo"]
    loss_is_scaled_for_ga = False  # our loss is a per-micro-batch mean: the Trainer divides by GA

    def __init__(self, model: str | PreTrainedModel, reward_funcs: Any | list, args: RLOOConfig | None = None,
                 train_dataset: Dataset | IterableDataset | None = None, eval_dataset: Any = None,
                 processing_class: Any = None, reward_processing_classes: Any = None, callbacks: list | None = None,
                 optimizers: tuple = (None, None), quantization_config: Any = None, peft_config: Any = None):
        model_id = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", "model")
        if args is None:
            args = RLOOConfig(output_dir=f"{str(model_id).rstrip('/').split('/')[-1]}-RLOO")
        elif not isinstance(args, RLOOConfig):
            raise TypeError(f"args must be an RLOOConfig, got {type(args).__name__}")
        self._check_inputs_before_loading(args, reward_funcs, train_dataset, eval_dataset, reward_processing_classes,
                                          model, quantization_config, peft_config)

        # Policy.
        self._model_source = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "")
        init_kwargs = dict(args.model_init_kwargs or {})
        if isinstance(model, str):
            if quantization_config is not None:
                if "quantization_config" in init_kwargs:
                    raise ValueError("quantization_config is given both as an argument and in model_init_kwargs; "
                                     "pass it once.")
                init_kwargs["quantization_config"] = quantization_config
            model = load_causal_lm(model, init_kwargs, args.trust_remote_code)
        elif args.model_init_kwargs or quantization_config is not None:
            warnings.warn("model is already instantiated: model_init_kwargs and quantization_config are ignored.")
        self._model_identity = model_identity(model)

        # Tokenizer / processor.
        if processing_class is None:
            processing_class = load_tokenizer(model.config._name_or_path, args.trust_remote_code)
        processing_class = prepare_tokenizer(processing_class)
        tokenizer = text_tokenizer_of(processing_class)
        self.pad_token_id = tokenizer.pad_token_id
        self.eos_token_ids = eos_token_ids(tokenizer, model)
        if getattr(model.generation_config, "pad_token_id", None) is None:
            model.generation_config.pad_token_id = self.pad_token_id

        # PEFT: the reference policy is the network with the adapter disabled (new adapter) or a frozen copy of the
        # adapter it arrived with (a PeftModel passed in, e.g. after SFT).
        self._trainable_adapter = None
        set_seed(args.seed)  # new adapter weights are drawn here: the same seed must give the same adapter
        if peft_config is not None:
            quantized = bool(getattr(model, "is_quantized", False) or getattr(model, "is_loaded_in_4bit", False))
            model = wrap_with_peft(model, peft_config, args.gradient_checkpointing, quantized)
        elif is_peft_model(model) and args.beta != 0.0:
            self._trainable_adapter = add_reference_adapter(model)
        self._is_peft = is_peft_model(model)
        if self._is_peft and args.gradient_checkpointing:
            model.enable_input_require_grads()
        self.router_aux_loss_coef = resolve_router_aux_loss_coef(model, args.router_aux_loss_coef)

        # Reward functions and reward models.
        reward_funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        reward_funcs = [load_reward_model(f, args.model_init_kwargs, args.trust_remote_code) if isinstance(f, str)
                        else f for f in reward_funcs]
        reward_processing_classes = reward_tokenizers(reward_funcs, reward_processing_classes, args.trust_remote_code)
        self.reward_funcs = reward_funcs
        self.reward_runner = RewardRunner(reward_funcs, reward_processing_classes, args.chat_template_kwargs)
        self.reward_func_names = self.reward_runner.names
        weights = args.reward_weights if args.reward_weights is not None else [1.0] * len(reward_funcs)
        self.reward_weights = torch.tensor(weights, dtype=torch.float32)
        if isinstance(train_dataset, Dataset):
            self._preflight_reward_functions(train_dataset, args)

        if args.disable_dropout:
            disable_dropout(model)

        self._prepare_for_iterable_datasets(args, train_dataset, eval_dataset)
        set_seed(args.seed)
        super().__init__(model=model, args=args, data_collator=_identity, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class, callbacks=callbacks,
                         optimizers=optimizers)

        # Reference model: only needed when the KL penalty is on. Under ZeRO-3 it is sharded like the policy.
        self._zero3 = zero_stage(self.accelerator) == 3
        self._frozen_engines = []
        if self._zero3:
            gathered = "full weights gathered" if args.ds3_gather_for_generation else "layer by layer, ranks synced"
            self.accelerator.print(f"rloo: DeepSpeed ZeRO-3 sharding on {self.accelerator.num_processes} ranks "
                                   f"(policy, reference and reward models); generation: {gathered}.")
        self.ref_model = None
        if args.beta != 0.0 and not self._is_peft:
            if self._zero3:
                reference = self._zero3_reference(init_kwargs)
                if args.disable_dropout:
                    disable_dropout(reference)
                self.ref_model = prepare_frozen(reference, self.accelerator, args.per_device_train_batch_size)
            else:
                self.ref_model = self.accelerator.prepare_model(create_reference_model(self.model),
                                                                evaluation_mode=True)
        if args.sync_ref_model:
            self.add_callback(SyncRefModelCallback(self))
        for index, func in enumerate(self.reward_funcs):
            if isinstance(func, PreTrainedModel):
                func.eval()
                if self._zero3:  # sharded; the engine's hooks live on the module, which the runner calls
                    self._frozen_engines.append(prepare_frozen(func, self.accelerator,
                                                               args.per_device_train_batch_size))
                else:
                    self.reward_funcs[index] = self.accelerator.prepare_model(func, evaluation_mode=True)

        generation_config = build_generation_config(args, self.pad_token_id, tokenizer.bos_token_id, self.eos_token_ids)
        self._vllm_server = args.use_vllm and args.vllm_mode == "server"
        if self._vllm_server:
            self.generator = VLLMServerGenerator(args, self.accelerator, self.model, self.eos_token_ids,
                                                 zero3=self._zero3)
        elif args.use_vllm:
            self.generator = VLLMColocateGenerator(args, self.accelerator, self.model, self.eos_token_ids,
                                                   tokenizer, zero3=self._zero3)
        elif args.use_transformers_continuous_batching:
            self.generator = ContinuousBatchingGenerator(generation_config, self.eos_token_ids,
                                                         args.transformers_continuous_batching_config)
        else:
            self.generator = TransformersGenerator(generation_config, self.pad_token_id, self.eos_token_ids,
                                                   args.pad_to_multiple_of)
        self._metrics = MetricBuffer()
        self._logs = CompletionLog(args.generation_batch_size)
        self._logs_fresh = False
        self._eval_prefix = "eval"
        self._last_eval_metrics: dict[str, float | None] = {}
        self._step = 0
        self._buffered_inputs: list[dict] | None = None
        self._step_time = 0.0
        # Old log-probs differ from the live ones only when a generation batch outlives an optimiser step.
        self._needs_old_logps = args.num_iterations > 1 or args.steps_per_generation > args.gradient_accumulation_steps
        set_seed(args.seed, device_specific=True)  # duplicated prompts on different ranks sample differently

    def _zero3_reference(self, init_kwargs: dict) -> PreTrainedModel:
        """The initial policy as a separate model for ZeRO-3. A policy already sharded at load time (zero.Init)
        cannot be copied, so the reference is loaded again from the same source on every rank."""
        if not is_partitioned(self.model):
            return create_reference_model(self.model)
        if not self._model_source:
            raise ValueError("ZeRO-3 with beta > 0 needs a reference copy of the policy, but the model object given "
                             "was sharded at creation and has no config._name_or_path to load it from again. Fix: "
                             "pass the model by name/path, or create it outside the DeepSpeed context.")
        reference = load_causal_lm(self._model_source, init_kwargs, self.args.trust_remote_code)
        reference.requires_grad_(False)
        return reference

    # ------------------------------------------------------------------ validation before any compute
    @staticmethod
    def _check_inputs_before_loading(args, reward_funcs, train_dataset, eval_dataset, reward_processing_classes,
                                     model, quantization_config, peft_config):
        if train_dataset is None:
            raise ValueError("train_dataset is required: pass a Dataset or IterableDataset with a 'prompt' column.")
        if not isinstance(train_dataset, (Dataset, IterableDataset)):
            raise TypeError(f"train_dataset must be a datasets.Dataset or IterableDataset, got "
                            f"{type(train_dataset).__name__}. Fix: datasets.Dataset.from_list(rows).")
        check_prompt_dataset(train_dataset, "train_dataset")
        if peft_config is not None and is_peft_model(model):
            raise ValueError("model is already a PeftModel and peft_config is also given: pass one of them (the "
                             "PeftModel keeps its adapter; peft_config adds a new one to a plain model).")
        quantized = quantization_config is not None or "quantization_config" in (args.model_init_kwargs or {})
        if quantized and peft_config is None:
            raise ValueError("quantization_config is set without peft_config: a 4/8-bit base model cannot be "
                             "trained directly. Fix: also pass peft_config=LoraConfig(...) (QLoRA).")
        if quantized:
            check_quantization_supported(quantization_config or args.model_init_kwargs["quantization_config"])
        if args.sync_ref_model:
            if args.beta == 0.0:
                raise ValueError("sync_ref_model=True but beta=0.0: without the KL penalty there is no reference "
                                 "model to synchronise. Fix: set beta > 0 or sync_ref_model=False.")
            if peft_config is not None or is_peft_model(model):
                raise NotImplementedError("sync_ref_model=True is not supported with PEFT: the reference is the "
                                          "base model (adapter disabled), which is frozen. Fix: sync_ref_model=False.")
        if args.eval_strategy != "no" and eval_dataset is None:
            strategy = getattr(args.eval_strategy, "value", args.eval_strategy)
            raise ValueError(f"eval_strategy={strategy!r} but no eval_dataset was given. Fix: pass "
                             "eval_dataset=... or set eval_strategy='no'.")
        if isinstance(train_dataset, IterableDataset) and args.max_steps <= 0:
            raise ValueError("train_dataset is an IterableDataset, whose length is unknown: set max_steps "
                             "(e.g. RLOOConfig(max_steps=1000)).")
        if args.use_vllm and args.vllm_mode == "colocate":
            check_colocate_possible(args)
        if eval_dataset is not None:
            datasets_ = eval_dataset.items() if isinstance(eval_dataset, dict) else [("eval_dataset", eval_dataset)]
            for name, dataset in datasets_:
                check_prompt_dataset(dataset, name if name == "eval_dataset" else f"eval_dataset[{name!r}]")
        funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        if not funcs:
            raise ValueError("reward_funcs is empty: pass at least one reward function or reward model.")
        for index, func in enumerate(funcs):
            if not (isinstance(func, (str, nn.Module)) or callable(func)):
                raise TypeError(f"reward_funcs[{index}] is a {type(func).__name__}: expected a callable, a "
                                "sequence-classification model, or a model id/path.")
        if args.reward_weights is not None and len(args.reward_weights) != len(funcs):
            raise ValueError(f"reward_weights has {len(args.reward_weights)} entries but there are {len(funcs)} "
                             f"reward functions; give one weight per function.")
        if isinstance(reward_processing_classes, (list, tuple)) and len(reward_processing_classes) != len(funcs):
            raise ValueError(f"reward_processing_classes has {len(reward_processing_classes)} entries but there are "
                             f"{len(funcs)} reward functions; the lengths must match.")
        if reward_processing_classes is not None and not isinstance(reward_processing_classes, (list, tuple)) \
                and len(funcs) != 1:
            raise ValueError("a single reward_processing_class was given for several reward functions; "
                             "pass a list with one entry per reward function.")

    @staticmethod
    def _prepare_for_iterable_datasets(args, train_dataset, eval_dataset) -> None:
        """Streaming datasets: every process reads its own slice of each global batch (no dispatch from rank 0,
        which cannot carry string/message columns), as TRL does."""
        evals = list(eval_dataset.values()) if isinstance(eval_dataset, dict) else [eval_dataset]
        if not any(isinstance(d, IterableDataset) for d in [train_dataset, *evals]):
            return
        if args.accelerator_config.dispatch_batches:
            raise ValueError("accelerator_config.dispatch_batches=True cannot be used with an IterableDataset here: "
                             "prompts are strings or message lists, which rank 0 cannot dispatch as tensors. "
                             "Fix: leave dispatch_batches unset (it is set to False).")
        args.accelerator_config.dispatch_batches = False

    def _get_dataloader(self, dataset, description, batch_size, sampler_fn=None, is_training=False,
                        dataloader_key=None):
        if not isinstance(dataset, IterableDataset):
            return super()._get_dataloader(dataset, description, batch_size, sampler_fn, is_training, dataloader_key)
        # A stream of one shard would be read once per worker: load it in the main process.
        names = ("dataloader_num_workers", "dataloader_persistent_workers", "dataloader_prefetch_factor")
        saved = {name: getattr(self.args, name) for name in names}
        for name, value in zip(names, (0, False, None)):
            setattr(self.args, name, value)
        try:
            return super()._get_dataloader(dataset, description, batch_size, sampler_fn, is_training, dataloader_key)
        finally:
            for name, value in saved.items():
                setattr(self.args, name, value)

    def _preflight_reward_functions(self, dataset: Dataset, args: RLOOConfig) -> None:
        """Call every synchronous reward function once on a few real rows with empty completions, so a
        wrong signature, count or type fails here, before any model work, instead of after generation."""
        sync_funcs = [i for i, f in enumerate(self.reward_funcs)
                      if not isinstance(f, nn.Module) and not is_async_reward(f)]
        if not sync_funcs:
            return
        rows = dataset.select(range(min(len(dataset), 2)))
        prompts = list(rows["prompt"])
        kept = [c for c in rows.column_names if c != "prompt" and (not args.remove_unused_columns or c in
                                                                  ("image", "images"))]
        columns = {c: list(rows[c]) for c in kept}
        conversational = is_conversational(prompts[0])
        completions = [as_completion("", conversational) for _ in prompts]
        probe = RewardRunner([self.reward_funcs[i] for i in sync_funcs], [None] * len(sync_funcs))
        eos = self.eos_token_ids[:1] or [self.pad_token_id]
        try:
            probe(prompts, completions, [list(eos) for _ in prompts], columns, trainer_state=None)
        except RewardFunctionError as err:
            cause = err.__cause__
            signature_error = isinstance(cause, TypeError) and "argument" in str(cause)
            if isinstance(cause, ImportError):  # a missing optional dependency: knowable now, fatal later
                raise
            if cause is not None and not signature_error:
                return  # the function may reject a placeholder completion; real ones are checked every step
            raise RewardFunctionError(f"{err} [pre-flight check on dataset rows 0-{len(prompts) - 1} with empty "
                                      "completions, before training]") from err

    # ------------------------------------------------------------------ data
    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = ["prompt", "image", "images"]

    def get_train_dataloader(self):
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        args, dataset = self.args, self.train_dataset
        if isinstance(dataset, IterableDataset):  # no sampler: the same order, built into the stream
            if args.shuffle_dataset:
                dataset = dataset.shuffle(seed=args.seed)
            dataset = repeat_iterable(dataset, args.generation_batch_size // args.num_generations, args.num_generations,
                                      args.num_iterations * args.steps_per_generation)
        # One dataloader batch = this process's share of a whole generation batch.
        return self._get_dataloader(dataset=dataset, description="Training",
                                    batch_size=self._train_batch_size * args.steps_per_generation,
                                    sampler_fn=self._get_train_sampler, is_training=True)

    def get_eval_dataloader(self, eval_dataset=None):
        dataset = self.eval_dataset[eval_dataset] if isinstance(eval_dataset, str) else (
            eval_dataset if eval_dataset is not None else self.eval_dataset)
        generations = self._num_generations("eval")
        eval_batch = self.args.per_device_eval_batch_size * self.accelerator.num_processes
        if eval_batch % generations != 0:
            raise ValueError(f"The global eval batch size ({eval_batch} = per_device_eval_batch_size "
                             f"{self.args.per_device_eval_batch_size} x {self.accelerator.num_processes} processes) "
                             f"must be divisible by num_generations_eval ({generations}) so that every batch holds "
                             "whole prompt groups.")
        if isinstance(dataset, IterableDataset):
            dataset = repeat_iterable(dataset, 1, generations)
        return super().get_eval_dataloader(dataset)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
        """Trainer.evaluate, with the RLOO metrics (reward, completions/*, ...) under the same prefix as the loss:
        `eval_` for one dataset, `eval_<name>_` for each entry of a dict / DatasetDict."""
        previous, self._eval_prefix = self._eval_prefix, metric_key_prefix
        try:
            metrics = super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)
        finally:
            self._eval_prefix = previous
        if not isinstance(eval_dataset if eval_dataset is not None else self.eval_dataset, dict):
            metrics.update(self._last_eval_metrics)
        return metrics

    def _get_train_sampler(self, dataset=None):
        dataset = dataset if dataset is not None else self.train_dataset
        args = self.args
        return RepeatSampler(len(dataset), mini_repeat_count=args.num_generations,
                             batch_size=args.generation_batch_size // args.num_generations,
                             repeat_count=args.num_iterations * args.steps_per_generation,
                             shuffle=args.shuffle_dataset, seed=args.seed)

    def _get_eval_sampler(self, eval_dataset):
        return RepeatSampler(len(eval_dataset), mini_repeat_count=self._num_generations("eval"), seed=self.args.seed)

    def _num_generations(self, mode: str) -> int:
        if mode == "eval":
            return self.args.num_generations_eval or self.args.num_generations
        return self.args.num_generations

    # ------------------------------------------------------------------ the step
    def training_step(self, model, inputs, num_items_in_batch=None):
        start = time.perf_counter()
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._step += 1
        self._step_time += time.perf_counter() - start
        if self._step % self.current_gradient_accumulation_steps == 0:
            self._metrics.add("train", "step_time", self._step_time)
            self._step_time = 0.0
        return loss

    def _prepare_inputs(self, generation_batch):
        if not self.model.training:
            return self._generate_and_score(generation_batch, "eval")
        generate_every = self.args.steps_per_generation * self.args.num_iterations
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            batch = self._generate_and_score(generation_batch, "train")
            self._buffered_inputs = split_rows(shuffle_rows(batch), self.args.steps_per_generation)
        return self._buffered_inputs[self._step % self.args.steps_per_generation]

    def _generate_and_score(self, inputs: list[dict], mode: str) -> dict[str, torch.Tensor]:
        args = self.args
        device = self.accelerator.device
        prompts = [row["prompt"] for row in inputs]
        conversational = is_conversational(prompts[0])
        prompt_id_lists = tokenize_prompts(self.processing_class, prompts, args.chat_template_kwargs)
        unwrapped = self.accelerator.unwrap_model(self.model)
        # In-process backends generate from the live (under ZeRO-3: gathered) weights; vLLM gets its own copy.
        gather = self._zero3 and args.ds3_gather_for_generation and not args.use_vllm
        with gathered_parameters(unwrapped, gather):
            completion_id_lists = self.generator.generate(unwrapped, prompt_id_lists, self._num_generations(mode),
                                                          self.state.global_step)
        for name, value in self.generator.pop_metrics().items():
            self._metrics.add(mode, name, value)

        prompt_ids, prompt_mask = pad_rows(prompt_id_lists, self.pad_token_id, "left", args.pad_to_multiple_of)
        completion_ids, completion_mask = pad_rows(completion_id_lists, self.pad_token_id, "right",
                                                   args.pad_to_multiple_of)
        prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
        completion_ids, completion_mask = completion_ids.to(device), completion_mask.to(device)
        truncated = algorithm.truncated_rows(completion_ids, completion_mask, self.eos_token_ids, self.pad_token_id)
        self._log_lengths(mode, prompt_id_lists, completion_id_lists, truncated)
        if args.mask_truncated_completions:
            completion_mask = completion_mask * (~truncated).unsqueeze(1).int()

        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        logits_to_keep = completion_ids.size(1)
        chunk = args.per_device_train_batch_size if mode == "train" else args.per_device_eval_batch_size
        old_per_token = ref_per_token = None
        with torch.no_grad():
            if self._needs_old_logps or args.beta != 0.0:
                old_per_token = self._chunked_logps(unwrapped, input_ids, attention_mask, logits_to_keep, chunk)
            if args.beta != 0.0:
                ref_per_token = self._reference_logps(unwrapped, input_ids, attention_mask, logits_to_keep, chunk)

        texts = text_tokenizer_of(self.processing_class).batch_decode(completion_id_lists, skip_special_tokens=True)
        completions = [as_completion(text, conversational) for text in texts]
        columns = {key: [row[key] for row in inputs] for key in inputs[0] if key not in ("prompt", "completion",
                                                                                      "completion_ids")}
        local_rewards, extra = self.reward_runner(prompts, completions, completion_id_lists, columns, self.state,
                                                  device=device)
        rewards_per_func = self.accelerator.gather(local_rewards)

        kl = None
        if args.beta != 0.0:
            local_kl = algorithm.sequence_kl(old_per_token, ref_per_token, completion_mask)
            kl = self.accelerator.gather(local_kl)
            kl_tokens = self.accelerator.gather(((old_per_token - ref_per_token) * completion_mask).sum().reshape(1))
            kl_count = self.accelerator.gather(completion_mask.sum().reshape(1).float())
            self._metrics.add(mode, "kl", kl_tokens.sum() / kl_count.sum().clamp(min=1.0))
        num_generations = self._num_generations(mode)
        shaped, advantages = algorithm.rloo_advantages(
            rewards_per_func, self.reward_weights.to(device), num_generations, kl=kl, beta=args.beta,
            reward_clip_range=args.reward_clip_range, normalize=args.normalize_advantages)
        self._log_rewards(mode, rewards_per_func, shaped, num_generations, extra)
        if args.log_completions:
            self._record_completions(prompts, texts, rewards_per_func, advantages, extra.columns)

        local = len(prompts)
        start = self.accelerator.process_index * local
        local_advantages = advantages[start:start + local]
        batch = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
                 "completion_mask": completion_mask, "advantages": local_advantages}
        sampler_logprobs = getattr(completion_id_lists, "logprobs", None)
        if sampler_logprobs is not None:  # vLLM's own log-probs of the tokens it sampled, compared in compute_loss
            batch["sampler_logps"] = torch.zeros(completion_ids.shape, dtype=torch.float32, device=device)
            for row, values in enumerate(sampler_logprobs):
                batch["sampler_logps"][row, :len(values)] = torch.tensor(values, dtype=torch.float32)
        if self._needs_old_logps:  # otherwise compute_loss uses the live log-probs, detached (ratio exactly 1)
            batch["old_logps"] = (old_per_token * completion_mask).sum(dim=1)
        return batch

    def _chunked_logps(self, model, input_ids, attention_mask, logits_to_keep, chunk) -> torch.Tensor:
        parts = []
        for start in range(0, input_ids.size(0), chunk):
            parts.append(per_token_logps(model, input_ids[start:start + chunk], attention_mask[start:start + chunk],
                                         logits_to_keep, self.args.temperature).logps)
        return torch.cat(parts, dim=0)

    def _reference_logps(self, unwrapped, input_ids, attention_mask, logits_to_keep, chunk) -> torch.Tensor:
        if self.ref_model is not None:
            return self._chunked_logps(self.ref_model, input_ids, attention_mask, logits_to_keep, chunk)
        with reference_adapter(unwrapped, self._trainable_adapter):  # PEFT: base (or frozen copy) is the reference
            return self._chunked_logps(unwrapped, input_ids, attention_mask, logits_to_keep, chunk)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError("RLOOTrainer.compute_loss does not return model outputs.")
        mode = "train" if self.model.training else "eval"
        completion_mask = inputs["completion_mask"]
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
        token_logps, entropy, aux_loss = per_token_logps(model, input_ids, attention_mask,
                                                         inputs["completion_ids"].size(1), self.args.temperature,
                                                         with_entropy=True)
        old_logps = inputs.get("old_logps")
        if old_logps is None:  # on-policy: pi_old is the current policy, ratio exactly 1
            old_logps = (token_logps * completion_mask).sum(dim=1).detach()
        loss, clipped = algorithm.clipped_surrogate_loss(token_logps, old_logps, inputs["advantages"], completion_mask,
                                                         self.args.epsilon, self.args.epsilon_high)
        gather = self.accelerator.gather
        if "sampler_logps" in inputs:
            # The sampler (vLLM, its own copy of the weights) vs the trainer on the same tokens: numerical mismatch
            # plus, when a generation outlives an optimizer step, the policy's drift since it was sampled.
            difference = (token_logps.detach().float() - inputs["sampler_logps"]).abs() * completion_mask
            total, count = gather(difference.sum().reshape(1)), gather(completion_mask.sum().reshape(1).float())
            self._metrics.add(mode, "vllm/logprob_diff_mean", total.sum() / count.sum().clamp(min=1.0))
            worst = difference.max() if difference.numel() else difference.new_zeros(())
            self._metrics.add(mode, "vllm/logprob_diff_max", gather(worst.reshape(1)).max())
        entropy_sum = gather((entropy * completion_mask).sum().reshape(1))
        token_count = gather(completion_mask.sum().reshape(1).float())
        self._metrics.add(mode, "entropy", entropy_sum.sum() / token_count.sum().clamp(min=1.0))
        if self.router_aux_loss_coef != 0.0 and aux_loss is not None:
            loss = loss + self.router_aux_loss_coef * aux_loss
            self._metrics.add(mode, "aux_loss", gather(aux_loss.detach().reshape(1)).mean())
        low, high, region = gather(clipped["low"]), gather(clipped["high"]), gather(clipped["region"])
        self._metrics.add(mode, "clip_ratio/low_mean", low.mean())
        self._metrics.add(mode, "clip_ratio/low_min", low.min())
        self._metrics.add(mode, "clip_ratio/high_mean", high.mean())
        self._metrics.add(mode, "clip_ratio/high_max", high.max())
        self._metrics.add(mode, "clip_ratio/region_mean", region.mean())
        return loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs).mean().detach()
        return loss, None, None

    # ------------------------------------------------------------------ metrics
    def _log_lengths(self, mode, prompt_id_lists, completion_id_lists, truncated):
        device = self.accelerator.device
        lengths = torch.tensor([len(ids) for ids in completion_id_lists], device=device)
        prompt_tokens = torch.tensor([sum(len(ids) for ids in prompt_id_lists)], device=device)
        all_lengths = self.accelerator.gather(lengths)
        all_truncated = self.accelerator.gather(truncated)
        tokens = self.accelerator.gather(prompt_tokens).sum() + all_lengths.sum()
        if mode == "train":
            self.state.num_input_tokens_seen += int(tokens.item())
        self._metrics.set(mode, "num_tokens", float(self.state.num_input_tokens_seen))
        mean, low, high = tensor_stats(all_lengths)
        self._metrics.add(mode, "completions/mean_length", mean)
        self._metrics.add(mode, "completions/min_length", low)
        self._metrics.add(mode, "completions/max_length", high)
        self._metrics.add(mode, "completions/clipped_ratio", all_truncated.float().mean())
        mean, low, high = tensor_stats(all_lengths[~all_truncated])
        self._metrics.add(mode, "completions/mean_terminated_length", mean)
        self._metrics.add(mode, "completions/min_terminated_length", low)
        self._metrics.add(mode, "completions/max_terminated_length", high)

    def _log_rewards(self, mode, rewards_per_func, shaped, num_generations, extra):
        for index, name in enumerate(self.reward_func_names):
            self._metrics.add(mode, f"rewards/{name}/mean", nanmean(rewards_per_func[:, index]))
            self._metrics.add(mode, f"rewards/{name}/std", nanstd_value(rewards_per_func[:, index]))
        weighted = algorithm.combine_rewards(rewards_per_func, self.reward_weights.to(rewards_per_func.device))
        if torch.isnan(weighted).any():
            unscorable = torch.isnan(weighted).sum().item()
            logger.warning("All reward functions returned None for %d of %d completions; they get advantage 0.",
                           unscorable, weighted.numel())
        self._metrics.add(mode, "reward", nanmean(weighted))
        self._metrics.add(mode, "reward_std", nanstd_value(weighted))
        zero_std = algorithm.group_std_is_zero(shaped, num_generations)
        self._metrics.add(mode, "frac_reward_zero_std", zero_std.float().mean())
        local = [(name, sum(values), len(values)) for name, values in sorted(extra.metrics.items())]
        entries = gather_object([local]) if self.accelerator.num_processes > 1 else [local]
        totals: dict[str, list[float]] = {}
        for rank_entries in entries:
            for name, total, count in rank_entries:
                accumulated = totals.setdefault(name, [0.0, 0])
                accumulated[0] += total
                accumulated[1] += count
        for name, (total, count) in sorted(totals.items()):
            self._metrics.add(mode, name, total / max(count, 1))

    def _record_completions(self, prompts, texts, rewards_per_func, advantages, extra_columns) -> None:
        per_rank = [(len(texts), extra_columns)]
        if self.accelerator.num_processes > 1:
            prompts, texts = gather_object(list(prompts)), gather_object(list(texts))
            per_rank = gather_object(per_rank)
        keys = sorted({key for _, columns in per_rank for key in columns})
        extra = {key: [value for rows, columns in per_rank for value in (columns.get(key) or [None] * rows)]
                 for key in keys}
        rewards = {name: rewards_per_func[:, index].tolist() for index, name in enumerate(self.reward_func_names)}
        self._logs.record(prompts, texts, rewards, advantages.tolist(), extra)
        self._logs_fresh = True

    def _log_completions(self) -> None:
        args = self.args
        if not (args.log_completions and self.accelerator.is_main_process and self._logs_fresh):
            return
        self._logs_fresh = False
        rows = self._logs.rows(self.state.global_step, args.log_unique_prompts)
        print_table(rows, self.state.global_step, args.num_completions_to_print, seed=args.seed)
        if "mlflow" in (args.report_to or []):
            try:
                log_table_to_mlflow(rows, self.state.global_step)
            except Exception as err:  # a tracking outage must not stop training
                logger.warning("could not log the completion table to MLflow: %s", err)
        for callback in self.callback_handler.callbacks:  # extension point: callbacks that want the rows
            if hasattr(callback, "on_completions"):
                callback.on_completions(args, self.state, self.control, rows=rows)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        metrics = self._metrics.flush(mode)
        if mode == "eval":
            metrics = {f"{self._eval_prefix}_{key}": value for key, value in metrics.items()}
            self._last_eval_metrics = metrics
        super().log({**logs, **metrics}, start_time)
        self._log_completions()

    # ------------------------------------------------------------------ checkpoints
    def _save_rng_state(self, output_dir: str) -> None:
        super()._save_rng_state(output_dir)
        state_dir = os.path.join(output_dir, STATE_DIR)
        os.makedirs(state_dir, exist_ok=True)
        state = {"step": self._step, "buffered_inputs": self._buffered_inputs,
                 "num_generations": self.args.num_generations,
                 "generation_batch_size": self.args.generation_batch_size, "model": self._model_identity}
        path = os.path.join(state_dir, f"rank{self.accelerator.process_index}.pt")
        _atomic_save(state, path)
        if self.args.sync_ref_model:  # TR-DPO moves the reference: keep it (ZeRO-3: gathered on every rank)
            reference = self.accelerator.unwrap_model(self.ref_model)
            with gathered_parameters(reference, self._zero3):
                if self.accelerator.is_main_process:
                    weights = {name: value.detach().clone() for name, value in reference.state_dict().items()}
                    _atomic_save(weights, os.path.join(state_dir, REFERENCE_FILE))

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None,
              **kwargs):
        # Check the checkpoint against this run before any weight is loaded (the DeepSpeed and plain paths load
        # at different moments), so a mismatch is a clear error, not a state-dict one.
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir) \
                if os.path.isdir(self.args.output_dir) else None
            if resume_from_checkpoint is None:
                raise ValueError(f"resume_from_checkpoint=True but {self.args.output_dir} holds no checkpoint-N "
                                 "folder. Fix: start without resume_from_checkpoint, or point it at a checkpoint.")
        if resume_from_checkpoint:
            state = self._read_rloo_state(resume_from_checkpoint)
            if state is not None:
                self._check_checkpoint_compatible(resume_from_checkpoint, state)
        return super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial,
                             ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)

    def _read_rloo_state(self, checkpoint: str) -> dict | None:
        path = os.path.join(checkpoint, STATE_DIR, f"rank{self.accelerator.process_index}.pt")
        return torch.load(path, map_location="cpu", weights_only=False) if os.path.exists(path) else None

    def _load_rng_state(self, checkpoint: str | None) -> None:
        # Called on every resume path (plain, DeepSpeed), after the weights: restore our own state beside the RNGs.
        super()._load_rng_state(checkpoint)
        if checkpoint is None:
            return
        reference_path = os.path.join(checkpoint, STATE_DIR, REFERENCE_FILE)
        if self.args.sync_ref_model and os.path.exists(reference_path):
            reference = self.accelerator.unwrap_model(self.ref_model)
            with gathered_parameters(reference, self._zero3, modifier_rank=0):
                if self.accelerator.is_main_process or not self._zero3:
                    reference.load_state_dict(torch.load(reference_path, map_location="cpu", weights_only=True))
        state = self._read_rloo_state(checkpoint)
        if state is not None:
            self._step = state["step"]
            self._buffered_inputs = _to_device(state["buffered_inputs"], self.accelerator.device)

    def _check_checkpoint_compatible(self, checkpoint: str, state: dict) -> None:
        if state["num_generations"] != self.args.num_generations:
            raise ValueError(f"checkpoint {checkpoint} was trained with num_generations={state['num_generations']}, "
                             f"this run has {self.args.num_generations}: the prompt groups would not line up. "
                             "Fix: resume with the same num_generations, or start a new run in another output_dir.")
        saved, current = state.get("model"), self._model_identity
        if saved is not None and (saved["class"], saved["shapes_digest"]) != (current["class"],
                                                                              current["shapes_digest"]):
            raise ValueError(f"checkpoint {checkpoint} was trained from a different model ({saved['class']} "
                             f"{saved['name_or_path']!r}, weights {saved['shapes_digest']}) than this run "
                             f"({current['class']} {current['name_or_path']!r}, weights {current['shapes_digest']}). "
                             "Fix: resume with the model the checkpoint was trained from, or start a new run in "
                             "another output_dir.")
        if state["generation_batch_size"] != self.args.generation_batch_size:
            warnings.warn(f"checkpoint {checkpoint} used generation_batch_size={state['generation_batch_size']}, "
                          f"this run uses {self.args.generation_batch_size}: the resumed run will not replay the "
                          "same prompt order.")

    # ------------------------------------------------------------------ saving and the Hub (through rloo.hub's Publisher)
    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        super()._save(output_dir, state_dict)
        if not self.args.should_save:  # only the writer rank saved anything
            return
        # transformers pickles the whole TrainingArguments, hub_token included, into every save (and so into every
        # upload): write it again with the secrets cleared.
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        scrubbed = copy.copy(self.args)
        for name in vars(scrubbed):
            if is_secret(name) and isinstance(getattr(scrubbed, name), str):
                setattr(scrubbed, name, None)
        _atomic_save(scrubbed, os.path.join(output_dir, "training_args.bin"))

    def init_hf_repo(self, token: str | None = None, private: bool | None = None) -> None:
        if not self.is_world_process_zero():
            return
        repo_id = self.args.hub_model_id or os.path.basename(os.path.abspath(self.args.output_dir))
        token = token if token is not None else self.args.hub_token
        private = private if private is not None else self.args.hub_private_repo
        self.hub_model_id = get_publisher().create_repo(repo_id, token=token, private=private)
        self.push_in_progress = None

    def create_model_card(self, model_name: str | None = None, dataset_name: str | None = None,
                          tags: str | list[str] | None = None, **kwargs) -> None:
        """README.md in output_dir: base model, dataset, method, reward functions, RLOO configuration (no secrets),
        final metrics."""
        if not self.is_world_process_zero():
            return
        if dataset_name is None and isinstance(self.train_dataset, (Dataset, IterableDataset)):
            info = getattr(self.train_dataset, "info", None)
            dataset_name = getattr(info, "dataset_name", None)
        base_model = self._model_identity["name_or_path"] or None
        if base_model and os.path.isdir(os.path.expanduser(base_model)):
            base_model = None  # a local path means nothing to readers of the Hub page
        tags = [tags] if isinstance(tags, str) else list(tags or [])
        metrics = next((log for log in reversed(self.state.log_history) if "reward" in log), None)
        card = render_model_card(model_name or os.path.basename(os.path.abspath(self.args.output_dir)), base_model,
                                 dataset_name, self.reward_func_names, self.args.to_dict(), metrics,
                                 tags + self._tag_names, peft=self._is_peft)
        with open(os.path.join(self.args.output_dir, "README.md"), "w", encoding="utf-8") as handle:
            handle.write(card)

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True,
                    token: str | None = None, revision: str | None = None, private: bool | None = None, **kwargs):
        """Save the model, write the model card, upload output_dir (checkpoints excluded). Returns the commit."""
        self.callback_handler.on_push_begin(self.args, self.state, self.control)
        token = token if token is not None else self.args.hub_token
        if self.hub_model_id is None:
            self.init_hf_repo(token=token, private=private)
        self.save_model(_internal_call=True)
        if not self.is_world_process_zero():
            return None
        model_name = kwargs.pop("model_name", None) or (self.args.hub_model_id or "").split("/")[-1] or None
        self.create_model_card(model_name=model_name, **kwargs)
        return get_publisher().upload_folder(self.hub_model_id, self.args.output_dir, commit_message, token,
                                             revision=revision or self.args.hub_revision,
                                             ignore_patterns=["_*", "checkpoint-*"])

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """push_to_hub=True during training: upload at each save, per hub_strategy (synchronously)."""
        strategy = getattr(self.args.hub_strategy, "value", self.args.hub_strategy)
        if not self.is_world_process_zero() or strategy == "end":
            return
        self.callback_handler.on_push_begin(self.args, self.state, self.control)
        publisher, token = get_publisher(), self.args.hub_token
        message = f"Training in progress, step {self.state.global_step}"
        publisher.upload_folder(self.hub_model_id, checkpoint_folder, message, token,
                                revision=self.args.hub_revision, ignore_patterns=["rloo_state", "optimizer.pt",
                                                                                   "scheduler.pt", "rng_state*"])
        if strategy in ("checkpoint", "all_checkpoints"):
            path = "last-checkpoint" if strategy == "checkpoint" else os.path.basename(checkpoint_folder)
            publisher.upload_folder(self.hub_model_id, checkpoint_folder, message + ", checkpoint", token,
                                    revision=self.args.hub_revision, path_in_repo=path)
