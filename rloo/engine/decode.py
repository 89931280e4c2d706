"""One decode step of a Llama-family model (Llama, Mistral without a sliding window, Qwen2) written
out with the model's own weights, norms and rotary embedding: what the model's forward computes for
one new token per row, without its per-module dispatch, its mask building and a KV cache that grows
by concatenation.

The keys and values live in one preallocated buffer per layer (rows x key/value heads x total length
x head size), filled in place; where rows repeat a prompt and the attention is our C, the prompts'
keys and values stay once in the prefill's cache, which the rows of a prompt all read, and each
row's buffer holds only its new tokens (the prompts may instead go through the C step straight into
such buffers: rloo.engine.prompt_steps). Attention runs on the key/value heads with the query heads
grouped (as transformers' SDPA path does for one query token; in fp32 as matmuls). fp32 weights on
the CPU are packed for a small-batch GEMM (ours, rloo.engine.kernel, where the CPU has AVX-512 or
AVX2 with FMA; else oneDNN's, MKL's in a build without it) once per generation call (or per version
of the weights, `weights_key`), a layer's query/key/value and gate/up projections side by side in
one matmul each, LoRA layers (peft, one active adapter) merged into that copy (the model's own
tensors are not touched); other weights keep their own products, LoRA written out as peft computes
it. Where every part of the step is one our C does (its GEMM for every projection, Llama's RMSNorm,
head sizes its attention takes), the whole step is one call into it (kernel.Step). On a GPU the step
(torch's) is replayed as a CUDA graph (rloo.engine.cuda_graph), captured once per generation call
for each of a few attention lengths: there a small step's time goes to launching its kernels, one by
one. `lean_decoder` returns None for anything else (and under ZeRO-3 or autocast), and the decode
loop then calls the model's forward."""

from __future__ import annotations

import functools
from importlib import import_module
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from rloo.engine import kernel as kernel_module
from rloo.engine import packing
from rloo.engine.cuda_graph import Graphed
from rloo.engine.heap import own_mappings
from rloo.engine.registry import kind_of
from rloo.zero import is_partitioned

