"""Publishing to the Hugging Face Hub behind a narrow interface, and the model card.

Everything the trainer sends to the Hub goes through a `Publisher` (two calls: create a repo,
upload a folder). `HfHubPublisher` is the real one; `LocalPublisher` writes into a directory laid
out like the Hub (one folder per repo, one numbered commit folder per upload) for tests and
air-gapped clusters. Pick it with `RLOO_HUB_PUBLISHER=local:/some/dir` or `set_publisher(...)`.
Tokens are passed to the publisher only: never written to a file, a model card, a log line or an
MLflow param."""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import shutil
from typing import Any, Protocol

from rloo.checkpoint import atomic_save

logger = logging.getLogger(__name__)

SECRET_MARKERS = ("token", "password", "secret", "api_key")


class Publisher(Protocol):
    def create_repo(self, repo_id: str, token: str | None, private: bool | None) -> str:
        """Create (or reuse) the repository; return its canonical id."""

    def upload_folder(
        self,
        repo_id: str,
        folder: str,
        commit_message: str,
        token: str | None,
        revision: str | None = None,
        path_in_repo: str | None = None,
        ignore_patterns: list[str] | None = None,
        delete_patterns: list[str] | None = None,
    ) -> str:
        """Upload a folder's files (and delete the remote files matching `delete_patterns` that it
        does not have); return a commit reference."""

    def create_tag(
        self, repo_id: str, tag: str, revision: str, token: str | None, message: str | None = None
    ) -> None:
        """Tag a commit (an existing tag of that name is an error)."""

    def tags(self, repo_id: str, token: str | None) -> dict[str, str]:
        """{tag name: commit reference} of the repository ({} when it does not exist)."""

    def url(self, repo_id: str, commit: str | None = None) -> str:
        """Where a person finds the repository (or one commit of it)."""


def hub_endpoint() -> str:
    """HF_ENDPOINT as it is now (huggingface_hub reads it once, at import)."""
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


class HfHubPublisher:
    """The Hub through huggingface_hub.HfApi, at HF_ENDPOINT; the token, when not given, is the
    client's own (HF_TOKEN or the cached login)."""

    def _api(self):
        from huggingface_hub import HfApi

        return HfApi(endpoint=hub_endpoint())

    def create_repo(self, repo_id, token, private):
        return self._api().create_repo(repo_id, token=token, private=private, exist_ok=True).repo_id

    def upload_folder(
        self,
        repo_id,
        folder,
        commit_message,
        token,
        revision=None,
        path_in_repo=None,
        ignore_patterns=None,
        delete_patterns=None,
    ):
        info = self._api().upload_folder(
            repo_id=repo_id,
            folder_path=folder,
            commit_message=commit_message,
            token=token,
            revision=revision,
            path_in_repo=path_in_repo,
            ignore_patterns=ignore_patterns,
            delete_patterns=delete_patterns,
        )
        return getattr(info, "oid", None) or str(info)

    def create_tag(self, repo_id, tag, revision, token, message=None):
        self._api().create_tag(
            repo_id, tag=tag, revision=revision, token=token, tag_message=message
        )

    def tags(self, repo_id, token):
        from huggingface_hub.errors import RepositoryNotFoundError

        try:
            refs = self._api().list_repo_refs(repo_id, token=token)
        except RepositoryNotFoundError:
            return {}
        return {ref.name: ref.target_commit for ref in refs.tags}

    def url(self, repo_id, commit=None):
        return f"{hub_endpoint()}/{repo_id}" + (f"/commit/{commit}" if commit else "")


