"""The sampler-mismatch correction (vllm_importance_sampling_*) through the trainer: one SGD step with
a sampler that reports other log-probs than the policy's equals the independently computed weighted
leave-one-out gradient, in a sequence mode and a token mode; the combinations it (and asynchronous
generation) cannot serve are refused; it is on by default where samples lag."""

import copy

import pytest
import torch

from helpers import conversational, make_args
from rloo import RLOOConfig, RLOOTrainer
from rloo.generation import Completions, GenerationBackend


def policy_token_logps(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """log pi(o_t) of each completion token, one unpadded sequence, float64."""
    ids = torch.tensor([list(prompt) + list(completion)])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(completion)[:, None])[
        :, 0
    ]


class Mismatched(GenerationBackend):
    """The trainer's own sampler, reporting the log-probs of another sampler mu: the policy's plus
    0.2 * (-1, 0 or +1) per token (what a vLLM with other numerics or older weights returns)."""

    def __init__(self, inner: GenerationBackend):
        self.inner, self.prompts, self.sampler = inner, [], []

    def generate(self, model, prompt_ids, num_generations, step, **media):
        rows = [list(row) for row in self.inner.generate(model, prompt_ids, num_generations, step)]
        with torch.no_grad():
            logprobs = [
                (
                    policy_token_logps(model, prompt, row)
                    + torch.tensor([0.2 * ((i + t) % 3 - 1) for t in range(len(row))])
                ).tolist()
                for i, (prompt, row) in enumerate(zip(prompt_ids, rows))
            ]
        self.prompts.extend(prompt_ids)
        self.sampler.extend(logprobs)
        return Completions(rows, logprobs)


