"""rloo.engine.tied: a weight tied between the input embedding and the LM head gets the model's own gradient, without the
vocabulary-sized tables PyTorch's embedding backward and gradient sum would make."""

import pytest
import torch
from transformers import LlamaForCausalLM

from rloo.engine.tied import tied_rows
from rloo.logps import per_token_logps
from rloo.tiny import tiny_config

VOCAB, HIDDEN = 1000, 32


def _tied_model(**overrides):
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_config(VOCAB, tie_word_embeddings=True, **overrides)).train()


def _rows():
    """2 prompts x 2 rows, one left-padded with the padding token (id 2, the embedding's padding_idx), completions of
    5 with end padding and a token that also occurs in a prompt."""
    torch.manual_seed(1)
    prompts = torch.randint(3, VOCAB, (2, 6)).repeat_interleave(2, dim=0)
    prompt_mask = torch.ones_like(prompts)
    prompts[2:, :2], prompt_mask[2:, :2] = 2, 0
    completions = torch.randint(3, VOCAB, (4, 5))
    completion_mask = torch.ones_like(completions)
    completions[1, 3:], completion_mask[1, 3:] = 2, 0
    completions[0, 1] = prompts[0, 3]
    return torch.cat([prompts, completions], 1), torch.cat([prompt_mask, completion_mask], 1)


def _backward(model, tied: bool, share: bool):
    """(gradients by name, whether tied_rows applied, sizes of the vocabulary x hidden allocations of the backward)"""
    ids, mask = _rows()
    model.zero_grad(set_to_none=True)
    with tied_rows(model) if tied else torch.enable_grad() as applied:
        out = per_token_logps(model, ids, mask, 5, 0.7, with_entropy=True, share_prompts=share)
    loss = (out.logps * mask[:, -5:]).sum()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as profile:
        loss.backward()
    table = VOCAB * HIDDEN * 4
    tables = [event for event in profile.events() if event.cpu_memory_usage == table]
    grads = {name: param.grad.clone() for name, param in model.named_parameters()}
    return grads, applied, len(tables)


@pytest.mark.parametrize("share", [False, True])
def test_tied_weight_gets_the_models_own_gradient_from_one_table(share):
    model = _tied_model()
    plain, applied_plain, tables_plain = _backward(model, tied=False, share=share)
    grads, applied, tables = _backward(model, tied=True, share=share)
    assert applied_plain is None and applied is True
    assert grads.keys() == plain.keys()
    for name, grad in grads.items():
        assert grad.layout is torch.strided, name
        if share and name == "model.embed_tokens.weight":
            # Two lookups: their rows are summed before they join the head's gradient (PyTorch adds them one by one)
            torch.testing.assert_close(grad, plain[name], rtol=1e-6, atol=1e-7)
        else:  # the same sums in the same order
            assert torch.equal(grad, plain[name]), name
    # The head's gradient alone; PyTorch's way adds a dense table per embedding lookup and a sum per extra use
    # (one forward: 3 tables; shared prompts, two lookups: at least 5).
    assert tables == 1 and tables_plain >= (5 if share else 3)
    assert all(
        "forward" not in module.__dict__ for module in model.modules()
    )  # the model is as it was


def test_untied_frozen_or_no_grad_models_run_as_they_are():
    torch.manual_seed(0)
    untied = LlamaForCausalLM(tiny_config(VOCAB))
    with tied_rows(untied) as applied:
        assert applied is False
    tied = _tied_model()
    tied.lm_head.weight.requires_grad_(False)
    with tied_rows(tied) as applied:
        assert applied is False
    tied.lm_head.weight.requires_grad_(True)
    with torch.no_grad(), tied_rows(tied) as applied:
        assert applied is False
    assert all("forward" not in module.__dict__ for module in tied.modules())


def test_head_over_parts_gives_each_parts_own_logits_and_one_weight_gradient():
    """The prompts' last positions and the completions through one head node: logits bitwise the head's own per part,
    gradients (weight, bias, inputs) those of two separate calls up to rounding, one vocabulary x hidden product."""
    from rloo.engine.shared_prompts import _head_over_parts

    torch.manual_seed(0)
    head = torch.nn.Linear(HIDDEN, VOCAB)
    first, second = (
        torch.randn(2, 1, HIDDEN, requires_grad=True),
        torch.randn(3, 4, HIDDEN, requires_grad=True),
    )
    weights = torch.randn(2, 1, VOCAB), torch.randn(3, 4, VOCAB)
    results = []
    for joint in (True, False):
        head.zero_grad(set_to_none=True)
        first.grad = second.grad = None
        outputs = _head_over_parts(head, first, second) if joint else (head(first), head(second))
        sum((out * w).sum() for out, w in zip(outputs, weights)).backward()
        results.append((outputs, head.weight.grad, head.bias.grad, first.grad, second.grad))
    (joint_out, *joint_grads), (plain_out, *plain_grads) = results
    assert all(torch.equal(a, b) for a, b in zip(joint_out, plain_out))
    for joint_grad, plain_grad in zip(joint_grads, plain_grads):
        torch.testing.assert_close(joint_grad, plain_grad, rtol=1e-6, atol=1e-6)
    with torch.no_grad():  # (nothing to save: the head's own calls)
        assert all(
            torch.equal(a, b) for a, b in zip(_head_over_parts(head, first, second), plain_out)
        )