class LocalPublisher:
    """A directory that behaves like the Hub: `<root>/<repo_id>/commits/<n>/...` plus
    `<root>/<repo_id>/main` (the latest tree). Records each call (never the token, only whether one
    was given)."""

    def __init__(self, root: str):
        self.root = root
        self.calls: list[dict[str, Any]] = []

    def create_repo(self, repo_id, token, private):
        os.makedirs(os.path.join(self.root, repo_id, "commits"), exist_ok=True)
        self.calls.append(
            {
                "call": "create_repo",
                "repo_id": repo_id,
                "private": private,
                "authenticated": token is not None,
            }
        )
        return repo_id

    def upload_folder(
        self,
        repo_id,
        folder,
        commit_message,
        token,
        revision=None,
        path_in_repo=None,
        ignore_patterns=None,
        delete_patterns=None,
    ):
        repo = os.path.join(self.root, repo_id)
        if not os.path.isdir(repo):
            raise FileNotFoundError(f"repository {repo_id!r} does not exist: create_repo first")
        commits = os.path.join(repo, "commits")
        number = len(os.listdir(commits))
        commit = os.path.join(commits, f"{number:04d}")
        tree = os.path.join(repo, revision or "main")
        remote = os.path.join(tree, path_in_repo or "")
        for directory, _, files in os.walk(remote) if delete_patterns else ():
            for name in files:
                relative = os.path.relpath(os.path.join(directory, name), remote)
                if any(
                    fnmatch.fnmatch(relative, p) for p in delete_patterns
                ) and not os.path.exists(os.path.join(folder, relative)):
                    os.remove(os.path.join(directory, name))
        for target in (commit, tree):
            destination = os.path.join(target, path_in_repo or "")
            for directory, _, files in os.walk(folder):
                relative_dir = os.path.relpath(directory, folder)
                for name in files:
                    relative = os.path.normpath(os.path.join(relative_dir, name))
                    if any(
                        fnmatch.fnmatch(relative, p)
                        or fnmatch.fnmatch(relative.split(os.sep)[0], p)
                        for p in ignore_patterns or []
                    ):
                        continue
                    os.makedirs(os.path.join(destination, os.path.dirname(relative)), exist_ok=True)
                    shutil.copy2(os.path.join(directory, name), os.path.join(destination, relative))
        with open(os.path.join(commit, ".commit.json"), "w") as handle:
            json.dump(
                {"message": commit_message, "path_in_repo": path_in_repo, "revision": revision},
                handle,
            )
        self.calls.append(
            {
                "call": "upload_folder",
                "repo_id": repo_id,
                "commit_message": commit_message,
                "path_in_repo": path_in_repo,
                "authenticated": token is not None,
            }
        )
        return f"{number:04d}"

    def create_tag(self, repo_id, tag, revision, token, message=None):
        tags = self.tags(repo_id, token)
        if tag in tags:
            raise ValueError(f"tag {tag!r} already exists in {repo_id}")
        commits = sorted(os.listdir(os.path.join(self.root, repo_id, "commits")))
        tags[tag] = revision if revision in commits else commits[-1]
        with open(os.path.join(self.root, repo_id, "tags.json"), "w") as handle:
            json.dump(tags, handle)
        self.calls.append(
            {
                "call": "create_tag",
                "repo_id": repo_id,
                "tag": tag,
                "authenticated": token is not None,
            }
        )

    def tags(self, repo_id, token):
        path = os.path.join(self.root, repo_id, "tags.json")
        if not os.path.exists(path):
            return {}
        with open(path) as handle:
            return json.load(handle)

    def url(self, repo_id, commit=None):
        return "file://" + os.path.abspath(
            os.path.join(self.root, repo_id, "commits" if commit else "main", commit or "")
        )


_publisher: Publisher | None = None


def set_publisher(publisher: Publisher | None) -> None:
    global _publisher
    _publisher = publisher


def get_publisher() -> Publisher:
    if _publisher is not None:
        return _publisher
    choice = os.environ.get("RLOO_HUB_PUBLISHER", "")
    if choice.startswith("local:"):
        return LocalPublisher(choice[len("local:") :])
    if choice not in ("", "hf"):
        raise ValueError(
            f"RLOO_HUB_PUBLISHER={choice!r}: use 'hf' (default) or 'local:/path/to/dir'."
        )
    return HfHubPublisher()


def is_secret(name: str) -> bool:
    lowered = name.lower()
    return any(marker in lowered for marker in SECRET_MARKERS)


def public_config(config: dict) -> dict:
    """Drop every key that names a secret (hub_token, ...), whatever its value."""
    return {key: value for key, value in config.items() if not is_secret(key)}


CITATION = """@inproceedings{ahmadian2024back,
    title     = {{Back to Basics: Revisiting REINFORCE-Style Optimization for Learning from Human
                 Feedback in LLMs}},
    author    = {Arash Ahmadian and Chris Cremer and Matthias Gall{\\'e} and Marzieh Fadaee and
                 Julia Kreutzer and Olivier Pietquin and Ahmet {\\"U}st{\\"u}n and Sara Hooker},
    booktitle = {ACL 2024},
    year      = 2024,
}"""

CARD_FIELDS = (
    "num_generations",
    "beta",
    "learning_rate",
    "max_completion_length",
    "temperature",
    "top_p",
    "num_iterations",
    "epsilon",
    "epsilon_high",
    "normalize_advantages",
    "reward_weights",
    "reward_clip_range",
    "mask_truncated_completions",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "generation_batch_size",
    "max_steps",
    "num_train_epochs",
    "seed",
)


