"""`rloo train --config recipe.yaml [--field value]`: parsing, overrides, clear errors, a real run (also under
torchrun on two processes), and the TRL docs' two scripts as recipes."""

import json
import os
import subprocess
import sys

import pytest
import yaml

from rloo import RLOOConfig
from rloo.cli import main, parse_arguments, resolve_callable, resolve_reward
from rloo.rewards import accuracy_reward
from services import free_port
from tiny_models import save_tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def tiny_recipe(tmp_path, model, tokenizer):
    model_dir, tokenizer_dir = save_tiny(str(tmp_path / "tiny"), model, tokenizer)
    data = tmp_path / "prompts.jsonl"
    with open(data, "w") as handle:
        for i, words in enumerate(["the dog", "a big cat", "one two", "what is"] * 3):
            handle.write(
                json.dumps({"prompt": [{"role": "user", "content": words}], "tag": i}) + "\n"
            )
    recipe = {
        "model_name_or_path": model_dir,
        "tokenizer_name_or_path": tokenizer_dir,
        "dataset_name": str(data),
        "reward_funcs": ["cli_rewards:length_reward"],
        "output_dir": str(tmp_path / "out"),
        "use_cpu": True,
        "bf16": False,
        "max_steps": 2,
        "per_device_train_batch_size": 4,
        "num_generations": 2,
        "max_completion_length": 6,
        "learning_rate": 0.05,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "beta": 0.0,
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_recipe_and_flag_overrides(tiny_recipe):
    script, config = parse_arguments(
        [
            "--config",
            str(tiny_recipe),
            "--learning_rate",
            "0.01",
            "--num_generations",
            "4",
            "--reward_funcs",
            "a:b",
            "c:d",
        ]
    )
    assert isinstance(config, RLOOConfig)
    assert config.learning_rate == 0.01 and config.num_generations == 4  # flags win
    assert (
        config.max_steps == 2 and config.use_cpu and script.dataset_name.endswith("prompts.jsonl")
    )  # recipe
    assert script.reward_funcs == ["a:b", "c:d"]


def test_every_config_field_settable_from_the_command_line(tmp_path):
    _, config = parse_arguments(
        [
            "--model_name_or_path",
            "m",
            "--dataset_name",
            "d.jsonl",
            "--reward_funcs",
            "x:y",
            "--output_dir",
            str(tmp_path),
            "--bf16",
            "false",
            "--beta",
            "0.2",
            "--reward_clip_range",
            "-1",
            "1",
            "--model_init_kwargs",
            '{"dtype": "bfloat16"}',
            "--log_completions",
            "--vllm_mode",
            "server",
        ]
    )
    assert config.beta == 0.2 and config.reward_clip_range == (-1.0, 1.0) and config.log_completions
    assert config.model_init_kwargs == {"dtype": "bfloat16"} and config.vllm_mode == "server"


def test_unknown_field_in_recipe_suggests_the_closest(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model_name_or_path: m\nnum_generation: 4\n")
    with pytest.raises(
        ValueError, match="unknown field 'num_generation'. Did you mean 'num_generations'"
    ):
        parse_arguments(["--config", str(path)])


def test_unknown_flag_suggests_the_closest(tiny_recipe):
    with pytest.raises(
        ValueError, match="unknown field '--learnign_rate'. Did you mean 'learning_rate'"
    ):
        parse_arguments(["--config", str(tiny_recipe), "--learnign_rate", "0.1"])


@pytest.mark.parametrize(
    "name, replacement",
    [("cliprange", "use epsilon"), ("exp_name", "use run_name"), ("rloo_k", "use num_generations")],
)
def test_old_names_in_a_recipe_or_a_flag_name_their_replacement(
    tmp_path, tiny_recipe, name, replacement
):
    """Not a look-alike field (cliprange -> reward_clip_range, exp_name -> label_names)."""
    recipe = tmp_path / "old.yaml"
    recipe.write_text(tiny_recipe.read_text() + f"{name}: 1\n")
    with pytest.raises(
        ValueError, match=f"unknown field '{name}'. It is a TRL <= 0.21 parameter; {replacement}"
    ):
        parse_arguments(["--config", str(recipe)])
    with pytest.raises(
        ValueError, match=f"'--{name}'. It is a TRL <= 0.21 parameter; {replacement}"
    ):
        parse_arguments(["--config", str(tiny_recipe), f"--{name}", "1"])


def test_unknown_config_keyword_in_python():
    with pytest.raises(
        TypeError, match="unknown field 'num_generation'. Did you mean 'num_generations'"
    ):
        RLOOConfig(num_generation=4)


def test_reward_import_paths():
    assert resolve_callable("rloo.rewards.accuracy_reward") is accuracy_reward
    assert resolve_callable("rloo.rewards:accuracy_reward") is accuracy_reward
    punish = resolve_callable(
        "rloo.rewards:get_soft_overlong_punishment(max_completion_len=10, soft_punish_cache=4)"
    )
    assert punish([[1] * 8]) == [-0.5]
    with pytest.raises(ValueError, match="module 'no_such_module' cannot be imported"):
        resolve_callable("no_such_module:reward")
    with pytest.raises(
        ValueError, match="has no attribute 'acuracy_reward'. Did you mean 'accuracy_reward'"
    ):
        resolve_reward("rloo.rewards:acuracy_reward")
    assert resolve_reward("my-org/reward-model") == "my-org/reward-model"  # a Hub reward-model id


def test_trl_rloo_short_reward_names_and_a_reward_model_flag(tmp_path):
    from rloo.rewards import (
        number_only_format_reward,
        reasoning_accuracy_reward,
        think_format_reward,
    )

    assert (
        resolve_reward("accuracy_reward") is accuracy_reward
    )  # as `trl rloo --reward_funcs` names them
    assert resolve_reward("reasoning_accuracy_reward") is reasoning_accuracy_reward
    assert resolve_reward("think_format_reward") is think_format_reward
    assert resolve_reward("number_only_format_reward") is number_only_format_reward
    punish = resolve_reward(
        "get_soft_overlong_punishment"
    )  # TRL's script: 1280 tokens, a 256-token ramp
    assert punish([[1] * 1024, [1] * 1152, [1] * 1300]) == [0.0, -0.5, -1.0]
    script, _ = parse_arguments(
        [
            "--model_name_or_path",
            "m",
            "--dataset_name",
            "d.jsonl",
            "--output_dir",
            str(tmp_path),
            "--bf16",
            "false",
            "--reward_model_name_or_path",
            "org/reward-model",
            "--reward_funcs",
            "think_format_reward",
        ]
    )
    from rloo.cli import reward_entries

    assert reward_entries(script) == [
        "org/reward-model",
        "think_format_reward",
    ]  # the model first, as TRL
    with pytest.raises(ValueError, match="reward_weights has 1 entries for 2 rewards"):
        parse_arguments(
            [
                "--model_name_or_path",
                "m",
                "--dataset_name",
                "d.jsonl",
                "--output_dir",
                str(tmp_path),
                "--bf16",
                "false",
                "--reward_model_name_or_path",
                "org/rm",
                "--reward_funcs",
                "accuracy_reward",
                "--reward_weights",
                "1.0",
            ]
        )
    with pytest.raises(
        ValueError, match="reward_funcs \\(or reward_model_name_or_path\\) is required"
    ):
        parse_arguments(
            [
                "--model_name_or_path",
                "m",
                "--dataset_name",
                "d.jsonl",
                "--output_dir",
                str(tmp_path),
                "--bf16",
                "false",
            ]
        )


def test_cli_trains_with_a_reward_model_flag_and_short_names(
    tiny_recipe, tmp_path, tokenizer, monkeypatch, capsys
):
    """A `trl rloo`-style recipe: the reward model by --reward_model_name_or_path, the rest by short name."""
    from tiny_models import tiny_reward_model

    reward_dir = str(tmp_path / "rm")
    tiny_reward_model(tokenizer).save_pretrained(reward_dir)
    tokenizer.save_pretrained(reward_dir)
    monkeypatch.syspath_prepend(TESTS)
    assert (
        main(
            [
                "train",
                "--config",
                str(tiny_recipe),
                "--reward_model_name_or_path",
                reward_dir,
                "--reward_funcs",
                "think_format_reward",
                "number_only_format_reward",
            ]
        )
        == 0
    )
    logged = capsys.readouterr().out
    for key in (
        "rewards/rm/mean",
        "rewards/think_format_reward/mean",
        "rewards/number_only_format_reward/mean",
    ):
        assert f"'{key}'" in logged, key


def test_trl_model_flags_reach_the_adapter_the_quantisation_and_the_model(tmp_path):
    from rloo.cli import build_peft_config, model_init_kwargs

    base = [
        "--model_name_or_path",
        "m",
        "--dataset_name",
        "d.jsonl",
        "--output_dir",
        str(tmp_path),
        "--bf16",
        "false",
        "--reward_funcs",
        "think_format_reward",
    ]
    script, config = parse_arguments(
        base
        + [
            "--use_peft",
            "--lora_r",
            "4",
            "--use_rslora",
            "--use_dora",
            "--lora_modules_to_save",
            "embed_tokens",
            "--lora_target_parameters",
            "mlp.experts.gate_up_proj",
            "--model_revision",
            "v1.0",
            "--attn_implementation",
            "eager",
            "--dtype",
            "float32",
            "--load_in_4bit",
            "--bnb_4bit_quant_type",
            "fp4",
            "--use_bnb_nested_quant",
            "--bnb_4bit_quant_storage",
            "bfloat16",
        ]
    )
    peft_config, quantization = build_peft_config(script)
    assert (
        peft_config.target_modules is None
    )  # PEFT's default for the architecture, as TRL leaves it
    assert peft_config.use_rslora and peft_config.use_dora and peft_config.r == 4
    assert peft_config.modules_to_save == ["embed_tokens"]
    assert peft_config.target_parameters == ["mlp.experts.gate_up_proj"]
    assert quantization.load_in_4bit and quantization.bnb_4bit_quant_type == "fp4"
    assert (
        quantization.bnb_4bit_use_double_quant
        and str(quantization.bnb_4bit_quant_storage) == "torch.bfloat16"
    )
    assert model_init_kwargs(script, config) == {
        "dtype": "float32",
        "revision": "v1.0",
        "attn_implementation": "eager",
    }
    script, _ = parse_arguments(
        base + ["--use_peft", "--load_in_8bit", "--lora_target_modules", "all-linear"]
    )
    peft_config, quantization = build_peft_config(script)
    assert quantization.load_in_8bit and peft_config.target_modules == "all-linear"
    for flags, message in (
        (["--load_in_8bit"], "load_in_8bit needs use_peft"),
        (["--use_peft", "--load_in_8bit", "--load_in_4bit"], "choose one"),
        (["--use_peft", "--lora_task_type", "SEQ_CLS"], "SEQ_CLS is for training reward"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_arguments(base + flags)
    with pytest.raises(
        ValueError, match="attn_implementation eager and model_init_kwargs' attn_implementation"
    ):
        model_init_kwargs(
            *parse_arguments(
                base
                + [
                    "--attn_implementation",
                    "eager",
                    "--model_init_kwargs",
                    '{"attn_implementation": "sdpa"}',
                ]
            )
        )


def test_use_peft_without_targets_adapts_what_peft_chooses(tmp_path, model, tokenizer):
    """TRL leaves LoRA's targets to PEFT (q_proj and v_proj for Llama); the pipeline's model check says which, and
    refuses an architecture PEFT has no default for."""
    from peft import get_peft_model

    from infra.model_checks import check_lora_targets
    from rloo.cli import build_peft_config

    script, _ = parse_arguments(
        [
            "--model_name_or_path",
            "m",
            "--dataset_name",
            "d.jsonl",
            "--output_dir",
            str(tmp_path),
            "--bf16",
            "false",
            "--reward_funcs",
            "think_format_reward",
            "--use_peft",
        ]
    )
    adapted = get_peft_model(model, build_peft_config(script)[0])
    names = {
        name.split(".lora_A")[0].split(".")[-1]
        for name, _ in adapted.named_parameters()
        if "lora_A" in name
    }
    assert names == {"q_proj", "v_proj"}
    model.save_pretrained(str(tmp_path / "tiny"))
    assert check_lora_targets(str(tmp_path / "tiny"), None, False)[1] == ["q_proj", "v_proj"]
    from tiny_vlms import save_vlm, tiny_qwen2_vl

    with pytest.raises(
        ValueError, match="no default LoRA targets for model type 'qwen2_vl'.*all-linear"
    ):
        check_lora_targets(save_vlm(str(tmp_path / "vlm"), *tiny_qwen2_vl()), None, False)


def test_a_trl_dataset_mixture_is_built_as_trl_builds_it(tmp_path, tiny_recipe, monkeypatch):
    from rloo.data import load_mixture

    for name, count in (("a", 10), ("b", 4)):
        with open(tmp_path / f"{name}.jsonl", "w") as handle:
            for i in range(count):
                handle.write(
                    json.dumps({"prompt": [{"role": "user", "content": f"{name} {i}"}], "tag": i})
                    + "\n"
                )
    mixture = {
        "datasets": [
            {"path": str(tmp_path / "a.jsonl"), "fraction": 1.0, "columns": ["prompt"]},
            {
                "path": "json",
                "data_files": str(tmp_path / "b.jsonl"),
                "fraction": 1.0,
                "columns": ["prompt"],
            },
        ],
        "test_split_size": 2,
    }
    # equal shares, capped so that no set repeats rows: min(10 / .5, 4 / .5) = 8 rows, the first 4 of each
    found = load_mixture(mixture)
    texts = sorted(row["prompt"][0]["content"] for split in found.values() for row in split)
    assert texts == sorted([f"a {i}" for i in range(4)] + [f"b {i}" for i in range(4)])
    assert (len(found["train"]), len(found["test"])) == (6, 2)
    recipe = yaml.safe_load(tiny_recipe.read_text())
    del recipe["dataset_name"]
    recipe.update(
        datasets=[{"path": str(tmp_path / "a.jsonl")}, {"path": str(tmp_path / "b.jsonl")}]
    )
    tiny_recipe.write_text(yaml.safe_dump(recipe))
    monkeypatch.syspath_prepend(TESTS)
    assert (
        main(["train", "--config", str(tiny_recipe)]) == 0
    )  # 14 prompts, trains as `trl rloo` would
    for change, message in (
        (
            {"datasets": [{"path": "x.jsonl", "fraction": 1.0}, {"path": "y.jsonl"}]},
            "set it on every entry or on none",
        ),
        ({"datasets": [{"path": "x.jsonl", "splitt": "train"}]}, r"datasets\[0\].splitt"),
        ({"dataset_name": "x.jsonl"}, "keep one"),
    ):
        tiny_recipe.write_text(yaml.safe_dump({**recipe, **change}))
        with pytest.raises(ValueError, match=message):
            parse_arguments(["--config", str(tiny_recipe)])


def test_cli_reports_bad_reward_path_before_loading_anything(tiny_recipe, capsys):
    code = main(["train", "--config", str(tiny_recipe), "--reward_funcs", "cli_rewards:nope"])
    assert code == 2
    assert "cli_rewards:nope" in capsys.readouterr().err
    assert not os.path.exists(os.path.dirname(tiny_recipe) + "/out")


def test_cli_trains_from_a_recipe(tiny_recipe, monkeypatch):
    monkeypatch.syspath_prepend(TESTS)
    assert main(["train", "--config", str(tiny_recipe)]) == 0
    out = os.path.join(os.path.dirname(tiny_recipe), "out")
    assert os.path.exists(os.path.join(out, "model.safetensors"))


@pytest.mark.slow
def test_cli_under_torchrun_two_processes(tiny_recipe):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([TESTS, ROOT]))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            "-m",
            "rloo",
            "train",
            "--config",
            str(tiny_recipe),
            "--per_device_train_batch_size",
            "3",
            "--num_generations",
            "6",
            "--ddp_backend",
            "gloo",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    out = os.path.join(os.path.dirname(tiny_recipe), "out")
    assert os.path.exists(os.path.join(out, "model.safetensors"))
    assert result.stdout.count("'reward':") == 2  # rank 0 logs each of the 2 steps once


@pytest.mark.parametrize(
    "recipe, overrides, reward",
    [
        ("deepmath_quickstart.yaml", ["--bf16", "false", "--use_cpu", "true"], "accuracy_reward"),
        (
            "visual_math_qwen25vl.yaml",
            ["--bf16", "false", "--use_cpu", "true", "--deepspeed", ""],
            "think_format_reward",
        ),
        (
            "tldr_multinode.yaml",
            ["--bf16", "false", "--use_cpu", "true", "--deepspeed", ""],
            "unique_chars_reward",
        ),
    ],
)
def test_spec_scripts_exist_as_recipes(recipe, overrides, reward, tmp_path):
    # bf16 needs a GPU and the ZeRO-3 file needs deepspeed (multi-node issue): overridden so they parse here.
    script, config = parse_arguments(
        [
            "--config",
            os.path.join(ROOT, "configs", "train", recipe),
            *overrides,
            "--output_dir",
            str(tmp_path),
        ]
    )
    assert resolve_reward(script.reward_funcs[0]).__name__ == reward
    if recipe.startswith("visual_math"):
        assert (
            script.model_name_or_path == "Qwen/Qwen2.5-VL-3B-Instruct"
            and script.dtype == "bfloat16"
        )
        assert script.dataset_prompt_column == "problem" and "<think>" in script.system_prompt
        assert (
            config.learning_rate == 1e-5
            and config.max_completion_length == 1024
            and config.log_completions
        )
        assert script.use_peft and script.lora_target_modules == ["q_proj", "v_proj"]
        assert config.use_vllm and config.vllm_mode == "colocate"
    elif recipe.startswith("tldr"):
        assert (
            script.model_name_or_path == "Qwen/Qwen2.5-72B"
            and config.per_device_train_batch_size == 4
        )
        assert config.use_vllm and config.vllm_mode == "server"
        with open(os.path.join(ROOT, "configs", "train", "tldr_multinode.yaml")) as handle:
            assert yaml.safe_load(handle)["deepspeed"] == "configs/deepspeed/zero3.json"
        assert os.path.exists(os.path.join(ROOT, "configs", "deepspeed", "zero3.json"))
    else:
        assert script.dataset_name == "trl-lib/DeepMath-103K"
