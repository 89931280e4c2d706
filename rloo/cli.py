"""`rloo train --config recipe.yaml [--any_field value ...]`: TRL-style recipes on the command line.

A recipe is a flat YAML mapping. Its keys are the fields of `ScriptArguments` (model, data, reward
functions, LoRA) and of `RLOOConfig` (every training field); command-line flags override the recipe.
Works the same under `torchrun ... -m rloo train --config recipe.yaml` on many processes."""

from __future__ import annotations

import argparse
import ast
import difflib
import importlib
import os
import sys
from dataclasses import MISSING

import yaml
from transformers import HfArgumentParser

from rloo.adapters import lora_targets
from rloo.assets import resolve_model_alias
from rloo.callbacks import PreemptionCallback
from rloo.checkpoint import DiskFull, latest_checkpoint, resolve_resume, save_final
from rloo.config import RLOOConfig
from rloo.data import load_mixture, load_prompt_dataset, mixture_problems, with_prompt
from rloo.models import load_tokenizer, local_model_problem
from rloo.process import exit_without_native_teardown
from rloo.rewards import by_short_name
from rloo.rewards.runner import RewardFunctionError

# (re-exported: the recipe's fields and the unknown-field message are part of this command's API)
from rloo.script_args import (
    FIELD_NAMES,
    MIXTURE_KEYS,
    ScriptArguments,
    closest,  # noqa: F401 (re-exported)
    reward_entries,  # noqa: F401
    unknown_field,
)
from rloo.trainer import RLOOTrainer
from rloo.watchdog import STALLED_EXIT_CODE, TrainingStalled
from rloo.zero import DEEPSPEED_ON_CPU

PIPELINE_SECTIONS = (
    "name",
    "model",
    "data",
    "rewards",
    "training",
    "launch",
    "evaluation",
    "tracking",
    "promotion",
    "sweep",
)


def read_recipe(path: str) -> dict:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--config {path!r}: no such file.")
    with open(path) as handle:
        recipe = yaml.safe_load(handle) or {}
    if not isinstance(recipe, dict):
        raise ValueError(f"{path}: a recipe must be a YAML mapping of field: value.")
    if isinstance(recipe.get("training"), dict) and {"name", "model"} & set(recipe):
        raise ValueError(
            f"{path} is a pipeline config (sections "
            f"{', '.join(k for k in PIPELINE_SECTIONS if k in recipe)}), not an `rloo train` "
            f"recipe. Fix: run it with `rloo-pipeline run {path}`; `rloo train --config` takes a "
            "flat recipe of RLOOConfig/ScriptArguments fields (configs/train/)."
        )
    for key in recipe:
        if key not in FIELD_NAMES:
            raise ValueError(f"{path}: {unknown_field(key)}")
    return recipe


def recipe_default(name: str):
    """The default of a recipe field: defined once, by ScriptArguments or RLOOConfig."""
    for cls in (ScriptArguments, RLOOConfig):
        found = cls.__dataclass_fields__.get(name)
        if found is not None:
            if found.default_factory is not MISSING:
                return found.default_factory()
            return None if found.default is MISSING else found.default
    raise KeyError(f"{name!r} is not a recipe field")


def recipe_value(recipe: dict, name: str):
    """A field of a recipe as `rloo train` would see it: the recipe's value or the field's
    default."""
    return recipe[name] if name in recipe else recipe_default(name)


def _parser() -> HfArgumentParser:
    parser = HfArgumentParser((ScriptArguments, RLOOConfig), prog="rloo train")
    parser.add_argument(
        "--config", help="YAML recipe; any flag given on the command line overrides it."
    )
    # tuple[float, float] fields (reward_clip_range): two values on the command line
    for action in parser._actions:
        if getattr(action.type, "__origin__", None) is tuple:
            action.type, action.nargs = action.type.__args__[0], len(action.type.__args__)
    return parser


