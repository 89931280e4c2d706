"""Publishing a promoted policy: the folder that goes to the Hub (the adapter or merged weights, the
tokenizer, a model card built with huggingface_hub's ModelCard / ModelCardData), its upload through
rloo.hub's publisher with a tag named after the run, and only then the move of the `champion` alias.
An upload that went through is never repeated: its commit is recorded in the run directory at once
and found again through the Hub tag."""

from __future__ import annotations

import json
import os
import shutil

from infra import stages, tracking
from infra.checkpoints import load_policy, render_table
from infra.evaluation import format_number
from infra.promotion import HUB_IDS, TOKENIZER_FILES, Candidate, promotion_dir
from rloo.hub import CARD_FIELDS, get_publisher, public_config

CARD = """
# {{ model_name }}

An RLOO-trained {{ 'LoRA adapter for' if adapter else 'fine-tune of' }} {{ base_label }}, from
pipeline run `{{ run_key }}` ({{ checkpoint }}, {{ step }} optimizer steps), registered as
`{{ registered }}` version {{ version }}.

Why this checkpoint: {{ reason }}.

## Evaluation

{{ num_prompts }} held-out prompts of `{{ source }}`, {{ decoding }}:

| metric | base | trained |
| --- | --- | --- |
{% for row in table %}| {{ row[0] }} | {{ row[1] }} | {{ row[2] }} |
{% endfor %}{% if checkpoints %}
Every evaluated checkpoint of the run, on the same prompts:

{% for line in checkpoints %}{{ line }}
{% endfor %}{% endif %}
## Training configuration

| parameter | value |
| --- | --- |
{% for key, value in training %}| {{ key }} | {{ value }} |
{% endfor %}
## How to load it

```python
{{ load_snippet }}
```
"""


def base_model_id(config) -> str | None:
    """The base model as Hub readers know it (an alias's public id; a Hub id as given), or None for
    a local path."""
    name = config.training["model_name_or_path"]
    if name in HUB_IDS:
        return HUB_IDS[name]
    return name if "/" in name and not os.path.exists(os.path.expanduser(name)) else None


def upload_folder(candidate: Candidate, version: str, metrics: dict) -> str:
    """`<run>/promotion/v<N>/upload`: what the Hub repository receives (built again at each
    attempt)."""
    config = candidate.config
    target = os.path.join(promotion_dir(candidate, version), "upload")
    if os.path.exists(target):
        shutil.rmtree(target)
    os.makedirs(target)
    merged = candidate.adapter and config.promotion.publish == "merged"
    if merged:
        model = load_policy(
            candidate.policy, candidate.weights, bool(config.recipe_value("trust_remote_code"))
        )
        model.merge_and_unload().save_pretrained(target)
    else:
        keep = (
            ("adapter_",)
            if candidate.adapter
            else ("model", "config.json", "generation_config.json")
        )
        for name in os.listdir(candidate.weights):
            if name.startswith(keep) and os.path.isfile(os.path.join(candidate.weights, name)):
                shutil.copy2(os.path.join(candidate.weights, name), target)
        # the adapter points at the public base, not a local path
        if candidate.adapter and base_model_id(config):
            path = os.path.join(target, "adapter_config.json")
            with open(path) as handle:
                adapter = json.load(handle)
            adapter["base_model_name_or_path"] = base_model_id(config)
            with open(path, "w") as handle:
                json.dump(adapter, handle, indent=2)
    own_tokenizer = os.path.exists(os.path.join(candidate.weights, "tokenizer_config.json"))
    tokenizer_dir = (
        candidate.weights if own_tokenizer else (candidate.tokenizer or candidate.policy)
    )
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(tokenizer_dir, name)):
            shutil.copy2(os.path.join(tokenizer_dir, name), target)
    model_card(candidate, version, merged, metrics).save(os.path.join(target, "README.md"))
    return target


