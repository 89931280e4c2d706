"""Run config (pydantic), overrides, fingerprints; dataset and model stages called directly (no Prefect)."""

import json
import os

import pytest
from datasets import Dataset

from infra import stages
from infra.runconfig import ConfigError, load_run_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")


def tiny(tmp_path, *overrides):
    return load_run_config(
        TINY, [f"run_root={tmp_path}", f"data.source={ROOT}/data/arithmetic.jsonl", *overrides]
    )


def test_shipped_configs_validate(tmp_path):
    for name in ("tiny.yaml", "quickstart.yaml"):
        config = load_run_config(os.path.join(ROOT, "configs", name), [f"run_root={tmp_path}"])
        script, args = stages.validate_recipe(config)
        assert script.reward_funcs == config.training["reward_funcs"]
        assert args.output_dir == stages.stage_path(config, "train", "output")


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "training.use_pefft=1",
            r"training.use_pefft: unknown field 'use_pefft'. Did you mean 'use_peft'",
        ),
        ("launch.nproc=1", r"launch.nproc: unknown key"),
        (
            "evaluation.checkpoints=2",
            r"evaluation.checkpoints: unknown key. Did you mean 'checkpoint_interval'",
        ),
        (
            "evaluation.checkpoint_interval=-1",
            r"evaluation.checkpoint_interval: Input should be greater than or equal",
        ),
        ("launch.nproc_per_node=two", r"launch.nproc_per_node: Input should be a valid integer"),
        (
            "training.num_generation=4",
            r"training.num_generation: unknown field 'num_generation'. Did you mean "
            r"'num_generations'",
        ),
        ("training.output_dir=x", r"training.output_dir is set by the pipeline"),
        ("training.reward_weights=[1.0]", r"training.reward_weights has 1 entries for 2 rewards"),
        (
            "training.reward_funcs=[]",
            r"training.reward_funcs \(or training.reward_model_name_or_path\) is required",
        ),
        (
            "training.dataset_name=x",
            r"training.dataset_name is set by the pipeline \(the prepared train split",
        ),
        ("training.num_generations=3", r"not divisible by training.num_generations = 3"),
        ("name=Bad_Name", r"name: String should match pattern"),
        ("training.load_in_4bit=true", r"training.load_in_4bit needs training.use_peft: true"),
        ("model.peft.r=8", r"model.peft.r: moved to training.lora_r"),
        ("rewards=[x]", r"rewards: moved to training.reward_funcs"),
    ],
)
def test_bad_config_names_the_key(tmp_path, override, message):
    extra = ["training.use_peft=false"] if "load_in_4bit" in override else []
    with pytest.raises(ConfigError, match=message):
        tiny(tmp_path, *extra, override)


def test_overrides_and_fingerprint(tmp_path):
    base = tiny(tmp_path)
    changed = tiny(tmp_path, "training.learning_rate=0.01")
    assert changed.training["learning_rate"] == 0.01 and isinstance(
        changed.training["learning_rate"], float
    )
    assert changed.fingerprint() != base.fingerprint() and changed.run_dir != base.run_dir
    elsewhere = tiny(
        tmp_path / "other", "tracking.experiment=x"
    )  # where results go is not what they are
    assert elsewhere.fingerprint() == base.fingerprint() and elsewhere.run_key == base.run_key
    assert base.run_dir == os.path.join(str(tmp_path), base.run_key) and base.run_key.startswith(
        "tiny-"
    )
    with pytest.raises(ConfigError, match="expected key=value"):
        tiny(tmp_path, "training.max_steps")


