"""Bad input as a new user would type it: through `rloo-pipeline validate` (recipe, rows, launch, model folders) and
`rloo train` (its flags), every case exits 2 with an error (no traceback) that names the field or row, the bad value
and (where there is one) the fix, before any model loads, and writes nothing (the run root or output directory
stays absent or empty). What needs the tokenizer (its vocabulary against the model's, prompts against the model's
context) is refused by the model stage, from the model's config, before any weight loads."""

import json
import math
import os
import shutil

import pytest

from flows.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")

ROWS = {
    "empty-prompt.jsonl": [{"prompt": ""}, {"prompt": "2+2?"}],
    "no-prompt-column.jsonl": [{"question": "2+2?"}],
    "bad-role.jsonl": [{"prompt": [{"role": "robot", "content": "2+2?"}]}],
    "non-string-content.jsonl": [{"prompt": [{"role": "user", "content": 5}]}],
    "empty-messages.jsonl": [{"prompt": []}],
    "mixed-kinds.jsonl": [{"prompt": "2+2?"}, {"prompt": [{"role": "user", "content": "3+3?"}]}],
    "two-rows.jsonl": [{"prompt": "2+2?"}, {"prompt": "3+3?"}],
    "nan-column.jsonl": [{"prompt": "2+2?", "answer": 4.0}, {"prompt": "3+3?", "answer": math.nan}],
    "trained-on.jsonl": [
        {
            "prompt": [
                {"role": "user", "content": "What is 15 + 10? Answer with just the number."}
            ],
            "solution": "25",
        }
    ],
    "image-missing.jsonl": [
        {"prompt": [{"role": "user", "content": "how many?"}], "image": "nope.png"}
    ],
    "image-unreadable.jsonl": [
        {"prompt": [{"role": "user", "content": "how many?"}], "image": "two-rows.jsonl"}
    ],
    "image-parts.jsonl": [
        {
            "prompt": [
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "a?"}]}
            ],
            "images": ["shapes/00.png", "shapes/01.png"],
        }
    ],
}

