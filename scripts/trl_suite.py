"""Runs TRL's own RLOO test file offline, against TRL and against rloo, and lists the tests that
pass on TRL but not here.

TRL's tests/test_rloo_trainer.py (from a TRL checkout) is copied twice beside its
`testing_utils.py` and `conftest.py`: once as it is, once with `from trl import RLOOConfig,
RLOOTrainer` changed to `from rloo import ...`, the switch a TRL user makes (and the conftest's
fixture that sets `use_cpu=True` on a machine without a GPU applied to rloo's config class). The Hub models it names
are replaced by tiny random stand-ins of the same architectures, written into a Hugging Face cache
folder that the runs read with HF_HUB_OFFLINE=1 (the text models share a byte-level Qwen2 tokenizer
whose special tokens have Qwen2.5's ids, which one test hard-codes); its datasets (`trl-internal-testing/
zen`, `zen-image`, `zen-multi-image`) are answered by this module loaded as a pytest plugin, built
from the Zen of Python. A model without a stand-in fails on both sides alike. TRL is installed from
the same checkout (the library its tests were written for) into a folder of its own, without
dependencies (the project's environment has them); the project never imports it.

    python scripts/trl_suite.py /path/to/trl                 # rloo, then TRL on what failed
    python scripts/trl_suite.py /path/to/trl -k "peft"       # a selection (pytest's -k)

Exit status 1 when a test passes on TRL and fails on rloo.
"""

from __future__ import annotations

import argparse
import codecs
import hashlib
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ElementTree

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ORG = "trl-internal-testing"
# Qwen2.5's special tokens keep their ids (test_train_with_mask_truncated_completions writes 151643
# and 151645 into completions); every text stand-in has Qwen2.5's vocabulary size.
SPECIALS = {
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<|finetune_right_pad_id|>": 151646,
}
VOCAB_SIZE = 151936
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def zen_lines() -> list[str]:
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the Zen
        import this
    text = codecs.decode(this.s, "rot13")
    return [line for line in text.splitlines()[2:] if line.strip()]


