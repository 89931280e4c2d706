"""One decode step of a Llama-family model (Llama, Mistral without a sliding window, Qwen2) written out with the
model's own weights, norms and rotary embedding: what the model's forward computes for one new token per row,
without its per-module dispatch, its mask building and a KV cache that grows by concatenation.

The keys and values live in one preallocated buffer per layer (rows x key/value heads x total length x head size),
filled in place; attention runs on the key/value heads with the query heads grouped (as transformers' SDPA path does
for one query token). fp32 weights are packed for MKL's small-batch GEMM once per generation call. LoRA layers (peft,
one active adapter) add their product as peft does. `lean_decoder` returns None for anything else (and under
ZeRO-3), and the decode loop then calls the model's forward."""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

SUPPORTED = {"llama", "mistral", "qwen2"}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _packed_linear(weight: torch.Tensor, bias: torch.Tensor | None, rows: int
                   ) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> F.linear(x, weight, bias) for inputs of `rows` rows. fp32 weights on the CPU are first packed for MKL's
    GEMM at that many rows (cblas_sgemm_pack): measured at 8 rows on 2 cores, SmolLM2's 210 layer matmuls 28 -> 22.5
    ms, its LM head 6.7 -> 2.9 ms, for a copy of the weights made once per generation call (~0.13 s)."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or not torch.backends.mkl.is_available():
        return lambda x: F.linear(x, weight, bias)
    packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), rows)  # (weight: the fallback for other rows)
    return lambda x: torch.ops.mkl._mkl_linear(x, packed, weight, bias, rows)


def _linear(module: nn.Module, rows: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> module(x): the weights through _packed_linear for a plain Linear; base + B(A(x)) * scaling for a peft
    LoRA layer with one active adapter (the order of peft's own forward); the module itself for anything else."""
    if type(module) is nn.Linear:
        return _packed_linear(module.weight, module.bias, rows)
    base = getattr(module, "base_layer", None)
    active = getattr(module, "active_adapters", None)
    if type(base) is nn.Linear and active is not None and len(active) == 1 and not module.merged \
            and not module.disable_adapters:
        name = active[0]
        variant = getattr(module, "lora_variant", {}).get(name)
        if name in module.lora_A and variant is None and not module.use_dora.get(name, False):
            base_linear = _packed_linear(base.weight, base.bias, rows)
            a, b, scaling = module.lora_A[name].weight, module.lora_B[name].weight, module.scaling[name]
            return lambda x: base_linear(x) + F.linear(F.linear(x, a), b) * scaling
    return module


def lean_decoder(model: nn.Module, rows: int) -> Any:
    """A LeanDecoder for this model where its architecture is one written out here, else None. Not under ZeRO-3:
    its hooks partition the weights again after each module's forward (the prompts' one included), so the step
    keeps the model's forward there."""
    from rloo.zero import is_partitioned
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    inner = getattr(base, "model", None)
    if config is None or config.model_type not in SUPPORTED or getattr(config, "hidden_act", None) != "silu":
        return None
    if is_partitioned(base):
        return None
    sliding = getattr(config, "use_sliding_window", False) if config.model_type == "qwen2" else \
        getattr(config, "sliding_window", None)
    if sliding or any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or []):
        return None
    layers = getattr(inner, "layers", None)
    if layers is None or not hasattr(inner, "rotary_emb") or not hasattr(base, "lm_head"):
        return None
    for layer in layers:
        attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attention is None or mlp is None or any(hasattr(attention, name) for name in ("q_norm", "k_norm")):
            return None
        if not all(hasattr(attention, name) for name in PROJECTIONS[:4]) or \
                not all(hasattr(mlp, name) for name in PROJECTIONS[4:]):
            return None
    return LeanDecoder(base, rows)


M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


@contextlib.contextmanager
def _own_mappings():
    """Allocations of 1 MiB or more inside get their own memory mappings (glibc), so that freeing the packed weights
    gives their memory back to the system instead of leaving it in the heap, where the training step's allocations
    do not fit it again (measured, benchmarks/bench_vs_trl.py on 2 cores: peak RSS of the SmolLM2 steps 2.56 -> 2.47
    GiB with LoRA, 4.19 -> 3.85 GiB full, same step time). Afterwards the threshold is 32 MiB, the value glibc's own
    adjustment climbs to for a trainer's tensors anyway (measured: same RSS and step time). No-op without glibc."""
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        yield
        return
    libc.mallopt(M_MMAP_THRESHOLD, 1 << 20)
    try:
        yield
    finally:
        libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)