@pytest.mark.parametrize("suffix", ["json", "jsonl", "csv", "parquet"])
def test_dataset_stage_reads_files_and_splits(tmp_path, suffix):
    rows = [{"prompt": f"what is {i} plus one", "solution": str(i + 1)} for i in range(20)]
    path = tmp_path / f"data.{suffix}"
    dataset = Dataset.from_list(rows)
    {
        "json": lambda: path.write_text(json.dumps(rows)),
        "jsonl": lambda: dataset.to_json(str(path)),
        "csv": lambda: dataset.to_csv(str(path)),
        "parquet": lambda: dataset.to_parquet(str(path)),
    }[suffix]()
    config = tiny(
        tmp_path, f"data.source={path}", "data.eval_size=5", "data.max_train_samples=null"
    )
    result = stages.prepare_dataset(config)
    assert (result["num_train"], result["num_eval"], result["format"]) == (15, 5, "standard")
    from datasets import load_from_disk

    train, held_out = load_from_disk(result["train_path"]), load_from_disk(result["eval_path"])
    assert not set(train["prompt"]) & set(held_out["prompt"])
    assert stages.load_stage_result(config, "dataset") == result and stages.executions(config) == [
        "dataset"
    ]


@pytest.mark.parametrize(
    "rows, message",
    [
        ([{"prompt": "ok"}, {"prompt": ""}], r"row 1, column 'prompt': empty prompt"),
        (
            [
                {"prompt": [{"role": "user", "content": "hi"}]},
                {"prompt": [{"role": "robot", "content": "x"}]},
            ],
            r"row 1, column 'prompt', message 0: expected \{'role'",
        ),
        ([{"question": "no prompt column"}], r"no 'prompt' column"),
        (
            [
                {"prompt": "text"},
                {"prompt": "more"},
                {"prompt": [{"role": "user", "content": "mixed"}]},
            ],
            r"row 2, column 'prompt' is conversational but earlier rows are standard",
        ),
    ],
)
def test_dataset_stage_names_the_bad_row(tmp_path, rows, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows))
    with pytest.raises(ValueError, match=message):
        stages.prepare_dataset(tiny(tmp_path, f"data.source={path}", "data.eval_size=0"))


def test_model_stage_checks_before_training(tmp_path):
    config = tiny(tmp_path)
    dataset = stages.prepare_dataset(config)
    result = stages.prepare_model(config, dataset)
    assert result["peft"]["enabled"] and os.path.exists(
        os.path.join(result["policy"], "config.json")
    )
    with pytest.raises(ValueError, match=r"target_modules \['qkv'\] match no layer.*q_proj"):
        stages.prepare_model(tiny(tmp_path, "training.lora_target_modules=[qkv]"), dataset)
    with pytest.raises(ValueError, match="cannot be imported"):
        stages.prepare_model(
            tiny(
                tmp_path,
                "training.reward_funcs=[no_such_module:reward]",
                "training.reward_weights=null",
            ),
            dataset,
        )
    from transformers import AutoTokenizer

    no_template = AutoTokenizer.from_pretrained(result["tokenizer"])
    no_template.chat_template = None
    no_template.save_pretrained(str(tmp_path / "plain-tokenizer"))
    with pytest.raises(ValueError, match="no chat template"):
        stages.prepare_model(
            tiny(tmp_path, f"training.tokenizer_name_or_path={tmp_path}/plain-tokenizer"), dataset
        )


def test_flow_parameters_make_a_ui_form():
    from prefect.utilities.callables import parameter_schema

    from flows.pipeline import rloo_pipeline

    schema = parameter_schema(rloo_pipeline).model_dump()
    properties = schema["properties"]
    assert (
        properties["recipe"]["type"] == "string"
        and properties["recipe"]["default"] == "configs/quickstart.yaml"
    )
    assert {"configs/quickstart.yaml", "configs/tiny.yaml"} <= set(
        properties["recipe"]["enum"]
    )  # a choice
    assert (
        properties["overrides"]["type"] == "array"
        and properties["overrides"]["items"]["type"] == "string"
    )
    assert "key=value" in properties["overrides"]["description"]
    fields = schema["definitions"]["RunSettings"][
        "properties"
    ]  # the typed settings, with descriptions and bounds
    assert {
        "model",
        "max_steps",
        "learning_rate",
        "num_generations",
        "max_completion_length",
        "beta",
        "lora_r",
        "executor",
        "nproc_per_node",
        "trainer_nodes",
        "generation_nodes",
    } == set(fields)
    assert (
        fields["max_steps"]["anyOf"][0]["minimum"] == 1
        and "optimizer steps" in fields["max_steps"]["description"]
    )
    assert fields["executor"]["anyOf"][0]["enum"] == ["local", "slurm"]