SUPPORTED = {"llama", "mistral", "qwen2"}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _aligned(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, or a copy of it, contiguous and 64-byte aligned (as the C attention reads it)."""
    tensor = tensor.contiguous()
    return tensor if tensor.data_ptr() % 64 == 0 else tensor.clone()


def _rms_parts(module: nn.Module) -> tuple[torch.Tensor, float] | None:
    """(weight, eps) of Llama's RMSNorm with an fp32 weight and its own forward; None for anything
    else."""
    weight = getattr(module, "weight", None)
    if (
        kind_of(module) != "norm"
        or "forward" in module.__dict__
        or weight is None
        or weight.dtype != torch.float32
    ):
        return None
    return weight.detach(), module.variance_epsilon


def _norm(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> module(x) for a layer's norm: Llama's RMSNorm on fp32 as torch.rms_norm (one fused call,
    the same operations on the same values: equal to the module's output), anything else the module
    itself."""
    parts = _rms_parts(module)
    if parts is None:
        return module
    (weight, eps), shape = parts, (parts[0].size(0),)
    return lambda x: (
        torch.rms_norm(x, shape, weight, eps) if x.dtype == torch.float32 else module(x)
    )


def _standard_rotate_half(module) -> bool:
    """Whether the model's module rotates as Llama's rotate_half does: x -> (-second half, first
    half)."""
    rotate_half = getattr(module, "rotate_half", None)
    probe = torch.arange(1.0, 5.0)
    return rotate_half is not None and torch.equal(
        rotate_half(probe), torch.tensor([-3.0, -4.0, 1.0, 2.0])
    )


def _autocast(model: nn.Module, base: nn.Module) -> bool:
    """Whether the model's forward runs under autocast: mixed precision (accelerate wraps the
    forward of the model it prepares and keeps the original as `_original_forward`) or an autocast
    context around the call."""
    if hasattr(model, "_original_forward") or hasattr(base, "_original_forward"):
        return True
    parameter = next(base.parameters(), None)
    return parameter is not None and torch.is_autocast_enabled(parameter.device.type)


def lean_decoder(model: nn.Module, rows: int) -> Any:
    """A LeanDecoder for this model where its architecture is one written out here, else None. Not
    under ZeRO-3: its hooks partition the weights again after each module's forward (the prompts'
    one included), so the step keeps the model's forward there. Not under autocast (bf16 / fp16
    mixed precision): the step computes in the weights' dtype, so the model's autocast forward
    decodes there, as it filled the prompts' cache."""

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    inner = getattr(base, "model", None)
    if (
        config is None
        or config.model_type not in SUPPORTED
        or getattr(config, "hidden_act", None) != "silu"
    ):
        return None
    if is_partitioned(base) or _autocast(model, base):
        return None
    sliding = (
        getattr(config, "use_sliding_window", False)
        if config.model_type == "qwen2"
        else getattr(config, "sliding_window", None)
    )
    if sliding or any(
        kind != "full_attention" for kind in getattr(config, "layer_types", None) or []
    ):
        return None
    layers = getattr(inner, "layers", None)
    if (
        layers is None
        or not hasattr(inner, "rotary_emb")
        or not hasattr(base, "lm_head")
        or not _standard_rotate_half(import_module(type(base).__module__))
    ):
        return None
    for layer in layers:
        attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if (
            attention is None
            or mlp is None
            or any(hasattr(attention, name) for name in ("q_norm", "k_norm"))
        ):
            return None
        if not all(hasattr(attention, name) for name in PROJECTIONS[:4]) or not all(
            hasattr(mlp, name) for name in PROJECTIONS[4:]
        ):
            return None
    return LeanDecoder(base, rows)


def weights_key(model: nn.Module, rows: int) -> tuple | None:
    """What a LeanDecoder built now for `rows` rows depends on: the model, every parameter's
    identity, storage and version counter (bumped by any in-place change: an optimizer step,
    load_state_dict), and each LoRA layer's adapter settings. None where parameters keep no version
    counter (inference tensors)."""
    try:
        parameters = tuple((id(p), p.data_ptr(), p._version) for p in model.parameters())
    except RuntimeError:
        return None
    adapters = tuple(
        (id(m), m.merged, m.disable_adapters, tuple(m.active_adapters), tuple(m.scaling.items()))
        for m in model.modules()
        if hasattr(m, "base_layer") and hasattr(m, "scaling")
    )
    return id(model), rows, parameters, adapters


class LeanDecoder:
    """Decode steps of one model on preallocated KV buffers: `start` takes a filled transformers
    cache (the prompts' forward), `step` one token per row and returns the next logits."""

    def __init__(self, model: nn.Module, rows: int):
        config = model.config
        self.model, self.inner, self.rows = model, model.model, rows
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        self.intermediate = config.intermediate_size
        self.layers = []
        # (LoRA's merged weights, one projection at a time: packing.merged_into)
        scratch: list[torch.Tensor] = []
        with own_mappings():  # (rloo.engine.heap)
            for layer in self.inner.layers:
                attention, mlp = layer.self_attn, layer.mlp
                side_by_side = functools.partial(packing.side_by_side, rows=rows, scratch=scratch)
                self.layers.append(
                    dict(
                        norm1=_norm(layer.input_layernorm),
                        norm2=_norm(layer.post_attention_layernorm),
                        scaling=attention.scaling,
                        qkv=side_by_side([attention.q_proj, attention.k_proj, attention.v_proj]),
                        o_proj=side_by_side([attention.o_proj]),
                        gate_up=side_by_side([mlp.gate_proj, mlp.up_proj]),
                        down_proj=side_by_side([mlp.down_proj]),
                    )
                )
            self.lm_head = packing.side_by_side([model.lm_head], rows, scratch)
            del scratch
        library = kernel_module.for_decoding()
        # the rotary embedding, key/value write and attention of a step in one call (fp32 on the
        # CPU), else torch's
        self.attend = (
            None
            if library is None
            else kernel_module.attention(library, self.heads, self.kv_heads, self.head_dim)
        )
        self.whole = self._whole_step(model)
        self.keys, self.values = [], []  # (each layer's buffers: begin)
        self.mask: torch.Tensor | None = None
        self.shared: list[kernel_module.Shared] | None = None
        # on a GPU: attention length -> the step's CUDA graph
        self.graphs: dict[int, Graphed] | None = None
        self.length = self.offset = 0

    def _whole_step(self, model: nn.Module) -> kernel_module.Step | None:
        """The whole step in one C call (kernel.Step) where every part of it is one the C does: all
        projections and the LM head packed by our GEMM, Llama's RMSNorm on fp32 weights, head sizes
        its attention takes; else None (the step below, module by module)."""
        linears = [
            layer[name]
            for layer in self.layers
            for name in ("qkv", "o_proj", "gate_up", "down_proj")
        ]
        linears.append(self.lm_head)
        if not all(isinstance(linear, kernel_module.PackedLinear) for linear in linears):
            return None
        library = linears[0].library
        norms = [
            _rms_parts(getattr(layer, name))
            for layer in self.inner.layers
            for name in ("input_layernorm", "post_attention_layernorm")
        ] + [_rms_parts(self.inner.norm)]
        if (
            any(norm is None for norm in norms)
            or kernel_module.attention(library, self.heads, self.kv_heads, self.head_dim) is None
        ):
            return None
        layers = [
            dict(layer, norm1=norms[2 * index], norm2=norms[2 * index + 1])
            for index, layer in enumerate(self.layers)
        ]
        return kernel_module.Step(
            library, layers, norms[-1], self.lm_head, self.heads, self.kv_heads, self.head_dim
        )

    def start(
        self,
        cache: Any,
        attention_mask: torch.Tensor,
        new_tokens: int,
        prompt_rows: torch.Tensor | None = None,
    ) -> None:
        """Take the prompts' keys and values from a transformers cache into buffers with room for
        `new_tokens`. `prompt_rows`: the cache holds each distinct prompt once, row r of the batch
        reads its row prompt_rows[r] (rloo.engine.prefill). Where the step's attention is ours
        (kernel.attention: fp32 on the CPU), the rows of a prompt then read its keys and values from
        that one copy, and each row's buffers hold only its new tokens; else the cache's rows are
        first copied to each row."""
        rows, prompt_length = attention_mask.shape
        first = cache.layers[0].keys
        shared = (
            prompt_rows is not None
            and self.attend is not None
            and first.dtype == torch.float32
            and first.device.type == "cpu"
        )
        if prompt_rows is not None and not shared:
            cache.batch_select_indices(prompt_rows)
        offset = prompt_length if shared else 0  # (the positions before each row's own buffers)
        # on a GPU the steps replay CUDA graphs (_graph_step), which attend over the buffers' first
        # positions in fixed lengths: zero at first; not with the rotary embeddings that read the
        # largest position on the host (dynamic, longrope)
        rope = str(getattr(self.inner.rotary_emb, "rope_type", "default"))
        graphed = first.device.type == "cuda" and "dynamic" not in rope and "longrope" not in rope
        self.graphs = {} if graphed else None
        keys, values, copies = [], [], None
        for layer in cache.layers:
            for source, target in ((layer.keys, keys), (layer.values, values)):
                make = source.new_zeros if graphed else source.new_empty
                buffer = make(
                    rows, self.kv_heads, prompt_length + new_tokens - offset, self.head_dim
                )
                if not shared:
                    buffer[:, :, :prompt_length] = source
                target.append(buffer)
        if shared:
            low, high = int(prompt_rows.min()), int(prompt_rows.max())
            if prompt_rows.numel() != rows or not 0 <= low <= high < first.size(0):
                raise ValueError(
                    f"LeanDecoder: prompt_rows must name one of the cache's {first.size(0)} rows "
                    f"for each of the {rows} rows, got {prompt_rows.tolist()}"
                )
            prompt = prompt_rows.to(torch.int32).contiguous()
            copies = [
                kernel_module.Shared(_aligned(layer.keys), _aligned(layer.values), prompt)
                for layer in cache.layers
            ]
        # added to the attention scores: 0 where a row attends, -inf at its padding and at positions
        # not yet written
        mask = keys[0].new_full((rows, 1, 1, prompt_length + new_tokens), float("-inf"))
        mask[:, 0, 0, :prompt_length].masked_fill_(attention_mask.bool(), 0.0)
        self.begin(keys, values, mask, prompt_length, offset, copies)

    def begin(
        self,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        mask: torch.Tensor,
        length: int,
        offset: int,
        shared: list[kernel_module.Shared] | None,
    ) -> None:
        """Decode on from buffers holding the prompts' keys and values (`start`,
        rloo.engine.prompt_steps): per layer rows x kv heads x positions after the `offset` first
        (`shared`'s) x head size; the scores' mask."""
        self.keys, self.values, self.mask = keys, values, mask
        self.length, self.offset = length, offset
        self.shared = shared
        if self.whole is not None:
            self.whole.start(keys, values, self.rows, shared)

    @staticmethod
    def _attention(
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor,
        scaling: float,
    ) -> torch.Tensor:
        """softmax(query keys^T * scaling + mask) values, SDPA's formula, for one query token per
        row: query (rows x key/value heads, query heads per key/value head, head size), keys and
        values (rows x key/value heads, positions, head size), mask (rows x key/value heads, 1,
        positions). In fp32 as two bmm and a softmax (for one query token the CPU flash kernel's
        set-up costs more than the work); in other dtypes SDPA itself (its fp32 accumulation)."""
        if query.dtype != torch.float32:
            return F.scaled_dot_product_attention(
                query, keys, values, attn_mask=mask, scale=scaling
            )
        scores = torch.bmm(query, keys.transpose(1, 2)).mul_(scaling).add_(mask)
        return torch.bmm(scores.softmax(dim=-1), values)

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens (rows,) at positions (rows, 1) -> logits (rows, vocab) of the next token."""
        rows, at = tokens.size(0), self.length
        if rows != self.rows:  # (the weights are packed for that many)
            raise ValueError(f"LeanDecoder was built for {self.rows} rows, got {rows}")
        self.length = at + 1
        if self.graphs is not None:
            length = self.graph_length(at)
            if length not in self.graphs:
                self.graphs[length] = Graphed(functools.partial(self._graph_step, length=length))
            return self.graphs[length](
                tokens, positions, torch.full((1,), at, dtype=torch.long, device=tokens.device)
            )
        self.mask[:, 0, 0, at] = 0.0
        return self._forward(tokens, positions, at, at + 1)

    # the shortest attention length a step's CUDA graph is captured for: a capture costs tens of
    # milliseconds, so a call with short sequences captures one graph, not one per length
    GRAPH_LENGTH = 1024

    def graph_length(self, at: int) -> int:
        """The attention length of the graph that steps at position `at`: the first power of two
        from GRAPH_LENGTH past it, at most the buffers' length (a graph per length: attention reads
        at most twice the positions written, and a call of n positions captures about log2(n /
        GRAPH_LENGTH) graphs)."""
        length = self.GRAPH_LENGTH
        while length <= at:
            length *= 2
        return min(length, self.keys[0].size(2))

    def _graph_step(
        self, tokens: torch.Tensor, positions: torch.Tensor, at: torch.Tensor, length: int
    ) -> torch.Tensor:
        """The step with its position a one-element tensor and attention over the buffers' first
        `length` positions (past `at` masked, and zero): the same kernels on the same shapes at
        every position up to `length`, as a CUDA graph replays them (rloo.engine.cuda_graph)."""
        self.mask.index_fill_(3, at, 0.0)
        return self._forward(tokens, positions, at, length)

    def _forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, at: int | torch.Tensor, length: int
    ) -> torch.Tensor:
        """The layers, the norm and the LM head for one token per row; its keys and values go to
        position `at` (an int, or a one-element tensor: _graph_step) and attention reads the first
        `length` positions."""
        rows = tokens.size(0)
        heads, kv_heads, head_dim = self.heads, self.kv_heads, self.head_dim
        # batched over rows x key/value heads: each key/value head with its group of query heads
        # (transformers' pack_gqa for one query token), the buffers seen as (rows x key/value heads,
        # positions, head size)
        batch, groups = rows * kv_heads, heads // kv_heads
        hidden = self.inner.embed_tokens(tokens[:, None])
        cos, sin = self.inner.rotary_emb(hidden, position_ids=positions)
        if (
            self.whole is not None
            and self.whole.table is not None
            and hidden.dtype == torch.float32
            and hidden.device.type == "cpu"
        ):
            return self.whole(hidden, cos, sin, self.mask, at - self.offset)
        mask = self.mask[..., :length].expand(rows, kv_heads, 1, length).reshape(batch, 1, length)
        # rotate_half(x) * sin == x.roll(half) * sin with its first half negated (the same products:
        # one sign moved)
        half = head_dim // 2
        signed_sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
        attend = (
            self.attend
            if self.attend is not None
            and hidden.dtype == torch.float32
            and hidden.device.type == "cpu"
            else None
        )
        if self.shared is not None and attend is None:
            raise RuntimeError(
                "LeanDecoder: the prompts' shared keys and values need the C attention"
            )
        for index, layer in enumerate(self.layers):
            projected = layer["qkv"](layer["norm1"](hidden)).view(
                rows, heads + 2 * kv_heads, head_dim
            )
            keys, values = self.keys[index], self.values[index]
            if attend is not None:
                attended = attend(
                    projected,
                    cos,
                    sin,
                    keys,
                    values,
                    self.mask,
                    at - self.offset,
                    layer["scaling"],
                    self.shared[index] if self.shared is not None else None,
                )
            else:
                # the rotary embedding of the queries and keys at once (apply_rotary_pos_emb's
                # formula, cos and sin broadcast over the heads)
                rotated = projected[:, : heads + kv_heads]
                rotated = rotated * cos + rotated.roll(half, -1) * signed_sin
                if isinstance(at, int):
                    keys[:, :, at] = rotated[:, heads:]
                    values[:, :, at] = projected[:, heads + kv_heads :]
                else:
                    keys.index_copy_(2, at, rotated[:, heads:, None])
                    values.index_copy_(2, at, projected[:, heads + kv_heads :, None])
                total = keys.size(2)
                attended = self._attention(
                    rotated[:, :heads].reshape(batch, groups, head_dim),
                    keys.view(batch, total, head_dim)[:, :length],
                    values.view(batch, total, head_dim)[:, :length],
                    mask,
                    layer["scaling"],
                )
            hidden = hidden + layer["o_proj"](attended.reshape(rows, 1, heads * head_dim))
            gate_up = layer["gate_up"](layer["norm2"](hidden))
            hidden = hidden + layer["down_proj"](
                F.silu(gate_up[..., : self.intermediate]) * gate_up[..., self.intermediate :]
            )
        return self.lm_head(self.inner.norm(hidden))[:, -1]