def model_card(candidate: Candidate, version: str, merged: bool, metrics: dict):
    from huggingface_hub import EvalResult, ModelCard, ModelCardData

    config = candidate.config
    repo = config.promotion.hub_repo or config.registered_model
    base_id = base_model_id(config)
    source = config.data.source
    dataset_id = source if "/" in source and not os.path.exists(source) else None
    # the candidate's held-out metrics (a checkpoint's too)
    trained, base = metrics, candidate.evaluation["base"]

    def result(key: str, value: float, label: str) -> EvalResult:
        return EvalResult(
            task_type="text-generation",
            dataset_type=dataset_id or "local",
            dataset_name=os.path.basename(source),
            dataset_split=f"held-out ({len(candidate.rows)} prompts)",
            metric_type=label + key,
            metric_name=label + key,
            metric_value=value,
        )

    # This model's results, then the base model's on the same prompts (metric names prefixed
    # "base/").
    results = [result(key, value, "") for key, value in trained.items() if value is not None] + [
        result(key, value, "base/") for key, value in base.items() if value is not None
    ]
    adapter = candidate.adapter and not merged
    data = ModelCardData(
        model_name=repo.split("/")[-1],
        base_model=base_id,
        datasets=[dataset_id] if dataset_id else None,
        library_name="peft" if adapter else "transformers",
        pipeline_tag="text-generation",
        tags=["rloo", "reinforce", "rl"],
        eval_results=results,
    )
    recipe = public_config(config.training)
    if adapter and base_id:
        snippet = (
            "from peft import AutoPeftModelForCausalLM\n"
            f'model = AutoPeftModelForCausalLM.from_pretrained("{repo}")'
        )
    elif adapter:
        snippet = (
            "from peft import PeftModel\nfrom transformers import AutoModelForCausalLM\n"
            'base = AutoModelForCausalLM.from_pretrained("<the base model>")\nmodel = '
            f'PeftModel.from_pretrained(base, "{repo}")'
        )
    else:
        snippet = (
            "from transformers import AutoModelForCausalLM\n"
            f'model = AutoModelForCausalLM.from_pretrained("{repo}")'
        )
    decoding = (
        "greedy decoding"
        if config.evaluation.temperature == 0
        else f"temperature {config.evaluation.temperature}"
    )
    return ModelCard.from_template(
        data,
        template_str="---\n{{ card_data }}\n---\n" + CARD,
        model_name=data.model_name,
        adapter=adapter,
        base_label=f"`{base_id}`" if base_id else "a local base model",
        run_key=config.run_key,
        checkpoint=candidate.checkpoint,
        step=candidate.step,
        reason=candidate.reason,
        checkpoints=render_table(
            candidate.table, config.promotion.metric, list(config.evaluation.extra_sets)
        ),
        registered=config.registered_model,
        version=version,
        num_prompts=len(candidate.rows),
        source=source,
        decoding=decoding,
        table=[
            (key, format_number(base.get(key)), format_number(trained.get(key))) for key in base
        ],
        training=[
            (key, recipe[key])
            for key in ("model_name_or_path", "reward_funcs", *CARD_FIELDS)
            if key in recipe
        ],
        load_snippet=snippet,
    )


def publish(candidate: Candidate, version: str, metrics: dict) -> dict:
    """Upload (unless this candidate's upload already went through), tag it with the run key, record
    the repo, commit and URL on the model version, and only then move `champion` to it."""

    config = candidate.config
    publisher = get_publisher()
    repo = config.promotion.hub_repo or config.registered_model  # a LocalPublisher needs no owner
    record_path = os.path.join(promotion_dir(candidate, version), "upload.json")
    record = stages.read_json(record_path) or {}
    repo = publisher.create_repo(repo, token=None, private=config.promotion.private)
    commit = publisher.tags(repo, token=None).get(candidate.hub_tag) or (
        record.get("commit") if record.get("repo") == repo else None
    )
    uploaded = commit is None
    if uploaded:
        folder = upload_folder(candidate, version, metrics)
        # The repository holds exactly this model afterwards (a merged model beside an earlier
        # adapter's adapter_config.json would load as that adapter).
        commit = publisher.upload_folder(
            repo,
            folder,
            f"RLOO {config.run_key} ({candidate.checkpoint}, step "
            f"{candidate.step}), {config.registered_model} v{version}",
            token=None,
            delete_patterns=["*"],
        )
        stages.write_json(record_path, {"repo": repo, "commit": commit})
    if candidate.hub_tag not in publisher.tags(repo, token=None):
        publisher.create_tag(
            repo, candidate.hub_tag, commit, token=None, message=f"RLOO run {config.run_key}"
        )
    url = publisher.url(repo, commit)
    uri, name = config.tracking_uri, config.registered_model
    tracking.tag_version(
        uri,
        name,
        version,
        {"hub.repo": repo, "hub.commit": commit, "hub.url": url, "hub.tag": candidate.hub_tag},
    )
    previous = tracking.version_by_alias(uri, name, "champion")
    # after the upload is confirmed, never before
    tracking.set_alias(uri, name, "champion", version)
    tracking.tag_run(uri, candidate.parent_run_id, {"rloo.promoted": "true", "rloo.hub_url": url})
    return {
        "status": "published",
        "version": version,
        "repo": repo,
        "commit": commit,
        "url": url,
        "tag": candidate.hub_tag,
        "uploaded": uploaded,
        "previous_champion": None if previous is None else str(previous.version),
    }