@pytest.mark.parametrize(
    "mode,low,high",
    [("sequence_truncate", 0.9, 1.1), ("token_mask", 0.9, 1.1), ("geometric_mask", 0.95, 1.05)],
)
def test_one_step_equals_the_weighted_leave_one_out_gradient(
    tmp_path, tokenizer, model, mode, low, high
):
    before, recorded, lr, group = copy.deepcopy(model), {}, 0.1, 3

    def reward(completion_ids, **kwargs):
        rewards = [float(len(ids)) + 0.5 * i for i, ids in enumerate(completion_ids)]
        recorded.update(completion_ids=completion_ids, rewards=rewards)
        return rewards

    args = make_args(
        tmp_path,
        max_steps=1,
        max_grad_norm=0.0,
        per_device_train_batch_size=6,
        num_generations=group,
        max_completion_length=5,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    trainer = RLOOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=conversational(6),
        processing_class=tokenizer,
        optimizers=(optimizer, scheduler),
    )
    # what use_vllm=True gives (RLOOConfig refuses the correction without vLLM, which is not in this
    # environment): a backend whose samples carry the sampler's log-probs
    trainer.args.vllm_importance_sampling_correction = True
    trainer.args.vllm_importance_sampling_mode = mode
    (
        trainer.args.vllm_importance_sampling_clip_min,
        trainer.args.vllm_importance_sampling_clip_max,
    ) = low, high
    trainer.generator = sampler = Mismatched(trainer.generator)
    trainer.train()

    rewards = recorded["rewards"]
    objective, bounded = 0.0, 0
    for i, (prompt, completion, mu) in enumerate(
        zip(sampler.prompts, recorded["completion_ids"], sampler.sampler)
    ):
        group_rewards = rewards[(i // group) * group : (i // group + 1) * group]
        advantage = rewards[i] - (sum(group_rewards) - rewards[i]) / (group - 1)
        logp = policy_token_logps(before, prompt, completion)
        ratio = torch.exp(logp.detach() - torch.tensor(mu, dtype=torch.float64))
        if mode == "sequence_truncate":
            weight = ratio.prod()
            bounded += int(not low <= weight <= high)
            term = weight.clamp(low, high) * logp.sum()
        elif mode == "geometric_mask":  # the ratio's geometric mean over the completion's tokens
            weight = ratio.prod() ** (1.0 / max(len(ratio), 1))
            inside = bool(low <= weight <= high)
            bounded += int(not inside)
            term = weight * inside * logp.sum()
        else:
            inside = (ratio >= low) & (ratio <= high)
            bounded += int((~inside).sum())
            term = (ratio * inside * logp).sum()
        objective = objective + advantage * term / len(rewards)
    assert bounded > 0  # the bounds took part
    objective.backward()
    logged = [
        log for log in trainer.state.log_history if "sampling/importance_sampling_ratio/mean" in log
    ]
    assert len(logged) == 1 and logged[0]["sampling/importance_sampling_limited_frac"] > 0
    for (name, p0), p1 in zip(before.named_parameters(), model.parameters()):
        torch.testing.assert_close(
            p1.detach() - p0.detach(), (lr * p0.grad).float(), atol=1e-6, rtol=1e-4, msg=name
        )


@pytest.mark.parametrize(
    "settings,error",
    [
        (dict(use_vllm=True, vllm_importance_sampling_mode="sequence"), "one of token_truncate"),
        (dict(use_vllm=True, vllm_importance_sampling_clip_min=4.0), "0 <= clip_min <= clip_max"),
        (dict(vllm_importance_sampling_correction=True), "no sampler mismatch to correct"),
        (
            dict(use_vllm=True, vllm_importance_sampling_correction=True, top_p=0.9),
            "would be biased",
        ),
        (dict(async_generation=True), "needs a generation server"),
        (dict(use_vllm=True, async_generation=True), "needs a generation server"),  # colocate
        (
            dict(use_vllm=True, vllm_mode="server", async_generation=True, max_staleness=-1),
            "0 or more",
        ),
        (dict(use_vllm=True, vllm_mode="server", weight_sync_steps=0), "1 or more"),
        (dict(use_vllm=True, vllm_mode="server", weight_sync_steps=2), "without async_generation"),
        (
            dict(
                use_vllm=True,
                vllm_mode="server",
                async_generation=True,
                max_staleness=0,
                weight_sync_steps=2,
            ),
            "without async_generation",
        ),
        (
            dict(use_vllm=True, vllm_mode="server", async_generation=True, weight_sync_steps=2),
            "max_staleness >= ",
        ),
        (
            dict(
                use_vllm=True,
                vllm_mode="server",
                async_generation=True,
                max_staleness=2,
                weight_sync_steps=2,
                steps_per_generation=2,
            ),
            "feed exactly one optimizer step",
        ),
        (
            dict(use_vllm=True, vllm_mode="server", async_generation=True, num_iterations=2),
            "an optimizer step later",
        ),
    ],
)
def test_what_the_correction_and_async_generation_cannot_serve_is_refused(
    tmp_path, settings, error
):
    with pytest.raises(ValueError, match=error):
        RLOOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **settings)


def test_the_correction_is_on_by_default_only_where_samples_lag(tmp_path):
    def correction(**settings):
        return RLOOConfig(
            output_dir=str(tmp_path),
            use_cpu=True,
            report_to="none",
            use_vllm=True,
            vllm_mode="server",
            **settings,
        ).vllm_importance_sampling_correction

    assert correction() is False  # as TRL's RLOOTrainer
    assert correction(async_generation=True) is True
    assert correction(async_generation=True, max_staleness=0) is False  # synchronous, exactly
    assert correction(async_generation=True, vllm_importance_sampling_correction=False) is False


def test_the_extreme_weights_are_the_extremes_of_the_logging_window_not_their_mean():
    """Two micro-batches in one logging window: the max / min logged are the window's, so one
    extreme micro-batch is not averaged away."""
    from types import SimpleNamespace

    from rloo.importance import sampler_weights
    from rloo.metrics import MetricBuffer
    from rloo.rollout import PiOld

    args = SimpleNamespace(
        vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode="sequence_truncate",
        vllm_importance_sampling_clip_min=None,
        vllm_importance_sampling_clip_max=None,
    )
    metrics, mask = MetricBuffer(), torch.ones(2, 1)
    for gap in (0.5, 2.0):  # log pi_old - log mu per row: ratios e^gap and e^-gap
        inputs = SimpleNamespace(
            sampler_logps=torch.tensor([[-1.0 - gap], [-1.0 + gap]]),
            completion_mask=mask,
            old_token_logps=None,
        )
        plan = PiOld(kept=False, kl="", weights="loss")
        sampler_weights(args, inputs, torch.full((2, 1), -1.0), metrics, "train", lambda t: t, plan)
    logged = metrics.flush("train")
    assert logged["sampling/importance_sampling_ratio/max"] == pytest.approx(torch.e**2.0)
    assert logged["sampling/importance_sampling_ratio/min"] == pytest.approx(torch.e**-2.0)
    assert logged["vllm/logprob_diff_max"] == pytest.approx(2.0)
    assert logged["vllm/logprob_diff_mean"] == pytest.approx(
        1.25
    )  # the rest stay means, as TRL logs them


def test_the_weights_pi_old_is_a_column_of_the_steps_plan():
    """Where the importance weights take pi_old is decided with the rest of pi_old (rloo.rollout.
    PiOld): from the rollout's forward where the plan runs one, else from the loss's forward; and
    evaluation's plan never defers the KL to the loss."""
    from types import SimpleNamespace

    from rloo.rollout import PiOld, pi_old_plan

    def plan(mode="train", dropout=False, **changes):
        args = dict(
            use_vllm=True,
            vllm_importance_sampling_correction=True,
            beta=0.05,
            num_iterations=1,
            steps_per_generation=1,
            gradient_accumulation_steps=1,
            kl_logps_from_generation=False,
        )
        return pi_old_plan(SimpleNamespace(**{**args, **changes}), dropout, mode)

    assert plan() == PiOld(kept=False, kl="loss", weights="loss")
    assert plan("eval") == PiOld(kept=False, kl="rollout", weights="rollout")
    assert plan(dropout=True) == PiOld(kept=False, kl="rollout", weights="rollout")
    assert plan(beta=0.0) == PiOld(kept=False, kl="", weights="loss")
    assert plan(num_iterations=2) == PiOld(kept=True, kl="rollout", weights="rollout")
    assert plan(beta=0.0, steps_per_generation=2) == PiOld(kept=True, kl="", weights="rollout")
    assert plan(vllm_importance_sampling_correction=False).weights == ""
    assert plan(use_vllm=False).weights == ""
