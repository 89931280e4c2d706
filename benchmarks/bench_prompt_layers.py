"""Peak memory of the loss's forward + backward with shared prompts, with and without each prompt layer's backward run
within its completions' layer (`rloo.engine.prompt_layers`), on SmolLM2-135M (full fine-tune, fp32, the trainer's
recomputed activations and tied embedding). Each (mode, repeat) runs in its own child process, the two modes
alternating, so that peak RSS is the child's own; prints medians and their ratio:

    .venv/bin/python benchmarks/bench_prompt_layers.py --prompt-tokens 512 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time


def child(
    layered: bool, prompt_tokens: int, completion_tokens: int, prompts: int, rows_per_prompt: int
) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from rloo.assets import smollm2_path
    from rloo.engine import heap, prompt_layers, tied
    from rloo.engine.recompute import recomputed_activations
    from rloo.logps import per_token_logps

    heap.keep_freed_memory()  # as the trainer does
    if not layered:
        prompt_layers.PromptLayers.applies = staticmethod(lambda decoder: False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path(), dtype=torch.float32)
    model.train()
    vocabulary = model.config.vocab_size
    rows = torch.arange(prompts).repeat_interleave(rows_per_prompt)
    input_ids = torch.cat(
        [
            torch.randint(3, vocabulary, (prompts, prompt_tokens))[rows],
            torch.randint(3, vocabulary, (rows.numel(), completion_tokens)),
        ],
        dim=1,
    )
    seconds = []
    for _ in range(3):  # the first is warm-up
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        with recomputed_activations(model), tied.tied_rows(model):
            out = per_token_logps(
                model,
                input_ids,
                torch.ones_like(input_ids),
                completion_tokens,
                1.0,
                share_prompts=True,
            )
        out.logps.sum().backward()
        seconds.append(time.perf_counter() - start)
    return {
        "peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "seconds": statistics.median(seconds[1:]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--completion-tokens", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--rows-per-prompt", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", choices=["on", "off"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = (args.prompt_tokens, args.completion_tokens, args.prompts, args.rows_per_prompt)
    if args.child:
        print(json.dumps(child(args.child == "on", *shape)))
        return
    results: dict[str, list[dict]] = {"off": [], "on": []}
    for repeat in range(args.repeats):
        for mode in ("off", "on"):
            command = [
                sys.executable,
                __file__,
                "--child",
                mode,
                "--prompt-tokens",
                str(args.prompt_tokens),
                "--completion-tokens",
                str(args.completion_tokens),
                "--prompts",
                str(args.prompts),
                "--rows-per-prompt",
                str(args.rows_per_prompt),
            ]
            output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            found = json.loads(output.splitlines()[-1])
            results[mode].append(found)
            print(
                f"repeat {repeat + 1}/{args.repeats} {mode:3s}: peak {found['peak_gib']:.3f} GiB, "
                f"forward + backward {found['seconds']:.2f} s",
                flush=True,
            )
    peak = {
        mode: statistics.median(r["peak_gib"] for r in found) for mode, found in results.items()
    }
    seconds = {
        mode: statistics.median(r["seconds"] for r in found) for mode, found in results.items()
    }
    print(
        f"{args.prompts} prompts x {args.rows_per_prompt} rows, {args.prompt_tokens} prompt + "
        f"{args.completion_tokens} completion tokens, medians of {args.repeats}:"
    )
    print(
        f"  prompts' backward after the completions': peak {peak['off']:.3f} GiB, {seconds['off']:.2f} s"
    )
    print(
        f"  each prompt layer's with its completions': peak {peak['on']:.3f} GiB, {seconds['on']:.2f} s"
    )
    print(
        f"  ratio: peak {peak['on'] / peak['off']:.2f}x, time {seconds['on'] / seconds['off']:.2f}x"
    )


if __name__ == "__main__":
    main()