def check_recipe_combinations(values: dict, prefix: str = "") -> None:
    """What the dataclasses' fields cannot check alone: one weight per reward function, a LoRA rank
    with LoRA, a local model path that exists, QLoRA only with LoRA. `prefix` names where the recipe
    sits ('training.' in a pipeline config)."""
    weights, funcs = values.get("reward_weights"), reward_entries(values)
    if not funcs:
        raise ValueError(
            f"{prefix}reward_funcs (or {prefix}reward_model_name_or_path) is "
            "required: what scores the completions."
        )
    if weights is not None and len(weights) != len(funcs):
        raise ValueError(
            f"{prefix}reward_weights has {len(weights)} entries for {len(funcs)} rewards "
            f"({prefix}reward_model_name_or_path, then {prefix}reward_funcs); give one weight per "
            "reward."
        )
    if values.get("use_peft") and values.get("lora_r", 1) < 1:
        raise ValueError(f"{prefix}lora_r={values['lora_r']} must be >= 1 (the LoRA rank).")
    model = str(values.get("model_name_or_path") or "")
    if model.startswith(("/", "./", "../", "~")) and not os.path.exists(os.path.expanduser(model)):
        raise ValueError(
            f"{prefix}model_name_or_path={model!r}: no such folder. Fix: a local model folder, a "
            "Hub id (org/name) or an alias ('smollm2', 'tiny', 'tiny-vlm')."
        )
    if os.path.isdir(os.path.expanduser(model)):
        if problem := local_model_problem(os.path.expanduser(model)):
            raise ValueError(f"{prefix}model_name_or_path={model!r}: {problem}.")
    if values.get("load_in_4bit") and not values.get("use_peft"):
        raise ValueError(
            f"{prefix}load_in_4bit needs {prefix}use_peft: true (QLoRA trains an adapter on the "
            "4-bit base)."
        )
    if values.get("load_in_8bit") and not values.get("use_peft"):
        raise ValueError(
            f"{prefix}load_in_8bit needs {prefix}use_peft: true (an 8-bit base is "
            "frozen; only an adapter trains on it)."
        )
    if values.get("load_in_8bit") and values.get("load_in_4bit"):
        raise ValueError(f"{prefix}load_in_4bit and {prefix}load_in_8bit: choose one.")
    if values.get("lora_task_type", "CAUSAL_LM") != "CAUSAL_LM":
        raise ValueError(
            f"{prefix}lora_task_type={values['lora_task_type']!r}: the policy is a causal LM, so "
            "its adapter is CAUSAL_LM (SEQ_CLS is for training reward models). Fix: drop it."
        )


def parse_recipe(recipe: dict, argv: list[str] | None = None) -> tuple[ScriptArguments, RLOOConfig]:
    """A recipe mapping (plus command-line flags, which win) -> (ScriptArguments, RLOOConfig):
    the one validation of a recipe, used by `rloo train` and by the pipeline for its `training:`
    block."""
    for key in recipe:
        if key not in FIELD_NAMES:
            raise ValueError(unknown_field(key))

    mixture = {key: recipe[key] for key in MIXTURE_KEYS if key in recipe}
    recipe = {key: value for key, value in recipe.items() if key not in MIXTURE_KEYS}
    if mixture:
        if problems := mixture_problems(mixture):
            raise ValueError("the recipe's dataset mixture: " + " ".join(problems))
    parser = _parser()
    for action in parser._actions:
        if action.dest in recipe:
            action.required = False  # given by the recipe
    parser.set_defaults(**recipe)
    parser.exit_on_error = False
    try:
        outputs = parser.parse_args_into_dataclasses(
            args=list(argv or []), return_remaining_strings=True
        )
    except argparse.ArgumentError as err:  # a value of the wrong type, in the recipe or a flag
        name = (err.argument_name or "").split("/")[0].lstrip("-")
        from_recipe = name in recipe and f"--{name}" not in " ".join(argv or [])
        where = f"the recipe has {recipe[name]!r}" if from_recipe else "from the command line"
        raise ValueError(f"{name}: {err.message} ({where}).") from None
    # (a Namespace holds --config)
    script_args, config, remaining = outputs[0], outputs[1], outputs[-1]
    leftovers = [item for item in remaining if item.startswith("--")]
    if leftovers:
        name = leftovers[0][2:].split("=")[0]
        raise ValueError(unknown_field(name).replace(f"'{name}'", f"'--{name}'", 1))
    if remaining:
        raise ValueError(f"unexpected arguments: {remaining}")
    if mixture and script_args.dataset_name:
        raise ValueError(
            "dataset_name and a `datasets:` mixture are both given: keep one (TRL "
            "would ignore dataset_name)."
        )
    if not mixture and not script_args.dataset_name:
        raise ValueError(
            "dataset_name (or a `datasets:` mixture in the recipe) is required: what to train on."
        )
    script_args.mixture = mixture or None
    check_recipe_combinations(
        {
            "reward_weights": config.reward_weights,
            "reward_funcs": script_args.reward_funcs,
            "reward_model_name_or_path": script_args.reward_model_name_or_path,
            "load_in_4bit": script_args.load_in_4bit,
            "use_peft": script_args.use_peft,
            "load_in_8bit": script_args.load_in_8bit,
            "lora_task_type": script_args.lora_task_type,
        }
    )
    return script_args, config