def render_model_card(
    model_name: str,
    base_model: str | None,
    dataset_name: str | None,
    reward_names: list[str],
    config: dict,
    metrics: dict | None = None,
    tags: list[str] | None = None,
    peft: bool = False,
) -> str:
    tags = list(dict.fromkeys(["rloo", "reinforce", "rl", *(tags or [])]))
    front = [
        "---",
        f"library_name: {'peft' if peft else 'transformers'}",
        f"model_name: {model_name}",
    ]
    if base_model:
        front.append(f"base_model: {base_model}")
    if dataset_name:
        front.append(f"datasets: [{dataset_name}]")
    front += ["tags:"] + [f"- {tag}" for tag in tags] + ["---", ""]
    body = [f"# {model_name}", ""]
    link = f"[{base_model}](https://huggingface.co/{base_model})"
    origin = f"a fine-tuned version of {link}" if base_model else "a fine-tuned model"
    body.append(
        f"This model is {origin}"
        + (
            f", trained on [{dataset_name}](https://huggingface.co/datasets/{dataset_name})"
            if dataset_name
            else ""
        )
        + "."
    )
    body += [
        "",
        "## Method",
        "",
        "Trained with RLOO (REINFORCE Leave-One-Out): for each prompt, `num_generations` "
        "completions are sampled; each completion's advantage is its reward (minus `beta` times "
        "its KL to the reference policy) minus the mean reward of its siblings, and the policy is "
        "updated with a sequence-level "
        "clipped importance ratio.",
        "",
        f"Reward functions: {', '.join(f'`{name}`' for name in reward_names) or 'n/a'}.",
        "",
        "## Training configuration",
        "",
        "| parameter | value |",
        "| --- | --- |",
    ]
    safe = public_config(config)
    for field in CARD_FIELDS:
        if field in safe:
            body.append(f"| {field} | {safe[field]} |")
    if metrics:
        body += ["", "## Final training metrics", "", "| metric | value |", "| --- | --- |"]
        for name, value in sorted(metrics.items()):
            if isinstance(value, (int, float)) and not is_secret(name):
                body.append(f"| {name} | {value:.4g} |")
    body += ["", "## Citation", "", "```bibtex", CITATION, "```", ""]
    return "\n".join(front + body)


# ---------------------------------------------------------------------------------------------- the
# trainer's Hub side
def rewrite_training_args(args, output_dir: str) -> None:
    """transformers pickles the whole TrainingArguments, hub_token included, into every save (and so
    into every upload): write training_args.bin again with the secrets cleared."""
    import copy

    scrubbed = copy.copy(args)
    for name in vars(scrubbed):
        if is_secret(name) and isinstance(getattr(scrubbed, name), str):
            setattr(scrubbed, name, None)
    atomic_save(scrubbed, os.path.join(output_dir, "training_args.bin"))


def init_repo(trainer, token: str | None = None, private: bool | None = None) -> None:
    """Trainer.init_hf_repo through the publisher: hub_model_id, or output_dir's name."""
    if not trainer.is_world_process_zero():
        return
    args = trainer.args
    repo_id = args.hub_model_id or os.path.basename(os.path.abspath(args.output_dir))
    token = token if token is not None else args.hub_token
    private = private if private is not None else args.hub_private_repo
    trainer.hub_model_id = get_publisher().create_repo(repo_id, token=token, private=private)
    trainer.push_in_progress = None


def write_model_card(
    trainer,
    model_name: str | None = None,
    dataset_name: str | None = None,
    tags: str | list[str] | None = None,
) -> None:
    """README.md in output_dir: base model, dataset, method, reward functions, RLOO configuration
    (no secrets), final metrics."""
    if not trainer.is_world_process_zero():
        return
    if dataset_name is None:
        dataset_name = getattr(getattr(trainer.train_dataset, "info", None), "dataset_name", None)
    base_model = trainer._model_identity["name_or_path"] or None
    if base_model and os.path.isdir(os.path.expanduser(base_model)):
        base_model = None  # a local path means nothing to readers of the Hub page
    tags = [tags] if isinstance(tags, str) else list(tags or [])
    metrics = next((log for log in reversed(trainer.state.log_history) if "reward" in log), None)
    output_dir = trainer.args.output_dir
    card = render_model_card(
        model_name or os.path.basename(os.path.abspath(output_dir)),
        base_model,
        dataset_name,
        trainer.reward_func_names,
        trainer.args.to_dict(),
        metrics,
        tags + trainer._tag_names,
        peft=trainer._is_peft,
    )
    with open(os.path.join(output_dir, "README.md"), "w", encoding="utf-8") as handle:
        handle.write(card)