def test_validate_command(tmp_path, capsys):
    from flows.cli import main

    assert (
        main(
            [
                "validate",
                TINY,
                "--set",
                f"run_root={tmp_path}",
                "--set",
                f"data.source={ROOT}/data/arithmetic.jsonl",
            ]
        )
        == 0
    )
    assert "valid:" in capsys.readouterr().out
    assert main(["validate", TINY, "--set", "training.learnig_rate=1"]) == 2
    assert "Did you mean 'learning_rate'" in capsys.readouterr().err
    assert main(["validate", TINY, "--set", "data.source=/nonexistent.jsonl"]) == 2
    assert not os.path.exists(tmp_path / "tiny")  # validation computes nothing and writes nothing


def test_72b_multinode_recipe_validates_here(capsys):
    from flows.cli import main

    assert main(["validate", os.path.join(ROOT, "configs", "qwen72b_multinode.yaml")]) == 0
    config = load_run_config(os.path.join(ROOT, "configs", "qwen72b_multinode.yaml"))
    from infra.slurm import executor_parameters

    params = executor_parameters(config.launch.slurm, config.launch.timeout_min, config.run_key)
    assert (
        params["nodes"] == 5 and params["gpus_per_node"] == 8 and params["slurm_partition"] == "gpu"
    )
    assert (
        main(
            [
                "validate",
                os.path.join(ROOT, "configs", "qwen72b_multinode.yaml"),
                "--set",
                "training.deepspeed=configs/deepspeed/missing.json",
            ]
        )
        == 2
    )


def test_sqlite_store_keeps_artifacts_beside_the_database(tmp_path):
    from infra import tracking

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    experiment = tracking.client(uri).get_experiment(tracking.experiment_id(uri, "rloo"))
    assert experiment.artifact_location == f"file://{tmp_path}/mlartifacts"


def test_runs_started_at_once_on_a_fresh_store_share_the_experiment_one_of_them_made(
    tmp_path, monkeypatch
):
    """Two runs both find no experiment, then both make it: the second's making is refused by the store and it takes
    the first one's (five Run clicks at once on a fresh MLflow failed one run with 'already exists' before)."""
    from mlflow import MlflowClient

    from infra import tracking

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    first = tracking.experiment_id(uri, "rloo")
    lookup = MlflowClient.get_experiment_by_name
    looked = []  # the second run's first look came before the first one made it

    def late_lookup(self, name):
        looked.append(name)
        return None if len(looked) == 1 else lookup(self, name)

    monkeypatch.setattr(MlflowClient, "get_experiment_by_name", late_lookup)
    assert tracking.experiment_id(uri, "rloo") == first


def test_prefect_deployments_point_at_their_flows_and_valid_recipes():
    import importlib

    import yaml

    with open(os.path.join(ROOT, "prefect.yaml")) as handle:
        deployments = yaml.safe_load(handle)["deployments"]
    for deployment in deployments:
        path, name = deployment["entrypoint"].split(":")
        module = importlib.import_module(path[:-3].replace("/", "."))
        assert getattr(module, name).name == (
            "rloo-sweep" if deployment["name"] == "sweep" else "rloo-pipeline"
        )
        config = load_run_config(os.path.join(ROOT, deployment["parameters"]["recipe"]))
        assert (config.sweep is not None) == (deployment["name"] == "sweep")


