"""Sampling completions with a decode loop of our own (the default in-process backend when the
sampling settings allow it): the prompts once per distinct prompt through the decode step's C where
the whole step is ours (rloo.engine.prompt_steps), else through the model's forward
(rloo.engine.prefill: rows repeating a prompt share its KV cache; on the CPU in groups of similar
length), then one decode step per token (rloo.engine.decode's written-out step for the Llama family,
else the model's forward), transformers' own logits processors in `generate`'s order, and an
inverse-CDF draw instead of `torch.multinomial` (in C on the logits where min_new_tokens is the only
processor: rloo.engine.kernel.draw; on a GPU replayed as a CUDA graph: Draws).

Same distribution as `model.generate`: the same logits (same function, positions and mask), the same
processors (repetition penalty, min_new_tokens, temperature, top-k, top-p, min-p), the same EOS
handling; only the random draw differs: one uniform number per row against the cumulative
probabilities (float64), where `multinomial` draws an exponential variate for every vocabulary entry
(a large part of `generate`'s time on a CPU). Greedy decoding gives
`generate`'s tokens. Settings it does not implement (beams, n-gram bans, bad words, a cache
implementation, ...) keep `model.generate` (`supports`).

Given a `temperature` (RLOOConfig.kl_logps_from_generation, rloo.generation.keep_policy_logprobs),
it keeps log softmax(logits / temperature) of every drawn token, from the raw logits before any
processor: the policy's own log-probs, which the rollout then takes instead of a second forward
over the finished rows. The generation backend around it is rloo.generation.lean."""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.utils import GenerationMixin

from rloo.engine import kernel
from rloo.engine.cuda_graph import Graphed
from rloo.engine.decode import lean_decoder, weights_key
from rloo.engine.prefill import prefill
from rloo.engine.prompt_steps import prompt_steps
from rloo.kv import cache_argument, share_cache_rows
from rloo.primitives import selective_log_softmax
from rloo.versions import TRANSFORMERS_4

# GenerationConfig fields this loop implements; any other field set away from its default keeps
# model.generate.
HANDLED = {
    "max_new_tokens",
    "min_new_tokens",
    "do_sample",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "disable_compile",
    "cache_implementation",
    "transformers_version",
    "use_cache",
}


def supports(generation_config: GenerationConfig, model) -> bool:
    """Whether this loop reproduces `generate` for these settings and this model (a decoder-only
    LM)."""
    changed = set(generation_config.to_diff_dict())
    plain = (
        generation_config.cache_implementation is None
        and (generation_config.num_beams or 1) == 1
        and (generation_config.num_return_sequences or 1) == 1
        and generation_config.max_new_tokens is not None
    )
    config = getattr(model, "config", None)
    decoder_only = config is not None and not getattr(config, "is_encoder_decoder", False)
    return (
        changed <= HANDLED
        and plain
        and decoder_only
        and _takes_decode_arguments(model)
        and not customised_generate(model)
    )


_GENERATE = GenerationMixin.generate  # transformers' own, as imported