def parse_arguments(argv: list[str]) -> tuple[ScriptArguments, RLOOConfig]:
    """`--config recipe.yaml` plus flags -> (ScriptArguments, RLOOConfig); flags win over the
    recipe."""
    recipe = {}
    given = [at for at, arg in enumerate(argv) if arg == "--config" or arg.startswith("--config=")]
    if len(given) > 1:
        raise ValueError(
            f"--config is given {len(given)} times: one recipe per run. Fix: keep one --config and "
            "override its fields with flags (e.g. --learning_rate 1e-6)."
        )
    if given:
        at = given[0]
        path = (
            argv[at].partition("=")[2]
            if argv[at].startswith("--config=")
            else (argv[at + 1] if at + 1 < len(argv) else "")
        )
        if not path:
            raise ValueError("--config needs a path to a YAML recipe.")
        recipe = read_recipe(path)
        argv = argv[:at] + argv[at + (1 if argv[at].startswith("--config=") else 2) :]
    return parse_recipe(recipe, argv)


def resolve_callable(path: str):
    """'package.module.name', 'package.module:name', or a factory call with literal arguments
    'package.module:factory(a=1, b="x")' -> the object; a clear error when it does not resolve."""
    call = None
    if path.endswith(")") and "(" in path:
        path, _, call = path[:-1].partition("(")
    module_name, _, attribute = path.rpartition(":") if ":" in path else path.rpartition(".")
    if not module_name:
        raise ValueError(
            f"reward function {path!r} must be an import path like 'my_module:my_reward'."
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(
            f"reward function {path!r}: module {module_name!r} cannot be imported ({err})."
        ) from None
    if not hasattr(module, attribute):
        names = [n for n in dir(module) if not n.startswith("_")]
        hint = difflib.get_close_matches(attribute, names, n=1)
        raise ValueError(
            f"reward function {path!r}: module {module_name!r} has no attribute {attribute!r}."
            + (f" Did you mean '{hint[0]}'?" if hint else "")
        )
    target = getattr(module, attribute)
    if call is None:
        return target
    try:
        node = ast.parse(f"f({call})", mode="eval").body
        args = [ast.literal_eval(a) for a in node.args]
        kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
    except (SyntaxError, ValueError) as err:
        raise ValueError(
            f"reward function {path}({call}): arguments must be Python literals ({err})."
        ) from None
    return target(*args, **kwargs)


def resolve_reward(entry: str):
    """A short name (`trl rloo`'s, or a built-in of ours) or an import path resolves to a callable;
    anything that names a model directory or looks like a Hub id ('org/name' without a module) is a
    reward model."""

    if (short := by_short_name(entry)) is not None:
        return short
    if os.path.isdir(os.path.expanduser(entry)):
        if problem := local_model_problem(os.path.expanduser(entry), reward_model=True):
            raise ValueError(f"reward function {entry!r}: {problem}.")
        return entry
    try:
        return resolve_callable(entry)
    except ValueError:
        if entry.count("/") == 1 and ":" not in entry and "(" not in entry:
            return entry  # a Hub reward-model id
        raise


def build_peft_config(script_args: ScriptArguments):
    """(LoraConfig, BitsAndBytesConfig) from the recipe's LoRA and quantisation flags, as TRL's
    get_peft_config and get_quantization_config build them; (None, None) without use_peft."""
    # (load_in_4bit/8bit without use_peft is refused by check_recipe_combinations)
    if not script_args.use_peft:
        return None, None
    from peft import LoraConfig

    extra = (
        {}
        if script_args.lora_target_parameters is None
        else {"target_parameters": script_args.lora_target_parameters}
    )
    peft_config = LoraConfig(
        r=script_args.lora_r,
        lora_alpha=script_args.lora_alpha,
        lora_dropout=script_args.lora_dropout,
        task_type="CAUSAL_LM",
        target_modules=lora_targets(script_args.lora_target_modules),
        use_rslora=script_args.use_rslora,
        use_dora=script_args.use_dora,
        modules_to_save=script_args.lora_modules_to_save,
        **extra,
    )
    quantization = None
    if script_args.load_in_4bit or script_args.load_in_8bit:
        import torch
        from transformers import BitsAndBytesConfig

        if script_args.load_in_8bit:
            quantization = BitsAndBytesConfig(load_in_8bit=True)
        else:
            quantization = BitsAndBytesConfig(
                load_in_4bit=True,
                bnb_4bit_quant_type=script_args.bnb_4bit_quant_type,
                bnb_4bit_compute_dtype=torch.bfloat16,
                bnb_4bit_use_double_quant=script_args.use_bnb_nested_quant,
                bnb_4bit_quant_storage=script_args.bnb_4bit_quant_storage,
            )
    return peft_config, quantization


def model_init_kwargs(script_args: ScriptArguments, config: RLOOConfig) -> dict | None:
    """RLOOConfig.model_init_kwargs with the recipe's model flags (dtype, model_revision,
    attn_implementation) in it; a flag that disagrees with model_init_kwargs is an error."""
    found = dict(config.model_init_kwargs or {})
    for flag, key in (
        ("dtype", "dtype"),
        ("model_revision", "revision"),
        ("attn_implementation", "attn_implementation"),
    ):
        value = getattr(script_args, flag)
        if value is None:
            continue
        if found.get(key, value) != value:
            raise ValueError(
                f"--{flag} {value} and model_init_kwargs' {key} {found[key]!r} disagree."
            )
        found[key] = value
    return found or config.model_init_kwargs


def build_trainer(argv: list[str]):
    """Everything that can be checked before training: arguments, reward imports, data, model,
    PEFT."""

    script_args, config = parse_arguments(argv)

    # a bad path: now, not later
    resolve_resume(config.resume_from_checkpoint, config.output_dir, missing_ok=True)
    model_path, alias_tokenizer = resolve_model_alias(script_args.model_name_or_path)
    tokenizer_source = script_args.tokenizer_name_or_path or alias_tokenizer
    reward_funcs = [resolve_reward(entry) for entry in reward_entries(script_args)]
    peft_config, quantization = build_peft_config(script_args)
    config.model_init_kwargs = model_init_kwargs(script_args, config)
    eval_dataset = None
    if script_args.mixture:
        found = load_mixture(script_args.mixture)
        train_dataset, eval_dataset = found["train"], found.get("test")
    else:
        train_dataset = load_prompt_dataset(
            script_args.dataset_name,
            script_args.dataset_config,
            script_args.dataset_train_split,
            streaming=script_args.dataset_streaming,
        )
    if script_args.dataset_test_split and not script_args.mixture:
        eval_dataset = load_prompt_dataset(
            script_args.dataset_name,
            script_args.dataset_config,
            script_args.dataset_test_split,
            streaming=script_args.dataset_streaming,
        )
    if script_args.dataset_prompt_column or script_args.system_prompt:
        train_dataset, eval_dataset = (
            with_prompt(d, script_args.dataset_prompt_column, script_args.system_prompt)
            if d is not None
            else None
            for d in (train_dataset, eval_dataset)
        )
    processing_class = None
    if tokenizer_source:
        processing_class = load_tokenizer(tokenizer_source, config.trust_remote_code)

    callbacks = [resolve_callable(path)() for path in script_args.callbacks or []] + [
        PreemptionCallback()
    ]
    trainer = RLOOTrainer(
        model=model_path,
        reward_funcs=reward_funcs,
        args=config,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=processing_class,
        callbacks=callbacks,
        peft_config=peft_config,
        quantization_config=quantization,
    )
    return trainer, script_args


def _announce_on_rank_zero() -> None:
    """The trainer's start lines (which fast paths it took) on rank 0's stderr, once."""
    import logging

    if os.environ.get("RANK", "0") != "0":
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log = logging.getLogger("rloo.trainer")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def train(argv: list[str]) -> int:
    _announce_on_rank_zero()
    try:
        trainer, script_args = build_trainer(argv)
    except (ValueError, TypeError, FileNotFoundError, ImportError, RuntimeError) as err:
        print(f"rloo train: error: {err}", file=sys.stderr)
        return 2
    try:
        code = _run(trainer, script_args)
    finally:  # an exception still propagates (its traceback printed) after this
        import torch.distributed as dist

        trainer.generator.close()  # an in-process vLLM engine goes before the process group it uses
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()

    if DEEPSPEED_ON_CPU["started"]:
        exit_without_native_teardown(code)
    return code


def _run(trainer, script_args) -> int:
    config = trainer.args

    # 'latest' with nothing saved yet starts from scratch: a requeued job that was preempted before
    # its first save.
    resume = resolve_resume(config.resume_from_checkpoint, config.output_dir, missing_ok=True)
    try:
        trainer.train(resume_from_checkpoint=resume)
        preemption = next(
            c
            for c in trainer.callback_handler.callbacks
            if type(c).__name__ == "PreemptionCallback"
        )
        # else not the final model: the requeued job resumes from the checkpoint
        if preemption.stopped_at is None:
            save_final(trainer, config.output_dir)
    # the run stops at this step; what is saved stays resumable
    except (RewardFunctionError, DiskFull, TrainingStalled) as err:
        last = latest_checkpoint(config.output_dir, quiet=True)
        in_step = isinstance(err, RewardFunctionError)
        step = f" in step {trainer.state.global_step + 1}" if in_step else ""
        print(
            f"rloo train: error{step}: {err}\n"
            + (
                f"  {last} is complete: fix the cause and run the same command with "
                "--resume_from_checkpoint latest."
                if last
                else "  No checkpoint was saved yet: fixing the cause and rerunning starts from "
                "the beginning."
            ),
            file=sys.stderr,
        )
        return STALLED_EXIT_CODE if isinstance(err, TrainingStalled) else 1
    if preemption.stopped_at is not None:
        print(
            "rloo train: pre-termination signal; checkpoint saved at step "
            f"{preemption.stopped_at}, stopping."
        )
        return 0
    if config.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    return 0


USAGE = """usage: rloo train --config recipe.yaml [--field value ...]

Commands:
  train    train a policy with RLOO from a recipe (`rloo train --help` lists every field)
"""


def entry() -> None:
    """The `rloo` command and `python -m rloo`: main(), then an exit that skips the native
    teardown."""
    exit_without_native_teardown(main())


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command != "train":
        print(f"rloo: unknown command {command!r}.\n{USAGE}", file=sys.stderr)
        return 2
    return train(rest)