def test_evaluation_scores_one_rollout_with_the_training_state(tmp_path):
    """The evaluation stage builds its held-out completions with rloo.rollout.build_rollout (the function training
    uses): reward functions get the trained step's TrainerState and the training's chat_template_kwargs apply."""
    from transformers import GenerationConfig, TrainerState

    from rloo.generation import TransformersGenerator
    from rloo.rewards import RewardRunner
    from tiny_models import tiny_causal_lm, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = (
        "{% if greeting %}hello {% endif %}{% for m in messages %}{{ m['content'] }} {% endfor %}"
    )
    model = tiny_causal_lm(tokenizer).eval()
    seen = []

    def recorder(prompts, completions, completion_ids, trainer_state, **kwargs):
        seen.append((trainer_state.global_step, list(completion_ids)))
        return [float(len(ids)) for ids in completion_ids]

    config = tiny(
        tmp_path, "training.chat_template_kwargs={greeting: true}", "evaluation.batch_size=3"
    )
    rows = [
        {"prompt": [{"role": "user", "content": word}]}
        for word in ("the dog", "a big cat", "one two", "red")
    ]
    generation = GenerationConfig(
        max_new_tokens=5,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=[tokenizer.eos_token_id],
    )
    generator = TransformersGenerator(generation, tokenizer.pad_token_id, [tokenizer.eos_token_id])
    prompt_lengths = []
    original = generator.generate
    generator.generate = lambda m, ids, *a: (
        prompt_lengths.extend(len(i) for i in ids) or original(m, ids, *a)
    )
    from infra.evaluation import _score

    result = _score(
        config,
        model,
        tokenizer,
        rows,
        RewardRunner([recorder], [None]),
        generator,
        TrainerState(global_step=7, max_steps=7),
    )
    assert [step for step, _ in seen] == [7] and len(
        seen[0][1]
    ) == 4  # one call, all rows, the live step
    lengths = [len(ids) for ids in seen[0][1]]
    assert result["metrics"]["reward/recorder"] == pytest.approx(sum(lengths) / 4)
    assert result["metrics"]["completion_length"] == pytest.approx(sum(lengths) / 4)
    plain = [
        len(ids)
        for ids in tokenizer.apply_chat_template(
            [r["prompt"] for r in rows], tokenize=True, add_generation_prompt=True
        )["input_ids"]
    ]
    assert prompt_lengths == [
        n + 1 for n in plain
    ]  # 'hello ' (one token) from chat_template_kwargs


def test_evaluation_packs_the_decode_step_once_per_policy(tmp_path, tokenizer, monkeypatch):
    """The evaluate stage's batches of one policy share one packed copy of its weights (reusing_weights)."""
    from transformers import GenerationConfig, TrainerState

    from infra.evaluation import _score
    from rloo.engine import lean
    from rloo.generation import LeanGenerator
    from rloo.rewards import RewardRunner
    from tiny_models import tiny_causal_lm

    built, build = [], lean.lean_decoder
    monkeypatch.setattr(
        lean, "lean_decoder", lambda model, rows: built.append(rows) or build(model, rows)
    )
    rows = [
        {"prompt": [{"role": "user", "content": w}]}
        for w in ("the dog", "a big cat", "one two", "red", "sat")
    ]
    generation = GenerationConfig(
        max_new_tokens=4,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=[tokenizer.eos_token_id],
    )
    generator = LeanGenerator(generation, tokenizer.pad_token_id, [tokenizer.eos_token_id])
    _score(
        tiny(tmp_path, "evaluation.batch_size=2"),
        tiny_causal_lm(tokenizer).eval(),
        tokenizer,
        rows,
        RewardRunner([lambda completion_ids, **kw: [1.0] * len(completion_ids)], [None]),
        generator,
        TrainerState(global_step=1, max_steps=1),
    )
    assert built == [2, 1]  # batches of 2, 2 and 1 rows: packed for 2 rows once, then for 1


