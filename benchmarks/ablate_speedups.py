"""Which speed-up bought what: this trainer's step time on one bench_vs_trl case with the speed-ups of 2026-12-02
switched on one after another (shared prompts; the decode step written out; packed weights; the KL's pi_old from the
loss's forward; projections side by side with LoRA merged and the two-level draw; freed memory kept in the heap; the
decode step's packed GEMM oneDNN's and its attention as matmuls),
each stage in its own child process, in one run. A stage switches the later ones off by replacing their entry
points (before "side by side": each projection its own packed matmul, LoRA written out, the q/k/v and gate/up
outputs concatenated for the step, one cumulative sum over the vocabulary per draw; before "heap kept": glibc trims
the heap's free top as by default, allocations of 32 MiB or more in their own mappings; before "oneDNN":
MKL's packed GEMM for every shape, the attention through SDPA):

    .venv/bin/python benchmarks/ablate_speedups.py --cases smollm2-full-32,smollm2-lora-32
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
STAGES = (
    "before",
    "shared prompts",
    "decode step",
    "packed weights",
    "KL from loss",
    "side by side",
    "heap kept",
    "oneDNN",
)


def _one_projection_each(modules, rows, scratch=None):
    """rloo.engine.packing.side_by_side as before the "side by side" stage: a matmul per projection."""
    import torch
    import torch.nn.functional as F

    import rloo.engine.packing as packing

    def one(module):
        if type(module) is torch.nn.Linear:
            return (
                packing.packed_linear(module.weight, module.bias, rows)
                if packing.packable(module.weight)
                else module
            )
        parts = packing.lora_parts(module)
        if parts is None:
            return module
        base, a, b, scaling = parts
        base_linear = (
            packing.packed_linear(base.weight, base.bias, rows)
            if packing.packable(base.weight)
            else base
        )
        return lambda x: base_linear(x) + F.linear(F.linear(x, a), b) * scaling

    linears = [one(module) for module in modules]
    return (
        linears[0]
        if len(linears) == 1
        else lambda x: torch.cat([linear(x) for linear in linears], dim=-1)
    )


def _one_cumulative_sum(probs):
    """rloo.engine.lean.sample_from as before the "side by side" stage."""
    import torch

    cumulative = probs.double().cumsum(dim=-1)
    draw = (
        torch.rand(probs.size(0), 1, dtype=torch.float64, device=probs.device) * cumulative[:, -1:]
    )
    return (
        torch.searchsorted(cumulative, draw, right=True).clamp_(max=probs.size(-1) - 1).squeeze(1)
    )


def child(stage: str, case: str) -> dict:
    import functools

    import torch
    import torch.nn.functional as F

    import bench_vs_trl
    import rloo.engine as engine
    import rloo.engine.decode as decode
    import rloo.engine.lean as lean
    import rloo.engine.packing as packing
    import rloo.engine.prefill as prefill
    import rloo.engine.shared_prompts as shared_prompts
    import rloo.trainer as trainer

    level = STAGES.index(stage)
    if level < 1:
        # (the engine's face, which rloo.logps calls, and the module's own, which
        # kl_forwards_share_prompts calls)
        engine.can_share_prompts = shared_prompts.can_share_prompts = lambda model: False
        prefill.distinct_prompts = lambda *args: None
    if level < 2:
        lean.lean_decoder = lambda *args: None
    if level < 3:
        packing.packed_linear = lambda weight, bias, rows: functools.partial(
            F.linear, weight=torch.cat(weight) if isinstance(weight, list) else weight, bias=bias
        )
    if level < 4:  # (the trainer takes pi_old from the loss only where no dropout is drawn)
        trainer.dropout_active = lambda model: True
    if level < 5:
        packing.side_by_side = _one_projection_each
        lean.sample_from = _one_cumulative_sum
    if level < 6:
        import rloo.engine.heap as heap

        heap.keep_freed_memory = lambda: (
            heap.libc() is not None
            and heap.libc().mallopt(heap.M_MMAP_THRESHOLD, heap.MMAP_THRESHOLD)
        )
    if level < 7 and "mkl" in packing.kernels():
        packing.kernels = lambda: {"mkl": packing.mkl_linear}
        decode.LeanDecoder._attention = staticmethod(
            lambda q, k, v, mask, scaling: F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scaling
            )
        )
    return bench_vs_trl.child("rloo", bench_vs_trl.cases()[case])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", nargs=2, metavar=("STAGE", "CASE"))
    parser.add_argument("--cases", default="smollm2-full-32,smollm2-lora-32")
    options = parser.parse_args()
    if options.child:
        print("RESULT " + json.dumps(child(*options.child)), flush=True)
        return 0
    for case in options.cases.split(","):
        for stage in STAGES:
            out = subprocess.run(
                [sys.executable, __file__, "--child", stage, case],
                capture_output=True,
                text=True,
                env=dict(os.environ, TOKENIZERS_PARALLELISM="false"),
            )
            lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
            if out.returncode != 0 or not lines:
                print(out.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"{case}/{stage} failed")
            result = json.loads(lines[-1][len("RESULT ") :])
            parts = ", ".join(
                f"{name} {value:.2f}"
                for name, value in result["breakdown"].items()
                if value > 0.005
            )
            print(
                f"{case:18} {stage:15} {result['step_s']:6.2f} s/step, peak RSS {result['peak_rss_gib']:.2f} GiB "
                f"({parts})",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