def push_output_dir(
    trainer,
    commit_message: str | None,
    blocking: bool,
    token: str | None,
    revision: str | None,
    private: bool | None,
    **card_kwargs,
):
    """Trainer.push_to_hub: save the model, write the card, upload output_dir (checkpoints
    excluded). Returns the commit reference; with blocking=False a `concurrent.futures.Future` of it
    (the upload runs in a background thread; `trainer.push_in_progress` holds it, and the next push
    waits for it first)."""
    trainer.callback_handler.on_push_begin(trainer.args, trainer.state, trainer.control)
    token = token if token is not None else trainer.args.hub_token
    if trainer.hub_model_id is None:
        init_repo(trainer, token=token, private=private)
    trainer.save_model(_internal_call=True)
    if not trainer.is_world_process_zero():
        return None
    model_name = (
        card_kwargs.pop("model_name", None)
        or (trainer.args.hub_model_id or "").split("/")[-1]
        or None
    )
    write_model_card(trainer, model_name=model_name, **card_kwargs)
    wait_for_push(trainer)

    def upload():
        return get_publisher().upload_folder(
            trainer.hub_model_id,
            trainer.args.output_dir,
            commit_message,
            token,
            revision=revision or trainer.args.hub_revision,
            ignore_patterns=["_*", "checkpoint-*"],
        )

    if blocking:
        return upload()
    from concurrent.futures import ThreadPoolExecutor

    from transformers.utils.hub import PushInProgress

    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rloo-push")
    future = executor.submit(upload)
    executor.shutdown(wait=False)
    # what Trainer waits for at the end of train()
    trainer.push_in_progress = PushInProgress([future])
    return future


def wait_for_push(trainer) -> None:
    """Finish a non-blocking push still running (its error, if any, is raised here)."""
    pending = getattr(trainer, "push_in_progress", None)
    if pending is not None:
        trainer.push_in_progress = None
        for job in pending.jobs:
            job.result()


def push_checkpoint(trainer, checkpoint_folder: str) -> None:
    """push_to_hub=True during training: upload at each save, per hub_strategy, in the background
    as transformers does: while a push is still running, a new checkpoint is skipped unless
    hub_always_push=True (then it is queued behind it); train() waits for the last one. The upload
    reads a hard-linked snapshot, so checkpoint rotation cannot pull files from under it."""
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    from transformers.utils.hub import PushInProgress

    args = trainer.args
    strategy = getattr(args.hub_strategy, "value", args.hub_strategy)
    if not trainer.is_world_process_zero() or strategy == "end":
        return
    pending = getattr(trainer, "push_in_progress", None)
    if pending is not None and not pending.is_done() and not args.hub_always_push:
        logger.info(
            "rloo: step %d's checkpoint is not pushed: the previous push is still "
            "running (hub_always_push=False)",
            trainer.state.global_step,
        )
        return
    trainer.callback_handler.on_push_begin(args, trainer.state, trainer.control)
    snapshot = tempfile.mkdtemp(prefix="rloo-push-")
    shutil.copytree(
        checkpoint_folder, os.path.join(snapshot, "checkpoint"), copy_function=_link_or_copy
    )
    folder = os.path.join(snapshot, "checkpoint")
    publisher, token, step = get_publisher(), args.hub_token, trainer.state.global_step

    def upload():
        message = f"Training in progress, step {step}"
        try:
            publisher.upload_folder(
                trainer.hub_model_id,
                folder,
                message,
                token,
                revision=args.hub_revision,
                ignore_patterns=["rloo_state", "optimizer.pt", "scheduler.pt", "rng_state*"],
            )
            if strategy in ("checkpoint", "all_checkpoints"):
                path = (
                    "last-checkpoint"
                    if strategy == "checkpoint"
                    else os.path.basename(checkpoint_folder)
                )
                publisher.upload_folder(
                    trainer.hub_model_id,
                    folder,
                    message + ", checkpoint",
                    token,
                    revision=args.hub_revision,
                    path_in_repo=path,
                )
        finally:
            shutil.rmtree(snapshot, ignore_errors=True)

    # one worker: queued pushes (hub_always_push) land in order
    if getattr(trainer, "_push_executor", None) is None:
        trainer._push_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rloo-push")
    future = trainer._push_executor.submit(upload)
    if pending is None or pending.is_done():
        trainer.push_in_progress = PushInProgress([future])
    else:
        pending.jobs.append(future)


def _link_or_copy(source: str, destination: str) -> None:
    try:
        os.link(source, destination)
    except OSError:  # another filesystem, or links not allowed
        shutil.copy2(source, destination)