def test_evaluation_applies_the_training_reward_settings(tmp_path, monkeypatch):
    """reward_timeout (and nonfinite_rewards) of `training:` bound the evaluation's reward calls too."""
    from infra.evaluation import score_policies
    from rloo.assets import resolve_model_alias
    from rloo.rewards.runner import RewardTimeoutError

    monkeypatch.syspath_prepend(os.path.dirname(__file__))
    monkeypatch.setenv("RLOO_TEST_REWARD_SLEEP", "5")
    config = tiny(
        tmp_path,
        "training.reward_funcs=[pipeline_rewards:slow_length_reward]",
        "training.reward_weights=null",
        "training.reward_timeout=0.3",
    )
    policy, tokenizer = resolve_model_alias("tiny", str(tmp_path / "assets"))
    rows = [{"prompt": [{"role": "user", "content": "2+2?"}]}]
    with pytest.raises(
        RewardTimeoutError, match="'slow_length_reward' did not return within reward_timeout=0.3 s"
    ):
        score_policies(config, policy, tokenizer, rows, {"base": None}, {"base": 0}, 1)


def test_validate_and_rloo_train_give_the_same_error_for_the_same_bad_key(tmp_path, capsys):
    import yaml

    from flows.cli import main
    from rloo.cli import read_recipe

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"model_name_or_path": "x", "learnig_rate": 1.0}))
    with pytest.raises(ValueError) as flat:
        read_recipe(str(recipe))
    assert main(["validate", TINY, "--set", "training.learnig_rate=1"]) == 2
    pipeline = capsys.readouterr().err
    message = str(flat.value).split(": ", 1)[1]
    assert (
        message.startswith("unknown field 'learnig_rate'. Did you mean 'learning_rate'?")
        and message in pipeline
    )


def test_each_command_names_the_kind_of_file_it_expects(tmp_path):
    """configs/*.yaml are pipeline configs, configs/train/*.yaml flat `rloo train` recipes: each command refuses the
    other kind, naming the command that takes it."""
    from rloo.cli import read_recipe

    shipped = sorted(os.listdir(os.path.join(ROOT, "configs")))
    for name in (n for n in shipped if n.endswith(".yaml")):
        load_run_config(os.path.join(ROOT, "configs", name), [f"run_root={tmp_path}"])
        with pytest.raises(ValueError, match=f"is a pipeline config.*rloo-pipeline run .*{name}"):
            read_recipe(os.path.join(ROOT, "configs", name))
    for name in os.listdir(os.path.join(ROOT, "configs", "train")):
        path = os.path.join(ROOT, "configs", "train", name)
        read_recipe(path)
        with pytest.raises(
            ConfigError, match=f"is a flat `rloo train` recipe.*rloo train --config .*{name}"
        ):
            load_run_config(path)


def test_training_block_runs_unchanged_under_rloo_train(tmp_path):
    """A pipeline config's `training:` block is an `rloo train` recipe: written out as it is, it trains with the
    dataset and output_dir the pipeline would add given as flags (the 'tiny' alias resolves there too)."""
    import subprocess
    import sys

    import yaml

    with open(TINY) as handle:
        block = yaml.safe_load(handle)["training"]
    recipe = tmp_path / "training.yaml"
    recipe.write_text(yaml.safe_dump(block))
    env = dict(os.environ, RLOO_CACHE=str(tmp_path / "cache"))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "rloo",
            "train",
            "--config",
            str(recipe),
            "--dataset_name",
            os.path.join(ROOT, "data", "arithmetic.jsonl"),
            "--output_dir",
            str(tmp_path / "out"),
            "--max_steps",
            "1",
            "--save_strategy",
            "no",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert os.path.exists(
        tmp_path / "out" / "adapter_config.json"
    )  # use_peft from the block: an adapter


