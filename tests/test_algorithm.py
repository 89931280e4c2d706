"""The RLOO formulas against numbers computed by hand."""

import math

import pytest
import torch

from rloo import algorithm as A

nan = math.nan


def close(actual, expected, tol=1e-6):
    actual = torch.as_tensor(actual, dtype=torch.float64)
    expected = torch.as_tensor(expected, dtype=torch.float64)
    assert actual.shape == expected.shape, (actual, expected)
    both_nan = torch.isnan(actual) & torch.isnan(expected)
    assert torch.all(both_nan | ((actual - expected).abs() <= tol)), (actual, expected)


def test_combine_rewards_weighted_sum_drops_none():
    R = torch.tensor([[1.0, 2.0], [nan, 3.0], [4.0, nan], [nan, nan]])
    # weights (2, 0.5): 2*1+0.5*2=3; 0.5*3=1.5; 2*4=8; unscorable -> NaN
    close(A.combine_rewards(R, torch.tensor([2.0, 0.5])), [3.0, 1.5, 8.0, nan])


def test_combine_rewards_clip_keeps_nan():
    R = torch.tensor([[5.0], [-5.0], [0.5], [nan]])
    close(A.combine_rewards(R, torch.tensor([1.0]), (-1.0, 1.0)), [1.0, -1.0, 0.5, nan])