CASES = [  # (id, --set overrides or a config file's text, what the one-line error must say)
    ("config-missing", "missing", "no such file"),
    ("yaml-syntax", "name: x\ndata: {source: data/arithmetic.jsonl\n", "is not valid YAML"),
    (
        "flat-train-recipe",
        "model_name_or_path: tiny\nreward_funcs: [rloo.rewards.numeric_accuracy_reward]\n",
        "is a flat `rloo train` recipe",
    ),
    ("misspelt-key", ["training.learnign_rate=0.1"], "learning_rate"),
    ("unknown-section", ["trainning.max_steps=3"], "trainning: unknown key"),
    ("moved-key", ["model.name_or_path=tiny"], "moved to training.model_name_or_path"),
    (
        "set-by-pipeline",
        ["training.output_dir=/tmp/x"],
        "training.output_dir is set by the pipeline",
    ),
    ("bad-name", ["name=Bad_Name"], "name: String should match pattern"),
    ("set-without-value", ["training.max_steps"], "expected key=value"),
    (
        "batch-not-divisible",
        ["training.per_device_train_batch_size=6"],
        "is not divisible by training.num_generations",
    ),
    (
        "batch-zero",
        ["training.per_device_train_batch_size=0"],
        "per_device_train_batch_size=0 must be >= 1",
    ),
    (
        "one-generation",
        ["training.num_generations=1"],
        "num_generations=1: RLOO requires at least 2",
    ),
    (
        "completion-length-zero",
        ["training.max_completion_length=0"],
        "max_completion_length=0 must be a positive",
    ),
    ("negative-learning-rate", ["training.learning_rate=-1"], "learning_rate=-1 is negative"),
    ("negative-beta", ["training.beta=-0.1"], "beta=-0.1 must be >= 0"),
    ("zero-temperature", ["training.temperature=0"], "temperature=0 must be > 0"),
    ("top-p-above-one", ["training.top_p=2"], "top_p=2 must be in (0, 1]"),
    (
        "accumulation-zero",
        ["training.gradient_accumulation_steps=0"],
        "gradient_accumulation_steps=0 must be >= 1",
    ),
    ("max-steps-zero", ["training.max_steps=0"], "max_steps=0: use a positive number"),
    ("max-steps-negative", ["training.max_steps=-5"], "max_steps=-5: use a positive number"),
    (
        "save-steps-zero",
        ["training.save_steps=0"],
        "save_steps=0 with save_strategy='steps' must be > 0",
    ),
    ("iterations-zero", ["training.num_iterations=0"], "num_iterations=0 must be >= 1"),
    ("negative-epsilon", ["training.epsilon=-1"], "epsilon=-1"),
    ("lora-rank-zero", ["training.lora_r=0"], "training.lora_r=0 must be >= 1"),
    (
        "qlora-without-lora",
        ["training.use_peft=false", "training.load_in_4bit=true"],
        "load_in_4bit needs",
    ),
    ("weights-per-reward", ["training.reward_weights=[1.0]"], "reward_weights has 1 entries for 2"),
    (
        "reward-import",
        ["training.reward_funcs=[nope.module:fn]", "training.reward_weights=null"],
        "reward function 'nope.module:fn': module 'nope.module' cannot be imported",
    ),
    (
        "model-path-missing",
        ["training.model_name_or_path=/nope/model"],
        "model_name_or_path='/nope/model': no such folder",
    ),
    ("bf16-without-gpu", ["training.bf16=true", "training.use_cpu=false"], "bf16=True"),
    ("wrong-type", ["training.max_steps=many"], "max_steps"),
    (
        "data-file-missing",
        ["data.source=/nope/prompts.jsonl"],
        "data.source '/nope/prompts.jsonl': no such file",
    ),
    (
        "eval-size-negative",
        ["data.eval_size=-1"],
        "data.eval_size: Input should be greater than or equal to 0",
    ),
    (
        "eval-temperature-negative",
        ["evaluation.temperature=-1"],
        "evaluation.temperature: Input should be greater",
    ),
    (
        "unknown-executor",
        ["launch.executor=cluster"],
        "launch.executor: Input should be 'local' or 'slurm'",
    ),
    (
        "generation-nodes",
        ["launch.slurm.generation_nodes=2"],
        "launch.slurm.generation_nodes: Input should be less",
    ),
    (
        "registered-model-name",
        ["promotion.model_name=team/policy"],
        "not a valid MLflow registered-model name",
    ),
    ("hub-repo-id", ["promotion.hub_repo=noslash"], "is not a Hub repository id"),
    (
        "empty-prompt",
        ["data.source={rows}/empty-prompt.jsonl"],
        "row 0, column 'prompt': empty prompt",
    ),
    (
        "no-prompt-column",
        ["data.source={rows}/no-prompt-column.jsonl"],
        "no 'prompt' column (columns: ['question'])",
    ),
    (
        "bad-role",
        ["data.source={rows}/bad-role.jsonl"],
        "row 0, column 'prompt', message 0: expected {'role'",
    ),
    (
        "non-string-content",
        ["data.source={rows}/non-string-content.jsonl"],
        "row 0, column 'prompt', message 0",
    ),
    (
        "empty-messages",
        ["data.source={rows}/empty-messages.jsonl"],
        "row 0, column 'prompt': empty message list",
    ),
    ("mixed-kinds", ["data.source={rows}/mixed-kinds.jsonl"], "row 1, column 'prompt' is"),
    (
        "eval-size-too-big",
        ["data.source={rows}/two-rows.jsonl"],
        "data.eval_size=8 leaves no training prompts",
    ),
    (
        "nan-in-a-column",
        ["data.source={rows}/nan-column.jsonl"],
        "row 1, column 'answer': NaN (a missing value",
    ),
    (
        "fewer-prompts-than-a-step",
        ["data.source={rows}/two-rows.jsonl", "data.eval_size=0", "launch.nproc_per_node=2"],
        "2 training prompts, but one generation batch of this launch (2 process(es)",
    ),
    (
        "processes-zero",
        ["launch.nproc_per_node=0"],
        "launch.nproc_per_node: Input should be greater than or equal to 1",
    ),
    (
        "trainer-nodes-zero",
        ["launch.executor=slurm", "launch.slurm.trainer_nodes=0"],
        "launch.slurm.trainer_nodes: Input should be greater than or equal to 1",
    ),
    (
        "batch-across-nodes",
        ["launch.executor=slurm", "launch.slurm.trainer_nodes=3", "training.num_generations=16"],
        "x trainer nodes = 24 is not divisible by training.num_generations = 16",
    ),
    (
        "model-folder-without-config",
        ["training.model_name_or_path={rows}/no-config"],
        "no config.json in",
    ),
    (
        "model-folder-without-weights",
        ["training.model_name_or_path={rows}/no-weights"],
        "no weights in",
    ),
    (
        "reward-model-is-a-causal-lm",
        ["training.reward_funcs=[{rows}/causal-lm]", "training.reward_weights=null"],
        "is a LlamaForCausalLM, not a reward model",
    ),
    (
        "extra-set-missing",
        ["evaluation.extra_sets={rephrased: /nope/set.jsonl}"],
        "evaluation.extra_sets.rephrased: '/nope/set.jsonl': no such file",
    ),
    (
        "extra-set-name",
        ["evaluation.extra_sets={Held Out: data/arithmetic_rephrased.jsonl}"],
        "extra set name 'Held Out': use lowercase letters",
    ),
    (
        "extra-set-trained-on",
        ["evaluation.extra_sets={leaked: {rows}/trained-on.jsonl}"],
        "evaluation.extra_sets.leaked: row 0's prompt is training prompt 0 of data.source",
    ),
    (
        "reward-model-with-two-labels",
        ["training.reward_funcs=[{rows}/two-labels]", "training.reward_weights=null"],
        "classifies into 2 labels; a reward model has one",
    ),
    (
        "image-file-missing",
        ["data.source={rows}/image-missing.jsonl"],
        "row 0: image 'nope.png' is not a file",
    ),
    (
        "image-unreadable",
        ["data.source={rows}/image-unreadable.jsonl"],
        "row 0: its 'image' cannot be read as an image",
    ),
    (
        "images-without-parts",
        ["data.source={rows}/image-parts.jsonl"],
        "row 0: the prompt has 1 {'type': 'image'} part(s) but the row has 2 image(s)",
    ),
]


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    """The bad rows, and bad model folders built from the tiny model's files."""
    from rloo.assets import resolve_model_alias

    folder = tmp_path_factory.mktemp("rows")
    for name, lines in ROWS.items():
        (folder / name).write_text("".join(json.dumps(line) + "\n" for line in lines))
    shutil.copytree(os.path.join(ROOT, "data", "shapes"), folder / "shapes")
    model, _ = resolve_model_alias("tiny", str(folder / "assets"))
    shutil.copytree(model, folder / "causal-lm")
    os.makedirs(folder / "no-config")
    shutil.copy(os.path.join(model, "model.safetensors"), folder / "no-config")
    os.makedirs(folder / "no-weights")
    shutil.copy(os.path.join(model, "config.json"), folder / "no-weights")
    shutil.copytree(model, folder / "two-labels")
    config = json.load(open(os.path.join(model, "config.json")))
    config.update(
        architectures=["LlamaForSequenceClassification"], id2label={"0": "bad", "1": "good"}
    )
    (folder / "two-labels" / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.mark.parametrize("case,given,expected", CASES, ids=[case[0] for case in CASES])
def test_bad_input_is_refused_in_one_line_and_writes_nothing(
    case, given, expected, rows, tmp_path, capsys
):
    run_root = tmp_path / "runs"
    if isinstance(given, str):
        config = str(tmp_path / "config.yaml")
        if given != "missing":
            (tmp_path / "config.yaml").write_text(given)
        arguments = [config]
    else:
        arguments = [
            TINY,
            "--set",
            f"run_root={run_root}",
            "--set",
            f"data.source={ROOT}/data/arithmetic.jsonl",
        ]
        for assignment in given:
            arguments += ["--set", assignment.replace("{rows}", str(rows))]
    assert main(["validate", *arguments]) == 2
    error = capsys.readouterr().err
    assert error.startswith("rloo-pipeline validate: error: ") and expected in error, error
    assert "Traceback" not in error
    assert not run_root.exists() or not any(run_root.iterdir())  # nothing written


FLAGS = [  # `rloo train` flags on a valid recipe: (id, flags, what the one-line error must say)
    (
        "flag-wrong-type",
        ["--max_steps", "many"],
        "max_steps: invalid int value: 'many' (from the command line)",
    ),
    (
        "flag-misspelt",
        ["--learnign_rate", "0.1"],
        "unknown field '--learnign_rate'. Did you mean 'learning_rate'?",
    ),
    ("flag-bad-value", ["--num_generations", "1"], "num_generations=1: RLOO requires at least 2"),
    (
        "flag-resume-missing",
        ["--resume_from_checkpoint", "/nope/checkpoint-3"],
        "resume_from_checkpoint='/nope/checkpoint-3' cannot be resumed from: no such folder",
    ),
    (
        "flag-reward-timeout",
        ["--reward_timeout", "-1"],
        "reward_timeout=-1.0 must be a positive number of seconds",
    ),
    ("flag-config-missing", ["--config", "/nope/recipe.yaml"], "/nope/recipe.yaml"),
    (
        "flag-config-twice",
        ["--config={recipe}", "--config", "{recipe}"],
        "--config is given 2 times: one recipe",
    ),
]


@pytest.mark.parametrize("case,flags,expected", FLAGS, ids=[case[0] for case in FLAGS])
def test_bad_train_flags_are_refused_in_one_line_and_write_nothing(
    case, flags, expected, tmp_path, capsys
):
    from rloo.cli import main as rloo_main

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"model_name_or_path: tiny\ndataset_name: {ROOT}/data/arithmetic.jsonl\nreward_funcs: "
        "[rloo.rewards.numeric_accuracy_reward]\nuse_cpu: true\nbf16: false\nmax_steps: 2\n"
    )
    output = tmp_path / "out"
    flags = [flag.format(recipe=recipe) for flag in flags]
    config = [] if any(flag.startswith("--config") for flag in flags) else ["--config", str(recipe)]
    assert rloo_main(["train", *config, "--output_dir", str(output), *flags]) == 2
    error = capsys.readouterr().err
    assert error.startswith("rloo train: error: ") and expected in error, error
    assert "Traceback" not in error and not output.exists()