class LeanDecoder:
    """Decode steps of one model on preallocated KV buffers: `start` takes a filled transformers cache (the prompts'
    forward), `step` one token per row and returns the next logits."""

    def __init__(self, model: nn.Module, rows: int):
        from importlib import import_module
        config = model.config
        self.model, self.inner, self.rows = model, model.model, rows
        self.apply_rotary = import_module(type(model).__module__).apply_rotary_pos_emb
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.layers = []
        with _own_mappings():
            for layer in self.inner.layers:
                attention, mlp = layer.self_attn, layer.mlp
                self.layers.append(dict(
                    norm1=layer.input_layernorm, norm2=layer.post_attention_layernorm, scaling=attention.scaling,
                    **{name: _linear(getattr(attention, name), rows) for name in PROJECTIONS[:4]},
                    **{name: _linear(getattr(mlp, name), rows) for name in PROJECTIONS[4:]}))
            self.lm_head = _linear(model.lm_head, rows)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.mask: torch.Tensor | None = None
        self.length = 0

    def start(self, cache: Any, attention_mask: torch.Tensor, new_tokens: int) -> None:
        """Take the prompts' keys and values from a transformers cache into buffers with room for `new_tokens`."""
        rows, prompt_length = attention_mask.shape
        total = prompt_length + new_tokens
        self.keys, self.values = [], []
        for layer in cache.layers:
            for source, target in ((layer.keys, self.keys), (layer.values, self.values)):
                buffer = source.new_empty(rows, self.kv_heads, total, self.head_dim)
                buffer[:, :, :prompt_length] = source
                target.append(buffer)
        self.mask = torch.zeros(rows, 1, 1, total, dtype=torch.bool, device=attention_mask.device)
        self.mask[:, 0, 0, :prompt_length] = attention_mask.bool()
        self.length = prompt_length

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens (rows,) at positions (rows, 1) -> logits (rows, vocab) of the next token."""
        rows, at = tokens.size(0), self.length
        if rows != self.rows:  # (the weights are packed for that many)
            raise ValueError(f"LeanDecoder was built for {self.rows} rows, got {rows}")
        self.mask[:, 0, 0, at] = True
        mask = self.mask[..., : at + 1]
        hidden = self.inner.embed_tokens(tokens[:, None])
        cos, sin = self.inner.rotary_emb(hidden, position_ids=positions)
        groups = self.heads // self.kv_heads
        for index, layer in enumerate(self.layers):
            normed = layer["norm1"](hidden)
            query = layer["q_proj"](normed).view(rows, 1, self.heads, self.head_dim).transpose(1, 2)
            key = layer["k_proj"](normed).view(rows, 1, self.kv_heads, self.head_dim).transpose(1, 2)
            value = layer["v_proj"](normed).view(rows, 1, self.kv_heads, self.head_dim).transpose(1, 2)
            query, key = self.apply_rotary(query, key, cos, sin)
            self.keys[index][:, :, at] = key[:, :, 0]
            self.values[index][:, :, at] = value[:, :, 0]
            # one query token: the query heads of a key/value head side by side (transformers' pack_gqa)
            attended = F.scaled_dot_product_attention(
                query.reshape(rows, self.kv_heads, groups, self.head_dim), self.keys[index][:, :, : at + 1],
                self.values[index][:, :, : at + 1], attn_mask=mask, scale=layer["scaling"])
            hidden = hidden + layer["o_proj"](attended.reshape(rows, 1, self.heads * self.head_dim))
            normed = layer["norm2"](hidden)
            hidden = hidden + layer["down_proj"](F.silu(layer["gate_proj"](normed)) * layer["up_proj"](normed))
        self.length = at + 1
        return self.lm_head(self.inner.norm(hidden))[:, -1]