def test_a_bad_training_value_fails_the_flow_before_any_stage(tmp_path):
    """Every RLOOConfig value is checked first (rloo.cli.parse_recipe), before the run directory or a stage."""
    import asyncio

    from flows.pipeline import rloo_pipeline

    overrides = [
        f"run_root={tmp_path}",
        f"data.source={ROOT}/data/arithmetic.jsonl",
        "training.max_completion_length=0",
    ]
    with pytest.raises(ValueError, match="max_completion_length=0"):
        asyncio.run(rloo_pipeline.fn(TINY, overrides=overrides))
    assert os.listdir(tmp_path) == []


def test_training_progress_line_has_step_reward_and_eta(tmp_path, monkeypatch):
    """A plain log line (terminal, pipe or Prefect UI alike) at most every 30 s and at the last step."""
    import prefect.artifacts

    import tasks.common as common

    lines, clock = [], {"now": 1000.0}
    monkeypatch.setattr(prefect.artifacts, "create_progress_artifact", lambda *a, **k: "artifact")
    monkeypatch.setattr(prefect.artifacts, "update_progress_artifact", lambda *a, **k: None)
    monkeypatch.setattr(common, "say", lambda stage, message, config=None: lines.append(message))
    monkeypatch.setattr(common.time, "time", lambda: clock["now"])
    report = common.progress_reporter(tiny(tmp_path))
    # the job's first poll finds no step yet, as follow_training's does
    for step, now in (
        (0, 1000.0),
        (1, 1010.0),
        (2, 1020.0),
        (3, 1045.0),
        (4, 1050.0),
        (10, 1110.0),
    ):
        clock["now"] = now
        report(
            step,
            10,
            0.25 * step if step else None,
            "4.00 s/step (generation 3.00, train 1.00)" if step == 10 else None,
        )
    assert lines == [
        "step 0/10, 0s elapsed",
        "step 3/10, reward 0.750, ETA 2m02s, 45s elapsed",  # 17.5 s/step since step 1, 7 left
        "step 10/10, reward 2.500, ETA 0m00s, 110s elapsed, 4.00 s/step (generation 3.00, train 1.00)",
    ]