def customised_generate(model) -> bool:
    """A `generate` someone changed (on the instance, in a subclass, or by patching transformers'
    GenerationMixin): generation must go through it, so this loop stands aside. PEFT's wrapper is
    not a change: the model it wraps is looked at."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if "generate" in vars(model) or "generate" in vars(base):
        return True
    owner = next((cls for cls in type(base).__mro__ if "generate" in vars(cls)), None)
    if owner is not GenerationMixin:
        return True
    found = vars(GenerationMixin)["generate"]
    patched = getattr(found, "__qualname__", "") != "GenerationMixin.generate"
    return found is not _GENERATE or patched


def _forward_parameters(model) -> set[str]:
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return set(inspect.signature(base.forward).parameters)


def _takes_decode_arguments(model) -> bool:
    """A forward that takes what the loop passes (remote-code models may not)."""
    names = _forward_parameters(model)
    return {"attention_mask", "position_ids", "logits_to_keep", "use_cache"} <= names and bool(
        names & {"cache", "past_key_values"}
    )


BLOCK = 256  # entries per block of the two-level draw


def sample_from(probs: torch.Tensor, uniform: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row drawn from `probs` (rows of non-negative numbers, not all 0) with
    probability proportional to each entry, by inverse CDF in float64 and two levels: the block of
    256 entries whose cumulative sum first exceeds a uniform draw scaled to the row's total, then
    the entry inside it whose cumulative sum (from the block's start) first exceeds what is left of
    the draw. One cumulative sum over the whole vocabulary is a long sequential scan; blocks make it
    two short ones. Entries of probability 0
    are never drawn (what is left of the draw is clamped into the chosen block, whose total is > 0).
    `uniform`: the rows' uniform numbers (rows, 1; float64), else drawn here."""
    rows, vocab = probs.shape
    values = probs.double()
    padded = -(-vocab // BLOCK) * BLOCK
    if padded != vocab:
        values = F.pad(values, (0, padded - vocab))
    blocks = values.view(rows, padded // BLOCK, BLOCK)
    totals = blocks.sum(dim=-1)
    cumulative = totals.cumsum(dim=-1)
    if uniform is None:
        uniform = torch.rand(rows, 1, dtype=torch.float64, device=probs.device)
    draw = uniform * cumulative[:, -1:]
    block = torch.searchsorted(cumulative, draw, right=True).clamp_(max=totals.size(1) - 1)
    # a block of total 0 is never the first to exceed the draw, except by the clamp when rounding
    # put the draw at the row's total: then the last block with something in it
    last_nonzero = totals.size(1) - 1 - (totals > 0).flip(-1).int().argmax(dim=-1, keepdim=True)
    block = torch.where(totals.gather(1, block) > 0, block, last_nonzero)
    chosen = blocks[torch.arange(rows, device=probs.device), block[:, 0]]  # (rows, BLOCK)
    inside = chosen.cumsum(dim=-1)
    left = (draw - (cumulative.gather(1, block) - totals.gather(1, block))).clamp_(min=0.0)
    left = torch.minimum(left, inside[:, -1:])  # (rounding) the draw stays inside the block
    entry = torch.searchsorted(inside, left, right=True)
    # at the block's end by rounding: its last entry with something in it
    last_in_block = BLOCK - 1 - (chosen > 0).flip(-1).int().argmax(dim=-1, keepdim=True)
    entry = torch.where(entry < BLOCK, entry, last_in_block)
    return (block * BLOCK + entry).squeeze(1)


def policy_logps_of(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """(rows,) log softmax(logits / temperature)[token], computed as rloo.logps.per_token_logps
    does."""
    return selective_log_softmax((logits / temperature)[:, None], tokens[:, None])[:, 0]


class MinNewTokens(MinNewTokensLengthLogitsProcessor):
    """transformers' processor, the same scores (EOS at -inf until `min_new_tokens` new tokens, a
    copy either way) without its vocabulary-wide `isin` mask and `where` at every step: the EOS
    columns filled in the copy."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # (vocabulary size, device) -> its EOS columns (_columns)
        self._found: dict[tuple, torch.Tensor] = {}

    def holding(self, input_ids: torch.Tensor) -> bool:
        """Whether EOS is still at -inf after these tokens (fewer than min_new_tokens new ones)."""
        return input_ids.shape[-1] - self.prompt_length_to_skip < self.min_new_tokens

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if not self.holding(input_ids):
            return scores.clone()
        return scores.index_fill(-1, self._columns(scores), float("-inf"))

    def _columns(self, scores: torch.Tensor) -> torch.Tensor:
        """The EOS ids inside the vocabulary (isin over the vocabulary marks only these) on the
        scores' device, found on the host once per vocabulary size and device: a CUDA graph of the
        draw (Draws) replays the fill alone."""
        key = (scores.shape[-1], scores.device)
        if key not in self._found:
            vocabulary = scores.shape[-1]
            tokens = [t for t in self.eos_token_id.reshape(-1).tolist() if 0 <= t < vocabulary]
            self._found[key] = torch.tensor(tokens, dtype=torch.long, device=scores.device)
        return self._found[key]


# processors whose work has fixed shapes and no host synchronisation (of the sequences, their length
# at most)
GRAPHABLE = (
    MinNewTokens,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    MinPLogitsWarper,
)


class Draws:
    """The next token of each row from the logits, as the loop picks them: drawn (`drawn`) or,
    greedy, the processed scores' argmax. On a GPU, where every processor is one of GRAPHABLE,
    replayed as a CUDA graph (rloo.engine.cuda_graph), one per state of the processors
    (min_new_tokens banning EOS or not), captured at its first use in the call: the draw's ~40 small
    kernels are one launch; the random numbers are new at every replay (the CUDA generator's offset
    advances with each)."""

    def __init__(self, processors: LogitsProcessorList, sample: bool):
        self.processors, self.sample = processors, sample
        self.graphs: dict[tuple, Graphed] | None = (
            {} if all(isinstance(processor, GRAPHABLE) for processor in processors) else None
        )

    def drawn(self, sequences: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """One token per row from softmax(processors(sequences, logits)): where the processors are
        at most min_new_tokens (EOS at -inf) and the logits fp32 on the CPU, the C `draw` on the
        logits themselves (rloo.engine.kernel.draw: no processed copy, no probabilities, the
        weights' block totals in one pass), else softmax and sample_from; the
        same uniform numbers either way (one torch.rand per step), rows the C leaves (a NaN, nothing
        finite) through the torch path."""
        processors = self.processors
        on_cpu = logits.dtype == torch.float32 and logits.device.type == "cpu"
        library = kernel.for_decoding() if on_cpu else None
        if library is not None and all(
            isinstance(processor, MinNewTokens) for processor in processors
        ):
            banned = [
                int(token)
                for processor in processors
                if processor.holding(sequences)
                for token in processor.eos_token_id.reshape(-1).tolist()
            ]
            uniform = torch.rand(logits.size(0), 1, dtype=torch.float64)
            drawn = kernel.draw(library, logits, banned, uniform)
            if bool((drawn >= 0).all()):
                return drawn
            return sample_from(torch.softmax(processors(sequences, logits), dim=-1), uniform)
        return sample_from(
            torch.softmax(processors(sequences, logits.to(dtype=torch.float32)), dim=-1)
        )

    def eager(self, sequences: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        if self.sample:
            return self.drawn(sequences, logits)
        return self.processors(sequences, logits.to(dtype=torch.float32)).argmax(dim=-1)

    def __call__(self, sequences: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        if self.graphs is None or logits.device.type != "cuda":
            return self.eager(sequences, logits)
        state = tuple(
            processor.holding(sequences)
            for processor in self.processors
            if isinstance(processor, MinNewTokens)
        )
        # (the processors read the sequences' length alone: the state's at capture)
        if state not in self.graphs:
            self.graphs[state] = Graphed(functools.partial(self.eager, sequences))
        return self.graphs[state](logits)


class DecodeLoop:
    """The decode loop that stands in for `generate` (left-padded prompts in, each row's tokens out
    up to max_new_tokens, pad after a row's EOS), on the model's KV cache. `synced` (ZeRO-3
    without gathering: every forward is collective): every rank steps until all ranks are done, a
    rank whose rows are done feeding pad without drawing (so its random stream is the one it would
    have without the sync). The generation backend that uses it is rloo.generation.lean."""

    def __init__(self, synced: bool = False):
        self.synced = synced
        # (weights_key, LeanDecoder) inside reusing_weights, else None
        self._kept: tuple | None = None
        self._reusing = False

    @contextlib.contextmanager
    def reusing_weights(self):
        """Inside, a call takes the previous call's decoder (its packed weights: ~0.2 s for SmolLM2
        on 2 cores) where rloo.engine.decode.weights_key is unchanged (same model, rows, parameters
        and adapters), else packs anew, the previous copy freed first. Left, the copy goes: a
        training step never holds it through its backward."""
        self._reusing, self._kept = True, None
        try:
            yield
        finally:
            self._reusing, self._kept = False, None

    def _decoder(self, model, rows: int):
        """lean_decoder(model, rows), kept for the next call inside reusing_weights."""
        if not self._reusing:
            return lean_decoder(model, rows)
        key = weights_key(model, rows)
        if key is None or self._kept is None or self._kept[0] != key:
            self._kept = None  # (its packed copy freed before the next one is made)
            decoder = lean_decoder(model, rows)
            self._kept = None if key is None else (key, decoder)
            return decoder
        return self._kept[1]

    def _anyone_unfinished(self, unfinished: torch.Tensor) -> bool:
        if not self.synced:
            return bool(unfinished.any())
        import torch.distributed as dist

        flag = unfinished.any().to(torch.int32).reshape(1)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    @staticmethod
    def _processors(
        config: GenerationConfig,
        eos_ids: list[int],
        attention_mask: torch.Tensor,
        prompt_length: int,
        device,
    ) -> LogitsProcessorList:
        """generate's processors for these settings, in generate's order (transformers'
        _get_logits_processor)."""
        found = LogitsProcessorList()
        if config.repetition_penalty is not None and config.repetition_penalty != 1.0:
            # (transformers 4.x's generate penalises every token of the row, left padding included)
            padding = None if TRANSFORMERS_4 else (attention_mask != 0).int().argmax(dim=1)
            found.append(
                RepetitionPenaltyLogitsProcessor(
                    config.repetition_penalty, prompt_ignore_length=padding
                )
            )
        if config.min_new_tokens and eos_ids:
            found.append(
                MinNewTokens(
                    prompt_length,
                    config.min_new_tokens,
                    torch.tensor(eos_ids, device=device),
                    device=device,
                )
            )
        if config.do_sample:
            if config.temperature is not None and config.temperature != 1.0:
                found.append(TemperatureLogitsWarper(config.temperature))
            if config.top_k is not None and config.top_k != 0:
                found.append(TopKLogitsWarper(top_k=config.top_k, min_tokens_to_keep=1))
            if config.top_p is not None and config.top_p < 1.0:
                found.append(TopPLogitsWarper(top_p=config.top_p, min_tokens_to_keep=1))
            if config.min_p is not None:
                found.append(MinPLogitsWarper(min_p=config.min_p, min_tokens_to_keep=1))
        return found

    def completions(
        self,
        model,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        config: GenerationConfig,
        pad_token_id: int,
        eos_ids: list[int],
        temperature: float | None = None,
        progress=lambda: None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(each row's completion tokens, and with `temperature` the policy's log-probs of them at
        that temperature, else None); `progress()` after each token (the stall watchdog's)."""
        rows, prompt_length = input_ids.shape
        processors = self._processors(
            config, eos_ids, attention_mask, prompt_length, input_ids.device
        )
        eos = torch.tensor(eos_ids, device=input_ids.device)
        positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
        # MoE: no auxiliary loss while decoding (as generate)
        extra = (
            {"output_router_logits": False} if hasattr(model.config, "output_router_logits") else {}
        )
        # (ZeRO-3: the model's collective forward)
        decoder = None if self.synced else self._decoder(model, rows)
        logits = (
            None
            if decoder is None or extra
            else prompt_steps(decoder, input_ids, attention_mask, positions, config.max_new_tokens)
        )
        if logits is None:
            logits, arguments, prompt_rows = prefill(
                model, input_ids, attention_mask, positions, extra, keep_distinct=not self.synced
            )
            if decoder is not None:
                decoder.start(
                    arguments[cache_argument(model)],
                    attention_mask,
                    config.max_new_tokens,
                    prompt_rows,
                )
            elif prompt_rows is not None:  # (the model's own forward reads a cache row per row)
                share_cache_rows(arguments[cache_argument(model)], prompt_rows)
        draws = Draws(processors, config.do_sample)
        sequences, unfinished = (
            input_ids,
            torch.ones(rows, dtype=torch.bool, device=input_ids.device),
        )
        logps: list[torch.Tensor] = []
        for index in range(config.max_new_tokens):
            tokens = torch.full((rows,), pad_token_id, dtype=torch.long, device=input_ids.device)
            # only a synced rank that is done has nothing to draw (elsewhere some row is unfinished
            # here: the loop ends when none is; not asked there, as on a GPU asking waits for the
            # step)
            if not self.synced or unfinished.any():
                tokens = torch.where(unfinished, draws(sequences, logits), tokens)
            # as rloo.logps.per_token_logps: scaled in the model's dtype, then fp32
            if temperature is not None:
                logps.append(policy_logps_of(logits, tokens, temperature))
            sequences = torch.cat([sequences, tokens[:, None]], dim=1)
            unfinished &= ~torch.isin(tokens, eos)
            progress()  # a token decoded: progress for the stall watchdog
            if index == config.max_new_tokens - 1 or not self._anyone_unfinished(unfinished):
                break
            positions = positions[:, -1:] + 1
            if decoder is not None:
                logits = decoder.step(tokens, positions)
                continue
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(rows, 1)], dim=1)
            logits = model(
                input_ids=tokens[:, None],
                attention_mask=attention_mask,
                position_ids=positions,
                use_cache=True,
                **arguments,
            ).logits[:, -1]
        return sequences[:, prompt_length:], (torch.stack(logps, dim=1) if logps else None)