def zen_rows(kind: str) -> list:
    """19 prompts, as TRL's zen dataset has: the first half of each aphorism, or a user message
    asking for it."""
    rows = []
    for line in zen_lines():
        words = line.split()
        prefix = " ".join(words[: max(1, len(words) // 2)])
        if kind == "standard":
            rows.append(prefix)
        else:
            rows.append([{"role": "user", "content": f"What comes after: {prefix}?"}])
    return rows


def tokenizer():
    """Qwen2.5's tokenizer class over bytes alone (no merges): a prompt is one token per byte, the
    special tokens keep Qwen's ids."""
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {char: i for i, char in enumerate(bytes_to_unicode().values())}
    vocab.update(SPECIALS)
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        unk_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=1024,
    )


def _text_models() -> dict:
    """Repository name -> a function making the model (random weights)."""
    import transformers as tf

    def small(config_class, hidden=8, **extra):
        return config_class(
            vocab_size=VOCAB_SIZE,
            hidden_size=hidden,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            pad_token_id=SPECIALS["<|endoftext|>"],
            eos_token_id=SPECIALS["<|im_end|>"],
            bos_token_id=None,
            **extra,
        )

    qwen3 = dict(head_dim=4)
    moe = dict(head_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    oss = dict(head_dim=4, num_local_experts=4, num_experts_per_tok=2, sliding_window=16)
    return {
        "tiny-Qwen2ForCausalLM-2.5": lambda: tf.Qwen2ForCausalLM(
            small(tf.Qwen2Config, tie_word_embeddings=True)
        ),
        "tiny-Qwen2ForSequenceClassification-2.5": lambda: tf.Qwen2ForSequenceClassification(
            small(tf.Qwen2Config, hidden=16, num_labels=1)
        ),
        "tiny-Qwen3ForCausalLM": lambda: tf.Qwen3ForCausalLM(small(tf.Qwen3Config, **qwen3)),
        "tiny-Qwen3ForSequenceClassification": lambda: tf.Qwen3ForSequenceClassification(
            small(tf.Qwen3Config, hidden=16, num_labels=1, **qwen3)
        ),
        "tiny-LlamaForSequenceClassification-3.2": lambda: tf.LlamaForSequenceClassification(
            small(tf.LlamaConfig, hidden=16, num_labels=1)
        ),
        "tiny-Qwen3MoeForCausalLM": lambda: tf.Qwen3MoeForCausalLM(
            small(tf.Qwen3MoeConfig, output_router_logits=True, **moe)
        ),
        "tiny-GptOssForCausalLM": lambda: tf.GptOssForCausalLM(
            small(tf.GptOssConfig, hidden=16, output_router_logits=True, **oss)
        ),
        "tiny-Cohere2ForCausalLM": lambda: tf.Cohere2ForCausalLM(
            small(tf.Cohere2Config, sliding_window=16)
        ),
        # GLM-4 MoE: a dense first layer, then routed experts beside a shared one
        "tiny-Glm4MoeForCausalLM": lambda: tf.Glm4MoeForCausalLM(
            small(
                tf.Glm4MoeConfig,
                hidden=16,
                n_routed_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=16,
                first_k_dense_replace=1,
                output_router_logits=True,
            )
        ),
        # Nemotron 3 nano's layer kinds: Mamba-2, MoE, attention, MLP (no CUDA kernels on the CPU)
        "tiny-NemotronHForCausalLM-nano": lambda: tf.NemotronHForCausalLM(
            tf.NemotronHConfig(
                vocab_size=VOCAB_SIZE,
                hidden_size=16,
                layers_block_type=["linear_attention", "moe", "full_attention", "mlp"],
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=4,
                intermediate_size=32,
                use_mamba_kernels=False,
                ssm_state_size=8,
                mamba_num_heads=4,
                mamba_head_dim=8,
                n_groups=2,
                chunk_size=8,
                n_routed_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=16,
                moe_shared_expert_intermediate_size=16,
                pad_token_id=SPECIALS["<|endoftext|>"],
                eos_token_id=SPECIALS["<|im_end|>"],
                bos_token_id=None,
            )
        ),
    }


def _vlm_models() -> dict:
    """Repository name -> (model, processor) maker, from the test suite's tiny VLM families."""
    sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
    from tiny_vlms import FAMILIES

    return {
        "tiny-Qwen2VLForConditionalGeneration": FAMILIES["qwen2_vl"],
        "tiny-Qwen2_5_VLForConditionalGeneration": FAMILIES["qwen2_5_vl"],
        "tiny-Gemma3ForConditionalGeneration": FAMILIES["gemma3"],
        "tiny-LlavaNextForConditionalGeneration": FAMILIES["llava_next"],
        "tiny-SmolVLMForConditionalGeneration": FAMILIES["idefics3"],
        "tiny-Gemma4ForConditionalGeneration": FAMILIES["gemma4"],
        "tiny-Qwen3_5ForConditionalGeneration-NoThink": FAMILIES["qwen3_5"],
        "tiny-Qwen3_5MoeForConditionalGeneration-3.6": FAMILIES["qwen3_5_moe"],
    }


def _as_the_hubs(name: str, model) -> None:
    """The settings of the Hub's tiny model that TRL's tests count on, where the test suite's
    family differs: LLaVA-NeXT's features from the vision tower's second-to-last layer (the last
    layer gets no gradient, which the test asserts), Gemma3's SigLIP without its pooling head
    (unused, so it would get no gradient either)."""
    if "LlavaNext" in name:
        model.config.vision_feature_layer = -2
    if "Gemma3" in name:
        tower = model.model.vision_tower
        tower = getattr(tower, "vision_model", tower)  # (transformers 4 wraps it once more)
        tower.use_head = False
        del tower.head
        model.config.vision_config.vision_use_head = False


def _cache_repo(hub: str, name: str, save) -> None:
    """A model repository as the Hub client caches it: snapshots/<sha>/ and refs/main."""
    folder = os.path.join(hub, f"models--{ORG}--{name}")
    sha = hashlib.sha1(name.encode()).hexdigest()
    snapshot = os.path.join(folder, "snapshots", sha)
    os.makedirs(snapshot)
    save(snapshot)
    os.makedirs(os.path.join(folder, "refs"))
    with open(os.path.join(folder, "refs", "main"), "w") as handle:
        handle.write(sha)


def build_models(hub: str) -> None:
    import torch
    from transformers.utils import logging

    logging.disable_progress_bar()

    sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
    from tiny_models import save_remote_code_model

    text_tokenizer = tokenizer()
    for name, make in _text_models().items():
        torch.manual_seed(0)
        model = make()
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.eos_token_id = SPECIALS["<|im_end|>"]
            model.generation_config.pad_token_id = SPECIALS["<|endoftext|>"]

        def save(path, model=model):
            model.save_pretrained(path)
            text_tokenizer.save_pretrained(path)

        _cache_repo(hub, name, save)
    for name, make in _vlm_models().items():
        model, processor = make(0)
        _as_the_hubs(name, model)

        def save(path, model=model, processor=processor):
            model.save_pretrained(path)
            processor.save_pretrained(path)

        _cache_repo(hub, name, save)

    def save_remote(path):  # the remote-code model and the tokenizer its vocabulary is sized for
        from rloo.tiny import tiny_tokenizer

        own = tiny_tokenizer()
        save_remote_code_model(path, own)
        own.save_pretrained(path)

    _cache_repo(hub, "tiny-RemoteForCausalLM", save_remote)


# --- the pytest plugin: TRL's testing datasets, offline ---------------------------------------


def _image(seed: int):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    height, width = rng.integers(32, 64, size=2)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def zen_dataset(repo: str, config: str):
    """The DatasetDict (train: 17 rows, test: 2) a TRL testing repository holds for `config`."""
    from datasets import Dataset

    if config not in ("standard_prompt_only", "conversational_prompt_only") or (
        repo != "zen" and config != "conversational_prompt_only"
    ):
        raise ValueError(f"no stand-in for {ORG}/{repo}, config {config!r}")
    prompts = zen_rows(config.split("_")[0])
    columns = {"prompt": prompts}
    if repo == "zen-image":
        columns["image"] = [_image(i) for i in range(len(prompts))]
    elif repo == "zen-multi-image":
        counts = [1 + i % 3 for i in range(len(prompts))]
        columns["prompt"] = [
            [
                {
                    "role": "user",
                    "content": [{"type": "image"}] * n
                    + [{"type": "text", "text": m[0]["content"]}],
                }
            ]
            for m, n in zip(prompts, counts)
        ]
        columns["images"] = [[_image(100 * i + j) for j in range(n)] for i, n in enumerate(counts)]
    elif repo != "zen":
        raise ValueError(f"no stand-in for {ORG}/{repo}")
    return Dataset.from_dict(columns).train_test_split(test_size=0.1, shuffle=False)


def _install_dataset_standins() -> None:
    import datasets

    original = datasets.load_dataset

    def load_dataset(path, name=None, *args, split=None, streaming=False, **kwargs):
        if not (isinstance(path, str) and path.startswith(f"{ORG}/")):
            return original(path, name, *args, split=split, streaming=streaming, **kwargs)
        splits = zen_dataset(path.split("/", 1)[1], name)
        if streaming:
            splits = datasets.IterableDatasetDict(
                {key: value.to_iterable_dataset() for key, value in splits.items()}
            )
        return splits if split is None else splits[split]

    datasets.load_dataset = load_dataset


if os.environ.get("TRL_SUITE_PLUGIN") == "1":
    _install_dataset_standins()


# --- the runs and their comparison ------------------------------------------------------------


def _copy_tests(trl_checkout: str, side_dir: str, against: str) -> None:
    tests = os.path.join(side_dir, "tests")
    os.makedirs(tests)
    open(os.path.join(tests, "__init__.py"), "w").close()
    shutil.copy(os.path.join(trl_checkout, "tests", "testing_utils.py"), tests)
    # The test file's one import, and the conftest's CPU fixture (it sets use_cpu=True on TRL's
    # config class, which TRL's bf16 default needs on a machine without a GPU) on rloo's class.
    for name, line, ours in (
        (
            "test_rloo_trainer.py",
            "from trl import RLOOConfig, RLOOTrainer",
            "from rloo import RLOOConfig, RLOOTrainer",
        ),
        (
            "conftest.py",
            "from trl.trainer.base_config import _BaseConfig",
            "from rloo import RLOOConfig as _BaseConfig",
        ),
    ):
        text = open(os.path.join(trl_checkout, "tests", name)).read()
        if line not in text:
            raise SystemExit(
                f"TRL's tests/{name} no longer has the line {line!r}: update {__file__}"
            )
        with open(os.path.join(tests, name), "w") as handle:
            handle.write(text.replace(line, ours) if against == "rloo" else text)


def outcomes(junit: str) -> dict[str, tuple[str, str]]:
    """Test id -> (passed | failed | skipped, first line of the reason)."""
    result = {}
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        owner = case.get("classname", "").rsplit(".", 1)[-1]  # a class, or the module itself
        name = case.get("name") if owner == "test_rloo_trainer" else f"{owner}::{case.get('name')}"
        outcome, why = "passed", ""
        for tag in ("failure", "error", "skipped"):
            element = case.find(tag)
            if element is not None:
                outcome = "skipped" if tag == "skipped" else "failed"
                why = (element.get("message") or "").strip().splitlines()[:1]
                why = why[0][:150] if why else ""
                break
        result[name] = (outcome, why)
    return result


def run_side(
    work: str, trl_checkout: str, against: str, extra: list[str], tests: list[str] | None = None
) -> dict:
    """Runs the test file (or the named test ids) against one library; test id -> outcome."""
    side_dir = os.path.join(work, against)
    _copy_tests(trl_checkout, side_dir, against)
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_CACHE=os.path.join(work, "hub"),
        TRL_SUITE_PLUGIN="1",
        PYTHONPATH=os.pathsep.join([HERE, os.path.join(work, "trl-package"), ROOT]),
    )
    junit = os.path.join(work, f"{against}.xml")
    selected = [f"tests/test_rloo_trainer.py::{test}" for test in tests or []]
    command = [sys.executable, "-m", "pytest", *(selected or ["tests/test_rloo_trainer.py"])]
    command += ["-p", "trl_suite"]
    command += ["-q", "-o", "addopts=", "-p", "no:cacheprovider", f"--junitxml={junit}"]
    log = os.path.join(work, f"{against}.log")
    print(
        f"[trl-suite] TRL's RLOO tests against {against} (pytest's output: {log}) ...", flush=True
    )
    with open(log, "w") as handle:
        subprocess.run(
            command + ["-rfE"] + extra, cwd=side_dir, env=env, stdout=handle, stderr=handle
        )
    return outcomes(junit)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trl_checkout", help="a clone of github.com/huggingface/trl")
    parser.add_argument("--work", default=None, help="a folder for the runs (default: a new one)")
    parser.add_argument("-k", default=None, help="pytest's -k selection")
    parser.add_argument("-n", default="2", help="pytest-xdist workers per run")
    options = parser.parse_args()
    import tempfile

    work = options.work or tempfile.mkdtemp(prefix="trl-suite-")
    if os.path.exists(work) and os.listdir(work):
        raise SystemExit(f"--work {work} is not empty; name a new folder")
    os.makedirs(work, exist_ok=True)
    package = os.path.join(work, "trl-package")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", package]
        + [options.trl_checkout],
        check=True,
    )
    version = open(os.path.join(options.trl_checkout, "VERSION")).read().strip()
    print("[trl-suite] building the stand-in models ...", flush=True)
    build_models(os.path.join(work, "hub"))
    extra = ["-n", options.n] if options.n != "0" else []
    extra += ["-k", options.k] if options.k else []
    # rloo first: a test that passes here cannot be a regression, so TRL runs only the rest (each
    # side takes about an hour on two cores; the comparison is the same).
    ours = run_side(work, options.trl_checkout, "rloo", extra)
    rest = sorted(name for name, (outcome, _) in ours.items() if outcome != "passed")
    theirs = run_side(work, options.trl_checkout, "trl", extra, rest) if rest else {}
    regressions = []
    for name, (outcome, why) in sorted(theirs.items()):
        mine, my_why = ours.get(name, ("missing", ""))
        if outcome == "passed" and mine != "passed":
            regressions.append(f"  {name}: {mine} here: {my_why}")
    passed = sum(outcome == "passed" for outcome, _ in ours.values())
    print(
        f"[trl-suite] {len(ours)} tests: {passed} pass on rloo; of the other {len(rest)}, "
        f"{len(regressions)} pass on TRL {version} (junit files in {work})"
    )
    for line in regressions:
        print(line)
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main())