def _prefect_servers_of(home) -> list[int]:
    """Ephemeral Prefect API processes whose PREFECT_HOME is `home`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                cmdline = handle.read()
            with open(f"/proc/{pid}/environ", "rb") as handle:
                environ = handle.read().split(b"\0")
        except OSError:
            continue
        if (
            b"prefect.server.api.server:create_app" in cmdline
            and f"PREFECT_HOME={home}".encode() in environ
        ):
            found.append(int(pid))
    return found


def test_an_invalid_config_in_a_used_run_root_stops_the_api_started_early(tmp_path):
    """In a run root that has a Prefect database, `rloo-pipeline run` starts the ephemeral API while it validates the
    config (the two take seconds each); a config that then fails is one error line, the API is stopped once it is up
    (not in the middle of migrating its database), and none is left running."""
    import subprocess
    import sys

    home = tmp_path / ".prefect"
    home.mkdir()
    (home / "prefect.db").touch()  # an empty SQLite database: the API migrates it as it starts
    env = {key: value for key, value in os.environ.items() if not key.startswith("PREFECT_")}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "flows.cli",
            "run",
            TINY,
            f"--set=run_root={tmp_path}",
            "--set=training.learning_rate=fast",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert (
        "learning_rate: invalid float value: 'fast'" in result.stderr
        and "Traceback" not in result.stderr
    )
    assert _prefect_servers_of(home) == []
    import sqlite3

    with sqlite3.connect(
        home / "prefect.db"
    ) as database:  # it did start early: the empty database was migrated
        assert database.execute("select count(*) from alembic_version").fetchone()[0] == 1
    assert sorted(os.listdir(tmp_path)) == [".prefect"]  # no run directory, no MLflow store


def test_a_new_run_roots_prefect_database_is_copied_from_the_one_the_first_start_made(
    tmp_path, monkeypatch
):
    """Migrating a new Prefect database takes seconds: the first ephemeral API start on a new run root keeps its
    database, still empty, as the template (per Prefect version, in the rloo cache); the next new run root gets a copy
    before its API starts, which then starts on it. A database holding more than a start writes (a flow) is never
    made the template."""
    import sqlite3
    import subprocess
    import sys

    script = (
        "import os, sys\n"
        "from flows.prefect_api import EphemeralApi\n"
        "api = EphemeralApi()\n"
        "api.start(sys.argv[1])\n"
        "seeded = os.path.exists(os.path.join(sys.argv[1], '.prefect', 'prefect.db')) and not api.fresh\n"
        "api.wait_ready()\n"
        "print(seeded, api.started)\n"
    )
    env = {key: value for key, value in os.environ.items() if not key.startswith("PREFECT_")}
    env.update(RLOO_CACHE=str(tmp_path / "cache"), PYTHONPATH=ROOT)

    def start(root) -> str:
        result = subprocess.run(
            [sys.executable, "-c", script, str(root)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        return result.stdout.split()[-2:]

    assert start(tmp_path / "first") == ["False", "True"]  # migrated in place: no template yet
    templates = os.listdir(tmp_path / "cache" / "prefect-db")
    assert (
        len(templates) == 1 and templates[0].startswith("prefect-") and templates[0].endswith(".db")
    )
    template = tmp_path / "cache" / "prefect-db" / templates[0]
    assert start(tmp_path / "second") == [
        "True",
        "True",
    ]  # copied before the start, and the API started on it

    def contents(path) -> tuple:
        with sqlite3.connect(path) as database:
            return (
                database.execute("select version_num from alembic_version").fetchall(),
                database.execute("select count(*) from block_type").fetchone()[0],
                database.execute("select count(*) from flow").fetchone()[0],
            )

    first, second = (
        contents(tmp_path / name / ".prefect" / "prefect.db") for name in ("first", "second")
    )
    assert first == second == contents(template) and first[1] > 0 and first[2] == 0

    from flows import prefect_api

    used = tmp_path / "used.db"
    with sqlite3.connect(template) as source, sqlite3.connect(used) as target:
        source.backup(target)
        target.execute("insert into flow (id, name) values ('f', 'rloo-pipeline')")
    os.remove(template)
    monkeypatch.setenv("RLOO_CACHE", str(tmp_path / "cache"))
    prefect_api.save_template(str(used))
    assert os.listdir(tmp_path / "cache" / "prefect-db") == []


def test_evaluation_sampling_does_not_take_the_models_own_generation_config(tmp_path, monkeypatch):
    """With evaluation.temperature > 0, a model whose generation_config.json says top_k 1 (a Qwen Instruct model's
    says 20) is sampled with the evaluation's settings: top_k off, so one prompt's 8 samples differ (with top_k 1 all
    8 would be its greedy completion)."""
    import shutil

    from infra.evaluation import score_policies
    from rloo.assets import resolve_model_alias

    monkeypatch.setenv(
        "RLOO_ENGINE", "reference"
    )  # model.generate: where a model's own settings are merged in
    policy, tokenizer = resolve_model_alias("tiny", str(tmp_path / "assets"))
    own = shutil.copytree(policy, tmp_path / "own-top-k")
    (own / "generation_config.json").write_text(json.dumps({"do_sample": True, "top_k": 1}))
    rows = [{"prompt": [{"role": "user", "content": "2+2?"}], "solution": "4"}] * 8
    config = tiny(tmp_path, "evaluation.temperature=1.0", "evaluation.max_completion_length=6")
    texts = score_policies(config, str(own), tokenizer, rows, {"base": None}, {"base": 0}, 1)[
        "base"
    ]["texts"]
    assert len(set(texts)) > 1, texts
    greedy = tiny(
        tmp_path,
        "evaluation.temperature=1.0",
        "evaluation.max_completion_length=6",
        "evaluation.top_k=1",
    )
    assert (
        len(
            set(
                score_policies(greedy, str(own), tokenizer, rows, {"base": None}, {"base": 0}, 1)[
                    "base"
                ]["texts"]
            )
        )
        == 1
    )