MODEL_STAGE = [
    "tokenizer-larger-than-the-embedding",
    "prompt-longer-than-the-context",
    "images-with-a-text-model",
]


@pytest.mark.parametrize("case", MODEL_STAGE)
def test_the_model_stage_refuses_what_needs_the_tokenizer_before_any_weight_loads(
    case, rows, tmp_path, monkeypatch
):
    from transformers import AutoTokenizer

    from infra import stages
    from infra.runconfig import load_run_config
    from rloo.assets import resolve_model_alias

    _, tokenizer_dir = resolve_model_alias("tiny", os.path.join(rows, "assets"))
    assignments = [f"run_root={tmp_path}", "data.eval_size=2"]
    if case == "tokenizer-larger-than-the-embedding":
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        tokenizer.add_tokens([f"<extra_{i}>" for i in range(100)])
        tokenizer.save_pretrained(tmp_path / "big-tokenizer")
        assignments += [
            f"training.tokenizer_name_or_path={tmp_path}/big-tokenizer",
            f"data.source={ROOT}/data/arithmetic.jsonl",
        ]
        expected = "has 153 tokens but the model"
    elif case == "images-with-a-text-model":
        assignments += [f"data.source={ROOT}/data/shapes.jsonl"]
        expected = "has a column 'image' but the model is a text-only LlamaConfig"
    else:
        long = [{"prompt": [{"role": "user", "content": "1+" * 200 + "1?"}]}] + [
            {"prompt": [{"role": "user", "content": f"{i}+1?"}]} for i in range(12)
        ]
        (tmp_path / "long.jsonl").write_text("".join(json.dumps(row) + "\n" for row in long))
        assignments += [f"data.source={tmp_path}/long.jsonl", "data.seed=1"]
        expected = "tokens; with training.max_completion_length=8 it exceeds the context of"
    config = load_run_config(TINY, assignments)
    dataset = stages.prepare_dataset(config)
    loaded = []
    monkeypatch.setattr(
        "transformers.PreTrainedModel.from_pretrained", lambda *a, **k: loaded.append(a)
    )
    with pytest.raises(ValueError, match=expected):
        stages.prepare_model(config, dataset)
    assert loaded == [] and stages.load_stage_result(config, "model") is None


def test_the_error_page_shows_every_case():
    with open(os.path.join(ROOT, "docs", "errors.md")) as handle:
        page = handle.read()
    cases = [case[0] for case in CASES + FLAGS] + MODEL_STAGE
    assert [case for case in cases if f"| {case} |" not in page] == []
    assert (
        f"`tests/test_bad_input_matrix.py` runs each of these {len(cases)} cases"
        in page.replace("\n", " ")
    )
