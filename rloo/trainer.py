"""RLOOTrainer: one step = sample prompts -> generate -> score -> leave-one-out advantages -> loss.

Transformers glue only: the rollout (generate, score, advantages) is `rloo.rollout`, the mathematics
`rloo.algorithm`, input checks `rloo.checks`, the backend choice `rloo.generation`, checkpoint state
`rloo.checkpoint`, the Hub `rloo.hub`. TRL's public API.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from accelerate.utils import gather_object, set_seed
from datasets import Dataset, IterableDataset
from transformers import PreTrainedModel, Trainer

from rloo import algorithm, checkpoint, engine, faults, hub
from rloo.adapters import attach_adapter
from rloo.batches import ReadAhead
from rloo.callbacks import SyncRefModelCallback, completion_table_callbacks
from rloo.checks import check_dispatch, check_inputs, prepare_for_iterable_datasets
from rloo.completion_log import CompletionLog, print_table
from rloo.config import RLOOConfig
from rloo.config_checks import reject_legacy_trainer_arguments
from rloo.generation import LeanGenerator, make_generation_backend
from rloo.importance import sampler_weights
from rloo.logps import StepLogProbs, per_token_logps
from rloo.metrics import MetricBuffer
from rloo.models import (
    disable_dropout,
    dropout_active,
    eos_token_ids,
    is_moe,
    is_peft_model,
    load_policy,
    load_reward_model,
    load_tokenizer,
    model_identity,
    prepare_reference,
    prepare_reward_model,
    prepare_tokenizer,
    reference_for_zero3,
    resolve_router_aux_loss_coef,
    reward_tokenizers,
    text_tokenizer_of,
)
from rloo.rewards.runner import RewardRunner
from rloo.rollout import (
    Rollout,
    RolloutSettings,
    build_rollout,
    complete_rollout,
    global_masked_mean,
    pi_old_plan,
    rollout_metrics,
)
from rloo.sampling import RepeatSampler, repeat_iterable, shuffle_rows, split_rows
from rloo.timing import StepTimingCallback, device_timer
from rloo.versions import TRANSFORMERS, TRANSFORMERS_4, precision_environment
from rloo.vision import check_image_rows, is_vision_config
from rloo.watchdog import StallWatchdog, awaiting
from rloo.zero import gathered_parameters, prepare_frozen, single_process_ddp, zero_stage

logger = logging.getLogger(__name__)


class RLOOTrainer(Trainer):
    """Trainer for REINFORCE Leave-One-Out (Ahmadian et al., 2024), API-compatible with TRL's
    RLOOTrainer."""

    _tag_names = ["rloo"]
    loss_is_scaled_for_ga = False  # our loss is a per-micro-batch mean: the Trainer divides by GA

    @reject_legacy_trainer_arguments  # TRL <= 0.21 names -> their replacements
    def __init__(
        self,
        model: str | PreTrainedModel,
        reward_funcs: Any | list,
        args: RLOOConfig | None = None,
        train_dataset: Dataset | IterableDataset | None = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
        callbacks: list | None = None,
        optimizers: tuple = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
    ):
        config = getattr(model, "config", None)
        model_id = model if isinstance(model, str) else getattr(config, "_name_or_path", "model")
        if args is None:
            args = RLOOConfig(output_dir=f"{str(model_id).rstrip('/').split('/')[-1]}-RLOO")
        elif not isinstance(args, RLOOConfig):
            raise TypeError(f"args must be an RLOOConfig, got {type(args).__name__}")
        check_inputs(
            args,
            reward_funcs,
            train_dataset,
            eval_dataset,
            reward_processing_classes,
            model,
            quantization_config,
            peft_config,
        )

        self._model_source = (
            model if isinstance(model, str) else getattr(model.config, "_name_or_path", "")
        )
        model, init_kwargs = load_policy(model, args, quantization_config)
        self._model_identity = model_identity(model)

        # Tokenizer, or processor for a vision-language model (rloo.vision).
        self._vision = is_vision_config(model.config)
        if self._vision and TRANSFORMERS_4:
            raise ValueError(
                f"{type(model).__name__} is a vision-language model: rloo trains those with "
                f"transformers 5 (their processors and image inputs), and transformers "
                f"{TRANSFORMERS} is installed. Fix: pip install -U 'transformers>=5'."
            )
        if processing_class is None:
            processing_class = load_tokenizer(
                model.config._name_or_path,
                args.trust_remote_code,
                revision=(args.model_init_kwargs or {}).get("revision"),
                config=model.config,
            )
        processing_class = prepare_tokenizer(processing_class)
        check_image_rows(train_dataset, eval_dataset, processing_class)
        tokenizer = text_tokenizer_of(processing_class)
        self.pad_token_id = tokenizer.pad_token_id
        self.eos_token_ids = eos_token_ids(tokenizer, model)
        if getattr(model.generation_config, "pad_token_id", None) is None:
            model.generation_config.pad_token_id = self.pad_token_id

        # new adapter weights are drawn here: the same seed must give the same adapter
        set_seed(args.seed)
        model, self._trainable_adapter = attach_adapter(model, peft_config, args)
        self._is_peft = is_peft_model(model)
        self.router_aux_loss_coef = resolve_router_aux_loss_coef(model, args.router_aux_loss_coef)
        # TRL's public flag: the router's auxiliary loss is added to the policy loss
        self.aux_loss_enabled = is_moe(model) and self.router_aux_loss_coef != 0.0

        # Reward functions and reward models.
        funcs = reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        reward_funcs = [
            load_reward_model(f, args.model_init_kwargs, args.trust_remote_code)
            if isinstance(f, str)
            else f
            for f in funcs
        ]
        reward_processing_classes = reward_tokenizers(
            reward_funcs, reward_processing_classes, args.trust_remote_code
        )
        self.reward_funcs = reward_funcs
        # one per reward function (a reward model's tokenizer, None for a plain function), as TRL
        self.reward_processing_classes = list(reward_processing_classes)
        self.reward_runner = RewardRunner(
            reward_funcs,
            reward_processing_classes,
            args.chat_template_kwargs,
            args.reward_timeout,
            args.nonfinite_rewards,
        )
        self.reward_func_names = self.reward_runner.names
        self.reward_weights = torch.tensor(
            args.reward_weights or [1.0] * len(reward_funcs), dtype=torch.float32
        )

        if args.disable_dropout:
            disable_dropout(model)

        prepare_for_iterable_datasets(args, train_dataset, eval_dataset)
        set_seed(args.seed)
        precision_environment(args)  # (this trainer's Accelerator reads it on transformers 4.x)
        super().__init__(
            model=model,
            args=args,
            data_collator=list,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        # torchrun with one CPU process: no DDP wrapper (rloo.zero)
        single_process_ddp(self.accelerator)
        # the speed layer on, or the reference path (rloo.engine): always for images and Liger
        forced = engine.reference_reason(self._vision, args.use_liger_kernel)
        self._fast = engine.is_fast(args.engine) and forced is None
        engine.keep_freed_memory(self._fast)
        self._gather_object = gather_object if self.accelerator.num_processes > 1 else None

        # Reference model: only needed when the KL penalty is on. Under ZeRO-3 it is sharded like
        # the policy.
        self._zero3 = zero_stage(self.accelerator) == 3
        self._frozen_engines = []
        if self._zero3:
            gathered = (
                "full weights gathered"
                if args.ds3_gather_for_generation
                else "layer by layer, ranks synced"
            )
            self.accelerator.print(
                f"rloo: DeepSpeed ZeRO-3 sharding on {self.accelerator.num_processes} ranks "
                f"(policy, reference and reward models); generation: {gathered}."
            )
        self.ref_model = None
        if args.beta != 0.0 and not self._is_peft:
            if self._zero3:
                reference = reference_for_zero3(
                    self.model, self._model_source, init_kwargs, args.trust_remote_code
                )
                if args.disable_dropout:
                    disable_dropout(reference)
                self.ref_model = prepare_frozen(
                    reference, self.accelerator, args.per_device_train_batch_size
                )
            else:
                self.ref_model = prepare_reference(self.model, self.accelerator, mapped=self._fast)
        if args.sync_ref_model:
            self.add_callback(SyncRefModelCallback(self))
        for callback in completion_table_callbacks(args.report_to):
            self.add_callback(callback)
        for index, func in enumerate(self.reward_funcs):
            if isinstance(func, PreTrainedModel):
                func.eval()
                # sharded; the engine's hooks live on the module, which the runner calls
                if self._zero3:
                    self._frozen_engines.append(
                        prepare_frozen(func, self.accelerator, args.per_device_train_batch_size)
                    )
                else:
                    self.reward_funcs[index] = prepare_reward_model(func, self.accelerator)

        self.generator = make_generation_backend(
            args,
            self.accelerator,
            self.model,
            tokenizer,
            self.pad_token_id,
            self.eos_token_ids,
            zero3=self._zero3,
            fast=self._fast,
            processor=processing_class,
        )
        self._metrics, self._timer = MetricBuffer(), device_timer(self.accelerator.device)
        self.generator.timer = self._timer
        self.reward_runner.progress = self._timer.advance
        generated_by = (
            None if isinstance(self.generator, LeanGenerator) else type(self.generator).__name__
        )
        logger.info(engine.describe(self._fast, self.model, generated_by, self.ref_model, forced))
        self.add_callback(StepTimingCallback(self._timer, self._metrics))
        self._watchdog = None  # no silent hang (rloo.watchdog)
        if args.stall_timeout_s:
            self._watchdog = StallWatchdog(
                self._timer,
                args,
                self.accelerator.process_index,
                lambda sections: awaiting(self.generator, sections),
            )
            self.add_callback(self._watchdog)
        self._logs = CompletionLog(args.generation_batch_size, args.log_multimodal)
        self._logs_fresh = False
        self._eval_prefix = "eval"
        self._last_eval_metrics: dict[str, float | None] = {}
        self._step = 0
        self._buffered_inputs: list[Rollout] | None = None
        # where pi_old comes from (rloo.rollout.PiOld)
        dropout = dropout_active(self.model)
        self._pi_old = {mode: pi_old_plan(args, dropout, mode) for mode in ("train", "eval")}
        # generation batches whose prompts were processed ahead, by id (rloo.batches.ReadAhead)
        self._prepared_prompts: dict = {}
        # duplicated prompts on different ranks sample differently
        set_seed(args.seed, device_specific=True)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
        """Trainer.evaluate, with the RLOO metrics (reward, completions/*, ...) under the same
        prefix as the loss: `eval_` for one dataset, `eval_<name>_` for each entry of a dict /
        DatasetDict."""
        previous, self._eval_prefix = self._eval_prefix, metric_key_prefix
        try:
            # every batch from one copy of the weights, where one is made
            with self.generator.reusing_weights():
                metrics = super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)
        finally:
            self._eval_prefix = previous
        if not isinstance(eval_dataset if eval_dataset is not None else self.eval_dataset, dict):
            metrics.update(self._last_eval_metrics)
        return metrics

    # ------------------------------------------------------------------ data: whole prompt groups
    # A dataloader batch is one process's share of a whole generation batch, each prompt repeated
    # num_generations times in a row (RepeatSampler, reproducible per epoch); eval batches hold
    # whole prompt groups; a streaming dataset repeats its prompts in the stream and is read in
    # the main process.
    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = ["prompt", "image", "images"]

    def get_train_dataloader(self):
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        args, dataset = self.args, self.train_dataset
        # no sampler: the same order, built into the stream
        if isinstance(dataset, IterableDataset):
            if args.shuffle_dataset:
                dataset = dataset.shuffle(seed=args.seed)
            prompts = args.generation_batch_size // args.num_generations
            dataset = repeat_iterable(
                dataset, prompts, args.num_generations, args.generation_micro_steps
            )
        # One dataloader batch = this process's share of a whole generation batch.
        return self._get_dataloader(
            dataset=dataset,
            description="Training",
            batch_size=self._train_batch_size * args.steps_per_generation,
            sampler_fn=self._get_train_sampler,
            is_training=True,
        )

    def get_eval_dataloader(self, eval_dataset=None):
        dataset = (
            self.eval_dataset[eval_dataset]
            if isinstance(eval_dataset, str)
            else (eval_dataset if eval_dataset is not None else self.eval_dataset)
        )
        generations = self._num_generations("eval")
        eval_batch = self.args.per_device_eval_batch_size * self.accelerator.num_processes
        if eval_batch % generations != 0:
            raise ValueError(
                f"The global eval batch size ({eval_batch} = per_device_eval_batch_size "
                f"{self.args.per_device_eval_batch_size} x {self.accelerator.num_processes} "
                f"processes) must be divisible by num_generations_eval ({generations}) so that "
                "every batch holds whole prompt groups."
            )
        if isinstance(dataset, IterableDataset):
            check_dispatch(self.args, None, dataset)  # dispatch_batches=True set by hand
            dataset = repeat_iterable(dataset, 1, generations)
        return super().get_eval_dataloader(dataset)

    def _get_train_sampler(self, dataset=None):
        dataset = dataset if dataset is not None else self.train_dataset
        args = self.args
        return RepeatSampler(
            len(dataset),
            mini_repeat_count=args.num_generations,
            batch_size=args.generation_batch_size // args.num_generations,
            repeat_count=args.generation_micro_steps,
            shuffle=args.shuffle_dataset,
            seed=args.seed,
        )

    def _get_eval_sampler(self, eval_dataset):
        return RepeatSampler(
            len(eval_dataset), mini_repeat_count=self._num_generations("eval"), seed=self.args.seed
        )

    def _num_generations(self, mode: str) -> int:
        if mode == "eval":
            return self.args.num_generations_eval or self.args.num_generations
        return self.args.num_generations

    def _get_dataloader(
        self,
        dataset,
        description,
        batch_size,
        sampler_fn=None,
        is_training=False,
        dataloader_key=None,
    ):
        if not isinstance(dataset, IterableDataset):
            return super()._get_dataloader(
                dataset, description, batch_size, sampler_fn, is_training, dataloader_key
            )
        # A stream of one shard would be read once per worker: load it in the main process.
        names = (
            "dataloader_num_workers",
            "dataloader_persistent_workers",
            "dataloader_prefetch_factor",
        )
        saved = {name: getattr(self.args, name) for name in names}
        for name, value in zip(names, (0, False, None)):
            setattr(self.args, name, value)
        try:
            return super()._get_dataloader(
                dataset, description, batch_size, sampler_fn, is_training, dataloader_key
            )
        finally:
            for name, value in saved.items():
                setattr(self.args, name, value)

    # (asynchronous generation)
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """One optimizer step's dataloader batches; with async_generation, also read
        weight_sync_steps generation batches further, so that the batches sampled before the next
        push are known (`_upcoming_prompt_ids`) and sampled while this one trains. What is read
        ahead is handed out in order later; a checkpoint keeps the batches in flight
        (rloo.generation.vllm_async)."""
        if not self.args.generates_ahead:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        if getattr(self, "_read_ahead_of", None) is not epoch_iterator:  # a new epoch
            self._read_ahead_of, self._read_ahead = epoch_iterator, []
        # the generation batches sampled before the next push (one per optimizer step)
        ahead = self.args.generation_micro_steps * self.args.weight_sync_steps
        while len(self._read_ahead) < num_batches + ahead:
            try:
                self._read_ahead.append(next(epoch_iterator))
            except StopIteration:
                break
        self._window = self._read_ahead
        batches, self._read_ahead = self._window[:num_batches], self._window[num_batches:]
        return batches, None

    def _upcoming_prompt_ids(self, rows: list[dict], mode: str) -> dict:
        """{"upcoming": the generation batches read ahead after `rows`} for the backend (async
        generation, training); else {}."""
        if mode != "train" or not self.args.generates_ahead:
            return {}
        every = self.args.generation_micro_steps
        window = getattr(self, "_window", [])
        # (by identity: the repeats of one generation batch are equal, not the same object)
        index = next((i for i, batch in enumerate(window) if batch is rows), None)
        later = [] if index is None else window[index + every :: every]
        # none past the last step: (generation batches left after this one, counted in whole
        # optimizer steps)
        left = (
            self.state.max_steps - self.state.global_step
        ) * self.args.gradient_accumulation_steps // every - 1
        later = later[: max(0, left)]
        return {
            "upcoming": ReadAhead(
                self.processing_class,
                later,
                self.args.chat_template_kwargs,
                self._vision,
                self._prepared_prompts,
            )
        }

    # ------------------------------------------------------------------ the step
    def training_step(self, model, inputs, num_items_in_batch=None):
        # the rollout's sections inside it count apart (rloo.timing)
        with self._timer.section("train"):
            loss = super().training_step(model, inputs, num_items_in_batch)
        self._step += 1
        self._timer.end_micro_step()
        return loss

    def _prepare_inputs(self, generation_batch) -> Rollout:
        if not self.model.training:
            return self._rollout(generation_batch, "eval")
        generate_every = self.args.generation_micro_steps
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            rollout = self._rollout(generation_batch, "train")
            self._buffered_inputs = split_rows(
                shuffle_rows(rollout), self.args.steps_per_generation
            )
        return self._buffered_inputs[self._step % self.args.steps_per_generation]

    def _rollout(self, rows: list[dict], mode: str) -> Rollout:
        """One generation batch through rloo.rollout, with this trainer's models, backend and
        processes."""
        args, accelerator = self.args, self.accelerator
        unwrapped = accelerator.unwrap_model(self.model)
        num_generations = self._num_generations(mode)
        # In-process backends generate from the live (under ZeRO-3: gathered) weights; vLLM gets its
        # own copy.
        gather_weights = self._zero3 and args.ds3_gather_for_generation and not args.use_vllm

        # the rollout's collaborators hold what they need: nothing in them calls back into the
        # trainer
        generator, timer, step = self.generator, self._timer, self.state.global_step
        upcoming = self._upcoming_prompt_ids(rows, mode)

        def generate(prompt_ids, **media):  # media: a VLM's images (rloo.vision)
            with contextlib.ExitStack() as stack:
                with timer.section("weight_sync"):
                    stack.enter_context(gathered_parameters(unwrapped, gather_weights))
                return generator.generate(
                    unwrapped, prompt_ids, num_generations, step, **media, **upcoming
                )

        chunk = (
            args.per_device_train_batch_size if mode == "train" else args.per_device_eval_batch_size
        )
        settings = RolloutSettings(
            num_generations=num_generations,
            pad_token_id=self.pad_token_id,
            eos_token_ids=self.eos_token_ids,
            reward_weights=self.reward_weights,
            beta=args.beta,
            reward_clip_range=args.reward_clip_range,
            normalize_advantages=args.normalize_advantages,
            mask_truncated_completions=args.mask_truncated_completions,
            pad_to_multiple_of=args.pad_to_multiple_of,
            chat_template_kwargs=args.chat_template_kwargs,
            vision=self._vision,
            pi_old=self._pi_old[mode],
        )
        unwrap = accelerator.unwrap_model
        share = self._fast and engine.kl_forwards_share_prompts(unwrapped, self.ref_model)
        if self._pi_old[mode].kl == "loss":  # as the loss's forward, which runs without a wrapper
            share = share and unwrap(self.model_wrapped) is self.model_wrapped
        logprobs = StepLogProbs(
            policy_model=unwrapped,
            reference_model=self.ref_model,
            temperature=args.temperature,
            chunk=chunk,
            share_prompts=share,
            trainable_adapter=self._trainable_adapter,
            reference_pages=None if self.ref_model is None else unwrap(self.ref_model),
            advance=self._timer.advance,
        )
        rollout = build_rollout(
            rows,
            settings,
            generate=generate,
            processing_class=self.processing_class,
            reward_runner=self.reward_runner,
            trainer_state=self.state,
            logprobs=logprobs,
            gather=accelerator.gather,
            gather_object=self._gather_object,
            process_index=accelerator.process_index,
            device=accelerator.device,
            timer=self._timer,
            prepared=ReadAhead.take(self._prepared_prompts, rows),
        )
        for name, value in self.generator.pop_metrics().items():
            self._metrics.add(mode, name, value)
        self.state.num_input_tokens_seen += rollout.num_tokens if mode == "train" else 0
        self._metrics.set(mode, "num_tokens", float(self.state.num_input_tokens_seen))
        if rollout.pending is None:  # else once the loss has completed it (complete_rollout)
            self._record_rollout(rollout, mode)
        return rollout

    def _record_rollout(self, rollout: Rollout, mode: str) -> None:
        """The rollout's metrics and completion-log rows (this process's rows in their generation
        order)."""
        for name, value in rollout_metrics(
            rollout, self.reward_func_names, self.reward_weights
        ).items():
            self._metrics.add(mode, name, value)
        if self.args.log_completions:
            rows = (
                rollout
                if rollout.row_index is None
                else rollout.select(torch.argsort(rollout.row_index))
            )
            self._logs.record_rollout(rows, self.reward_func_names, self._gather_object)
            self._logs_fresh = True

    def compute_loss(self, model, inputs: Rollout, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError("RLOOTrainer.compute_loss does not return model outputs.")
        mode = "train" if self.model.training else "eval"
        mask, input_ids = (
            inputs.completion_mask,
            torch.cat([inputs.prompt_ids, inputs.completion_ids], dim=1),
        )
        attention_mask = torch.cat([inputs.prompt_mask, mask], dim=1)
        unwrapped = self.accelerator.unwrap_model(model)
        with engine.loss_context(model, unwrapped, self._fast):  # less memory, same gradients
            # shared prompts: not through a DDP/DeepSpeed wrapper
            token_logps, entropy, aux_loss = per_token_logps(
                model,
                input_ids,
                attention_mask,
                inputs.completion_ids.size(1),
                self.args.temperature,
                with_entropy=True,
                share_prompts=self._fast and unwrapped is model,
                media=inputs.media,
            )
        # the step's stage where this forward is the KL's pi_old (PiOld "loss")
        if inputs.pending is not None:
            inputs = complete_rollout(inputs, token_logps, self.accelerator.gather)
            self._record_rollout(inputs, mode)
        old_logps = inputs.old_logps
        if old_logps is None:  # on-policy: pi_old is the current policy, ratio exactly 1
            old_logps = (token_logps * mask).sum(dim=1).detach()
        gather = self.accelerator.gather
        importance = sampler_weights(
            self.args, inputs, token_logps, self._metrics, mode, gather, self._pi_old[mode]
        )
        loss, clipped = algorithm.clipped_surrogate_loss(
            token_logps,
            old_logps,
            inputs.advantages,
            mask,
            self.args.epsilon,
            self.args.epsilon_high,
            importance,
        )
        self._metrics.add(mode, "entropy", global_masked_mean(entropy, mask, gather))
        if self.router_aux_loss_coef != 0.0 and aux_loss is not None:
            loss = loss + self.router_aux_loss_coef * aux_loss
            self._metrics.add(mode, "aux_loss", gather(aux_loss.detach().reshape(1)).mean())
        low, high, region = (
            gather(clipped["low"]),
            gather(clipped["high"]),
            gather(clipped["region"]),
        )
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

    # ------------------------------------------------------------------ completion tables and logs
    def _log_completions(self) -> None:
        args = self.args
        if not (args.log_completions and self.accelerator.is_main_process and self._logs_fresh):
            return
        self._logs_fresh = False
        rows = self._logs.rows(self.state.global_step, args.log_unique_prompts)
        print_table(rows, self.state.global_step, args.num_completions_to_print, seed=args.seed)
        # extension point: callbacks that want the rows
        for callback in self.callback_handler.callbacks:
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

    # ------------------------------------------------------------------ checkpoints (state:
    # rloo.checkpoint)
    def _save_checkpoint(self, model, trial) -> None:
        checkpoint.save_complete(
            self, trial, lambda: super(RLOOTrainer, self)._save_checkpoint(model, trial)
        )

    def _save_rng_state(self, output_dir: str) -> None:
        # weights and optimizer written, RNG / RLOO / trainer state not yet
        faults.point("mid-save")
        super()._save_rng_state(output_dir)
        checkpoint.save_state(
            output_dir,
            self.accelerator.process_index,
            {
                "step": self._step,
                "buffered_inputs": self._buffered_inputs,
                "generator": self.generator.checkpoint_state(),
                "model": self._model_identity,
                "num_generations": self.args.num_generations,
                "generation_batch_size": self.args.generation_batch_size,
            },
        )
        # TR-DPO moves the reference: keep it (ZeRO-3: gathered on every rank)
        if self.args.sync_ref_model:
            reference = self.accelerator.unwrap_model(self.ref_model)
            with gathered_parameters(reference, self._zero3):
                if self.accelerator.is_main_process:
                    weights = {
                        name: value.detach().clone()
                        for name, value in reference.state_dict().items()
                    }
                    checkpoint.atomic_save(weights, checkpoint.reference_path(output_dir))

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial=None,
        ignore_keys_for_eval=None,
        **kwargs,
    ):
        # checked against this run before any weight loads: a mismatch is a clear error
        resume_from_checkpoint = checkpoint.checked_resume(self, resume_from_checkpoint)
        if (
            resume_from_checkpoint
            and (done := checkpoint.finished_run(self, resume_from_checkpoint)) is not None
        ):
            return done
        try:
            return super().train(
                resume_from_checkpoint=resume_from_checkpoint,
                trial=trial,
                ignore_keys_for_eval=ignore_keys_for_eval,
                **kwargs,
            )
        finally:  # also when a step raised: no watchdog outlives its training
            if self._watchdog is not None:
                self._watchdog.close()

    def _load_rng_state(self, checkpoint_dir: str | None) -> None:
        # Called on every resume path (plain, DeepSpeed), after the weights: restore our own state
        # beside the RNGs.
        super()._load_rng_state(checkpoint_dir)
        if checkpoint_dir is not None:
            checkpoint.restore_state(self, checkpoint_dir)

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        super()._save(output_dir, state_dict)
        if self.args.should_save:  # only the writer rank saved anything
            hub.rewrite_training_args(
                self.args, output_dir if output_dir is not None else self.args.output_dir
            )

    def _load_renamed(self, folder: str, model=None) -> bool:
        target = self.accelerator.unwrap_model(model if model is not None else self.model)
        plain = not (self.is_deepspeed_enabled or self.is_fsdp_enabled)
        return plain and checkpoint.load_renamed_weights(target, folder)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if not self._load_renamed(resume_from_checkpoint, model):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_best_model(self) -> None:
        if not self._load_renamed(self.state.best_model_checkpoint):
            super()._load_best_model()

    # ------------------------------------------------------------------ the Hub (rloo.hub)
    def init_hf_repo(self, token: str | None = None, private: bool | None = None) -> None:
        hub.init_repo(self, token=token, private=private)

    def create_model_card(
        self,
        model_name: str | None = None,
        dataset_name: str | None = None,
        tags: str | list[str] | None = None,
        **kwargs,
    ) -> None:
        hub.write_model_card(self, model_name=model_name, dataset_name=dataset_name, tags=tags)

    def push_to_hub(
        self,
        commit_message: str | None = "End of training",
        blocking: bool = True,
        token: str | None = None,
        revision: str | None = None,
        private: bool | None = None,
        **kwargs,
    ):
        """Save, write the model card, upload output_dir (checkpoints excluded). Returns the commit,
        or with blocking=False a Future of it (the upload goes on in the background)."""
        return hub.push_output_dir(
            self, commit_message, blocking, token, revision, private, **kwargs
        )

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        hub.push_checkpoint(self, checkpoint_folder)
