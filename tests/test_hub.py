"""push_to_hub through the narrow Publisher interface (a local directory stands in for the Hub): model card,
uploads during and after training, and the token never written anywhere."""

import logging
import os

import pytest
import torch

from helpers import conversational, length_reward, make_args
from rloo import RLOOTrainer
from rloo.hub import LocalPublisher, get_publisher, render_model_card, set_publisher

TOKEN = "hf_SECRETtoken1234567890"


@pytest.fixture
def hub(tmp_path):
    publisher = LocalPublisher(str(tmp_path / "hub"))
    set_publisher(publisher)
    yield publisher
    set_publisher(None)


def files_containing(root, needle):
    hits = []
    for directory, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(directory, name), "rb") as handle:
                if needle.encode() in handle.read():
                    hits.append(os.path.join(directory, name))
    return hits


def test_push_to_hub_after_training(tmp_path, tokenizer, model, hub, capsys, caplog):
    caplog.set_level(logging.DEBUG)
    model.config._name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    args = make_args(tmp_path, hub_model_id="me/tiny-rloo", hub_token=TOKEN, max_steps=2)
    trainer = RLOOTrainer(
        model=model,
        reward_funcs=length_reward,
        args=args,
        train_dataset=conversational(),
        processing_class=tokenizer,
    )
    trainer.train()
    commit = trainer.push_to_hub(dataset_name="me/arithmetic")
    tree = tmp_path / "hub" / "me" / "tiny-rloo" / "main"
    assert commit == "0000" and {
        "model.safetensors",
        "config.json",
        "README.md",
        "tokenizer.json",
    } <= set(os.listdir(tree))
    card = (tree / "README.md").read_text()
    assert (
        "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in card
        and "datasets: [me/arithmetic]" in card
    )
    assert (
        "RLOO (REINFORCE Leave-One-Out)" in card
        and "`length_reward`" in card
        and "| num_generations | 2 |" in card
    )
    assert "ahmadian2024back" in card and "- rloo" in card
    reloaded = torch.load(tree / "training_args.bin", weights_only=False)
    assert reloaded.hub_token is None and reloaded.hub_model_id == "me/tiny-rloo"
    # The token reached the publisher, and nothing else.
    assert [c["authenticated"] for c in hub.calls] == [True, True]
    out = capsys.readouterr()
    assert TOKEN not in out.out + out.err + caplog.text
    assert not files_containing(tmp_path, TOKEN)


def test_push_during_training_per_hub_strategy(tmp_path, tokenizer, model, hub):
    args = make_args(
        tmp_path,
        push_to_hub=True,
        hub_model_id="me/live",
        hub_token=TOKEN,
        hub_strategy="checkpoint",
        save_strategy="steps",
        save_steps=1,
        max_steps=2,
    )
    trainer = RLOOTrainer(
        model=model,
        reward_funcs=length_reward,
        args=args,
        train_dataset=conversational(),
        processing_class=tokenizer,
    )
    assert trainer.hub_model_id == "me/live"
    trainer.train()
    repo = tmp_path / "hub" / "me" / "live"
    messages = [c.get("commit_message") for c in hub.calls if c["call"] == "upload_folder"]
    assert messages == [
        "Training in progress, step 1",
        "Training in progress, step 1, checkpoint",
        "Training in progress, step 2",
        "Training in progress, step 2, checkpoint",
    ]
    assert (repo / "main" / "model.safetensors").exists()
    assert (
        repo / "main" / "last-checkpoint" / "rloo_state" / "rank0.pt"
    ).exists()  # resumable from the Hub
    assert not (repo / "main" / "rloo_state").exists()
    assert not files_containing(tmp_path, TOKEN)


def test_model_card_never_lists_secrets():
    card = render_model_card(
        "m",
        None,
        None,
        ["r"],
        {"hub_token": TOKEN, "num_generations": 4, "mlflow_password": "pw"},
        metrics={"reward": 0.5},
    )
    assert TOKEN not in card and "pw" not in card and "| reward | 0.5 |" in card


def test_publisher_choice_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("RLOO_HUB_PUBLISHER", f"local:{tmp_path}")
    assert isinstance(get_publisher(), LocalPublisher)
    monkeypatch.setenv("RLOO_HUB_PUBLISHER", "ftp://x")
    with pytest.raises(ValueError, match="RLOO_HUB_PUBLISHER"):
        get_publisher()


def test_push_to_hub_not_blocking_returns_while_the_upload_runs(tmp_path, tokenizer, model, hub):
    """blocking=False (spec: return before the push has finished): a Future of the commit; the next push and the end
    of train() wait for it."""
    import threading

    release, started = threading.Event(), threading.Event()
    upload = hub.upload_folder

    def slow_upload(*args, **kwargs):
        started.set()
        assert release.wait(30)
        return upload(*args, **kwargs)

    hub.upload_folder = slow_upload
    trainer = RLOOTrainer(
        model=model,
        reward_funcs=length_reward,
        args=make_args(tmp_path, hub_model_id="me/bg"),
        train_dataset=conversational(),
        processing_class=tokenizer,
    )
    trainer.train()
    future = trainer.push_to_hub(blocking=False)
    assert started.wait(30) and not future.done()  # returned while the upload is still going on
    release.set()
    assert future.result(timeout=30) == "0000"
    assert os.path.exists(tmp_path / "hub" / "me" / "bg" / "main" / "model.safetensors")
    assert trainer.push_to_hub() == "0001"  # blocking (the default): the commit itself


@pytest.mark.parametrize("always", [False, True])
def test_a_checkpoint_push_still_running_skips_the_next_unless_hub_always_push(
    tmp_path, tokenizer, model, hub, always
):
    """Checkpoint pushes run in the background as in transformers: while step 1's upload hangs, steps 2 and 3 are
    skipped (hub_always_push=False) or queued and pushed in order (True); train() waits for them."""
    import threading

    from transformers import TrainerCallback

    release = threading.Event()
    upload = hub.upload_folder

    def slow_upload(*args, **kwargs):
        assert release.wait(60)
        return upload(*args, **kwargs)

    class ReleaseAtTheLastSave(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == 3:
                release.set()

    hub.upload_folder = slow_upload
    args = make_args(
        tmp_path,
        push_to_hub=True,
        hub_model_id="me/queue",
        hub_strategy="every_save",
        save_strategy="steps",
        save_steps=1,
        max_steps=3,
        hub_always_push=always,
    )
    trainer = RLOOTrainer(
        model=model,
        reward_funcs=length_reward,
        args=args,
        train_dataset=conversational(),
        processing_class=tokenizer,
        callbacks=[ReleaseAtTheLastSave()],
    )
    trainer.train()
    messages = [c.get("commit_message") for c in hub.calls if c["call"] == "upload_folder"]
    steps = [1, 2, 3] if always else [1]
    assert messages == [f"Training in progress, step {step}" for step in steps]
    import tempfile

    assert not [name for name in os.listdir(tempfile.gettempdir()) if name.startswith("rloo-push-")]