def test_sequence_kl_sums_masked_log_ratio_without_grad():
    old = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -9.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -1.0], [-1.0, -2.0, -1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    kl = A.sequence_kl(old, ref, mask)
    # row0: 0.5 + (-1.0) = -0.5 (third token masked); row1: 0.5 + 1.5 + (-8.0) = -6.0
    close(kl, [-0.5, -6.0])
    assert not kl.requires_grad


def test_kl_penalty_subtracts_beta_kl():
    close(A.apply_kl_penalty(torch.tensor([1.0, 2.0]), torch.tensor([0.5, -1.0]), 0.1), [0.95, 2.1])


def test_leave_one_out_baseline_g3():
    r = torch.tensor([1.0, 2.0, 6.0, 0.0, 0.0, 3.0])
    # group 1: A0 = 1 - (2+6)/2 = -3; A1 = 2 - 3.5 = -1.5; A2 = 6 - 1.5 = 4.5
    # group 2: A3 = 0 - 1.5 = -1.5; A4 = -1.5; A5 = 3 - 0 = 3
    close(A.leave_one_out_advantages(r, 3), [-3.0, -1.5, 4.5, -1.5, -1.5, 3.0])


def test_leave_one_out_g2_is_difference():
    close(A.leave_one_out_advantages(torch.tensor([1.0, 4.0]), 2), [-3.0, 3.0])


def test_baseline_uses_scorable_siblings_only():
    r = torch.tensor([8.0, nan, 4.0, 2.0])
    # scorable: 8, 4, 2 (count 3): A0 = 8 - 3 = 5; A2 = 4 - 5 = -1; A3 = 2 - 6 = -4; unscorable -> 0
    _, adv = A.rloo_advantages(r.unsqueeze(1), torch.tensor([1.0]), 4)
    close(adv, [5.0, 0.0, -1.0, -4.0])


def test_single_scorable_sibling_and_all_none_get_zero():
    R = torch.tensor([[3.0], [nan], [nan], [nan], [nan], [nan]])
    _, adv = A.rloo_advantages(R, torch.tensor([1.0]), 3)
    close(adv, [0.0] * 6)


def test_kl_shapes_reward_before_baseline():
    R = torch.tensor([[1.0], [1.0]])
    kl = torch.tensor([2.0, 0.0])
    shaped, adv = A.rloo_advantages(R, torch.tensor([1.0]), 2, kl=kl, beta=0.5)
    close(shaped, [0.0, 1.0])
    close(adv, [-1.0, 1.0])


def test_normalize_over_whole_batch():
    adv = torch.tensor([-1.0, 1.0, -3.0, 3.0])
    # mean 0, sample std sqrt((1+1+9+9)/3) = sqrt(20/3)
    std = math.sqrt(20 / 3)
    close(A.normalize_advantages(adv), [x / (std + 1e-4) for x in (-1.0, 1.0, -3.0, 3.0)])


def test_normalize_ignores_unscorable():
    R = torch.tensor([[1.0], [3.0], [nan], [nan]])
    _, adv = A.rloo_advantages(R, torch.tensor([1.0]), 2, normalize=True)
    # LOO: -2, 2 -> mean 0, std sqrt(8) -> +-2/(2.8284+1e-4); unscorable group -> 0
    s = math.sqrt(8)
    close(adv, [-2 / (s + 1e-4), 2 / (s + 1e-4), 0.0, 0.0])


def test_nan_reward_values_propagate_as_unscorable():
    R = torch.tensor([[nan, nan], [2.0, nan], [4.0, 1.0]])
    shaped, adv = A.rloo_advantages(R, torch.tensor([1.0, 1.0]), 3)
    close(shaped, [nan, 2.0, 5.0])
    close(adv, [0.0, -3.0, 3.0])


def test_loss_on_policy_is_minus_mean_advantage_and_gradient_is_reinforce():
    logps = torch.tensor([[-1.0, -2.0], [-0.5, -0.5]], requires_grad=True)
    mask = torch.tensor([[1, 1], [1, 0]])
    adv = torch.tensor([2.0, -1.0])
    old = (logps * mask).sum(1).detach()
    loss, clip = A.clipped_surrogate_loss(logps, old, adv, mask, 0.2, 0.2)
    close(loss.detach(), -(2.0 - 1.0) / 2)
    loss.backward()
    # d loss / d logp[i,t] = -A_i mask[i,t] / B
    close(logps.grad, [[-1.0, -1.0], [0.5, 0.0]])
    close(clip["region"], [0.0, 0.0])


def test_loss_clips_sequence_ratio():
    # one token per sequence; old logp 0 -> ratio = exp(logp)
    logps = torch.tensor([[math.log(2.0)], [math.log(0.5)], [math.log(1.1)]], requires_grad=True)
    mask = torch.ones(3, 1)
    adv = torch.tensor([1.0, -1.0, 1.0])
    loss, clip = A.clipped_surrogate_loss(logps, torch.zeros(3), adv, mask, 0.2, 0.28)
    # row0: min(2*1, 1.28*1)=1.28 ; row1: min(0.5*-1, 0.8*-1) = -0.8 ; row2: min(1.1, 1.1) = 1.1
    close(loss.detach(), -(1.28 - 0.8 + 1.1) / 3)
    close(clip["high"], [1.0, 0.0, 0.0])
    close(clip["low"], [0.0, 1.0, 0.0])
    close(clip["region"], [1.0, 1.0, 0.0])
    loss.backward()
    close(logps.grad, [[0.0], [0.0], [-1.1 / 3]])


def test_masked_truncated_row_has_no_gradient_but_shapes_baseline():
    # rewards [8, 4, 8], first row truncated -> advantages [2, -4, 2] (its reward still counts)
    _, adv = A.rloo_advantages(torch.tensor([[8.0], [4.0], [8.0]]), torch.tensor([1.0]), 3)
    close(adv, [2.0, -4.0, 2.0])
    logps = torch.tensor([[-1.0, -1.0], [-2.0, -1.0], [-1.0, -3.0]], requires_grad=True)
    mask = torch.tensor([[0, 0], [1, 1], [1, 1]])
    old = (logps * mask).sum(1).detach()
    loss, _ = A.clipped_surrogate_loss(logps, old, adv, mask, 0.2, 0.2)
    loss.backward()
    close(logps.grad[0], [0.0, 0.0])
    close(loss.detach(), -(2.0 - 4.0 + 2.0) / 3)


def test_completion_mask_includes_first_eos_only():
    ids = torch.tensor([[5, 6, 2, 7, 2], [5, 5, 5, 5, 5], [2, 9, 9, 9, 9]])
    close(
        A.completion_mask_after_eos(ids, [2]), [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    )


def test_truncated_rows():
    ids = torch.tensor([[5, 2, 0], [5, 6, 7], [5, 0, 0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    close(A.truncated_rows(ids, mask, [2], pad_token_id=0).float(), [0.0, 1.0, 1.0])


def test_group_std_zero_and_nanstd():
    r = torch.tensor([1.0, 1.0, 2.0, 3.0, nan, nan])
    close(A.group_std_is_zero(r, 2).float(), [1.0, 0.0, 0.0])
    close(A.nanstd(torch.tensor([1.0, 3.0, nan])), math.sqrt(2.0))


def test_group_size_must_divide():
    with pytest.raises(ValueError, match="num_generations=4"):
        A.leave_one_out_advantages(torch.zeros(6), 4)


def test_importance_weights_in_the_four_modes():
    # differences log pi_old - log mu: row 0 [0.5, 0.0]; row 1 [-0.3, (masked)]
    old = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]])
    sampler = torch.tensor([[-1.5, -2.0], [-0.2, -1.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    e5, e3 = math.exp(0.5), math.exp(-0.3)

    def weights(mode, low=0.7, high=1.5):
        return A.importance_weights(old, sampler, mask, mode, low, high)

    w, outside = weights("sequence_truncate")
    close(w, [1.5, e3])
    assert outside.tolist() == [True, False]
    w, outside = weights("sequence_mask")
    close(w, [0.0, e3])
    w, outside = weights("sequence_mask", low=0.9)
    close(w, [0.0, 0.0])
    assert outside.tolist() == [True, True]
    w, outside = weights("token_truncate")
    close(w, [[1.5, 1.0], [e3, 0.0]])
    assert outside.tolist() == [[True, False], [False, False]]
    w, _ = weights("token_mask")
    close(w, [[0.0, 1.0], [e3, 0.0]])
    w, outside = weights("sequence_truncate", low=None, high=None)  # no bounds: the exact ratio
    close(w, [e5, e3])
    assert not outside.any()
    # the geometric modes: the mean per completion token, row 0 (0.5 + 0.0) / 2, row 1 -0.3 / 1
    w, outside = weights("geometric_truncate", low=0.8, high=1.2)
    close(w, [1.2, 0.8])
    assert outside.tolist() == [True, True]
    w, outside = weights("geometric_mask", low=0.7)
    close(w, [math.exp(0.25), e3])
    assert not outside.any()


def test_loss_with_importance_weights_per_sequence_and_per_token():
    mask = torch.tensor([[1, 1], [1, 0]])
    adv = torch.tensor([2.0, -1.0])

    def run(importance):
        logps = torch.tensor([[-1.0, -2.0], [-0.5, -0.5]], requires_grad=True)
        loss, _ = A.clipped_surrogate_loss(
            logps, (logps * mask).sum(1).detach(), adv, mask, 0.2, 0.2, importance
        )
        loss.backward()
        return loss.detach(), logps.grad

    loss, grad = run(torch.tensor([0.5, 3.0]))
    close(loss, -(0.5 * 2.0 + 3.0 * -1.0) / 2)  # each row's term times its weight
    close(grad, [[-0.5, -0.5], [1.5, 0.0]])  # -w_i A_i mask / B
    loss, grad = run(torch.tensor([[0.5, 2.0], [3.0, 0.0]]))
    close(loss, -(2.0 - 1.0) / 2)  # the value is the unweighted one
    close(grad, [[-0.5, -2.0], [1.5, 0.0]])  # -A_i w_it mask / B
