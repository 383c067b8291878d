"""GRPO loss pieces on hand-computed tensors: masks, aggregation, clipping, dual clip, KL, log-probs, gradients."""

from __future__ import annotations

import math

import pytest
import torch

from physreason.errors import ConfigError
from physreason.train import grpo_loss
from physreason.train.grpo_loss import (
    aggregate_loss,
    entropy_from_logits,
    kl_k3,
    masked_mean,
    masked_sum,
    policy_loss,
    policy_loss_names,
    register_policy_loss,
    token_logprobs,
)

INF = float("inf")
# Two sequences of three positions; the second has one real token and two of padding.
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


def test_masked_sum_and_mean_ignore_padding_even_when_it_holds_inf_or_nan():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, INF, float("nan")]])
    assert masked_sum(values, MASK).item() == 10.0
    assert masked_mean(values, MASK).item() == 2.5
    torch.testing.assert_close(masked_mean(values, MASK, dim=-1), torch.tensor([2.0, 4.0]))


def test_masked_mean_of_nothing_is_zero_not_nan():
    assert masked_mean(torch.ones(2, 3), torch.zeros(2, 3)).item() == 0.0


def test_aggregation_modes_on_a_padded_batch():
    loss_mat = torch.tensor([[1.0, 2.0, 3.0], [4.0, INF, INF]])
    assert aggregate_loss(loss_mat, MASK, "token-mean").item() == pytest.approx(10 / 4)
    assert aggregate_loss(loss_mat, MASK, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    # Dr. GRPO: sum / (B * constant length); the length defaults to T.
    assert aggregate_loss(loss_mat, MASK, "seq-mean-token-sum-norm", norm_length=5).item() == pytest.approx(10 / 10)
    assert aggregate_loss(loss_mat, MASK, "seq-mean-token-sum-norm").item() == pytest.approx(10 / 6)


def test_seq_mean_token_mean_leaves_out_sequences_without_tokens():
    loss_mat = torch.tensor([[1.0, 3.0], [5.0, 5.0]])
    mask = torch.tensor([[1, 1], [0, 0]])
    assert aggregate_loss(loss_mat, mask, "seq-mean-token-mean").item() == 2.0


def test_unknown_aggregation_mode_names_the_config_key():
    with pytest.raises(ConfigError, match=r"loss_agg_mode.*token-mean"):
        aggregate_loss(torch.ones(1, 1), torch.ones(1, 1), "token-sum")  # type: ignore[arg-type]


def test_kl_k3_hand_values():
    logprobs = torch.tensor([[0.0, math.log(0.5), -1.0]])
    ref = torch.tensor([[math.log(0.5), math.log(0.5), 0.0]])
    # exp(d) - d - 1 with d = ref - lp: d = -ln 2 -> 0.5 + ln 2 - 1; d = 0 -> 0; d = 1 -> e - 2.
    expected = torch.tensor([[0.5 + math.log(2) - 1, 0.0, math.e - 2]])
    torch.testing.assert_close(kl_k3(logprobs, ref), expected)
    assert (kl_k3(torch.randn(50), torch.randn(50)) >= 0).all()


def _logprobs_with_ratios(ratios: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    old = torch.full((len(ratios), len(ratios[0])), -1.0)
    return old + torch.tensor(ratios).log(), old


def test_on_policy_loss_is_minus_the_token_mean_advantage():
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -3.0, -3.0]])
    loss, metrics = policy_loss(old.clone(), old, torch.tensor([1.0, -1.0]), MASK)
    # Token losses -1, -1, -1 and +1 over four tokens.
    assert loss.item() == pytest.approx(-0.5)
    assert metrics["ratio_mean"].item() == 1.0
    assert metrics["approx_kl"].item() == 0.0
    assert metrics["clip_frac_low"].item() == 0.0 and metrics["clip_frac_high"].item() == 0.0


def test_ratios_outside_the_clip_range_are_clipped_and_counted():
    # Row 0 (A = +1): ratios 1.5 (clipped at 1.2), 1.1, 0.5 (A > 0: the min keeps 0.5, not clipped).
    # Row 1 (A = -1): ratio 0.5 (clipped at 0.8), then padding whose ratio would also be clipped.
    logprobs, old = _logprobs_with_ratios([[1.5, 1.1, 0.5], [0.5, 9.0, 0.1]])
    loss, metrics = policy_loss(logprobs, old, torch.tensor([1.0, -1.0]), MASK, epsilon_low=0.2, epsilon_high=0.2)
    assert loss.item() == pytest.approx((-1.2 - 1.1 - 0.5 + 0.8) / 4)
    assert metrics["clip_frac_high"].item() == pytest.approx(1 / 4)
    assert metrics["clip_frac_low"].item() == pytest.approx(1 / 4)
    assert metrics["ratio_mean"].item() == pytest.approx((1.5 + 1.1 + 0.5 + 0.5) / 4)
    assert metrics["ratio_max"].item() == pytest.approx(1.5)


def test_clip_higher_lets_the_ratio_rise_further_than_it_may_fall():
    logprobs, old = _logprobs_with_ratios([[1.25], [0.75]])
    mask = torch.ones(2, 1)
    advantages = torch.tensor([1.0, -1.0])
    symmetric, sym_metrics = policy_loss(logprobs, old, advantages, mask, epsilon_low=0.2, epsilon_high=0.2)
    asymmetric, asym_metrics = policy_loss(logprobs, old, advantages, mask, epsilon_low=0.2, epsilon_high=0.28)
    assert symmetric.item() == pytest.approx((-1.2 + 0.8) / 2)
    assert asymmetric.item() == pytest.approx((-1.25 + 0.8) / 2)
    assert sym_metrics["clip_frac_high"].item() == 0.5 and asym_metrics["clip_frac_high"].item() == 0.0
    assert sym_metrics["clip_frac_low"].item() == 0.5 and asym_metrics["clip_frac_low"].item() == 0.5


def test_dual_clip_bounds_the_loss_of_negative_advantages_at_c_times_abs_a():
    # A = -2 with ratio 5: PPO's loss is 5 * 2 = 10; dual clip c = 3 caps it at 6.
    logprobs, old = _logprobs_with_ratios([[5.0]])
    mask = torch.ones(1, 1)
    plain, plain_metrics = policy_loss(logprobs, old, torch.tensor([-2.0]), mask)
    dual, dual_metrics = policy_loss(logprobs, old, torch.tensor([-2.0]), mask, dual_clip=3.0)
    assert plain.item() == pytest.approx(10.0)
    assert dual.item() == pytest.approx(6.0)
    assert "dual_clip_frac" not in plain_metrics
    assert dual_metrics["dual_clip_frac"].item() == 1.0


@pytest.mark.parametrize(("ratio", "advantage"), [(2.0, -1.0), (5.0, 1.0), (0.5, -1.0)])
def test_dual_clip_is_inactive_below_c_and_for_positive_advantages(ratio, advantage):
    logprobs, old = _logprobs_with_ratios([[ratio]])
    mask = torch.ones(1, 1)
    plain, _ = policy_loss(logprobs, old, torch.tensor([advantage]), mask)
    dual, metrics = policy_loss(logprobs, old, torch.tensor([advantage]), mask, dual_clip=3.0)
    assert dual.item() == pytest.approx(plain.item())
    assert metrics["dual_clip_frac"].item() == 0.0


def test_kl_beta_adds_beta_times_the_aggregated_k3():
    torch.manual_seed(0)
    old = -torch.rand(2, 3) * 3
    logprobs = old + 0.1 * torch.randn(2, 3)
    ref = old + 0.3 * torch.randn(2, 3)
    advantages = torch.tensor([0.5, -1.0])
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        base, _ = policy_loss(logprobs, old, advantages, MASK, agg_mode=mode)
        with_kl, metrics = policy_loss(logprobs, old, advantages, MASK, agg_mode=mode, kl_beta=0.04, ref_logprobs=ref)
        expected = 0.04 * aggregate_loss(kl_k3(logprobs, ref), MASK, mode)
        assert (with_kl - base).item() == pytest.approx(expected.item(), rel=1e-5)
        assert metrics["kl_ref"].item() == pytest.approx(masked_mean(kl_k3(logprobs, ref), MASK).item(), rel=1e-6)


def test_kl_needs_a_reference_only_when_beta_is_positive():
    lp = torch.zeros(1, 2)
    policy_loss(lp, lp, torch.ones(1), torch.ones(1, 2), kl_beta=0.0)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(lp, lp, torch.ones(1), torch.ones(1, 2), kl_beta=0.1)


def test_approx_kl_old_to_new_is_the_k3_of_the_ratio():
    logprobs, old = _logprobs_with_ratios([[math.exp(0.1), math.exp(-0.2)]])
    _, metrics = policy_loss(logprobs, old, torch.ones(1), torch.ones(1, 2))
    expected = ((math.exp(0.1) - 1 - 0.1) + (math.exp(-0.2) - 1 + 0.2)) / 2
    assert metrics["approx_kl"].item() == pytest.approx(expected, rel=1e-5)


def test_garbage_log_probs_on_padding_give_finite_loss_and_gradients():
    logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, 80.0, -INF]], requires_grad=True)
    old = torch.tensor([[-1.1, -2.0, -0.4], [-1.0, -INF, 50.0]])
    ref = torch.tensor([[-1.0, -2.0, -0.5], [-1.2, -INF, 90.0]])
    loss, metrics = policy_loss(logprobs, old, torch.tensor([1.0, -1.0]), MASK, kl_beta=0.1, ref_logprobs=ref)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(value) for value in metrics.values())
    assert torch.isfinite(logprobs.grad).all()
    assert torch.equal(logprobs.grad[1, 1:], torch.zeros(2))


def test_gradient_in_the_unclipped_region_is_minus_advantage_times_ratio_over_token_count():
    torch.manual_seed(1)
    old = -torch.rand(2, 3) * 2
    log_ratio = torch.tensor([[0.05, -0.1, 0.15], [-0.12, 0.3, 0.0]])  # all ratios inside [0.8, 1.2] where counted
    logprobs = (old + log_ratio).requires_grad_(True)
    advantages = torch.tensor([0.7, -1.3])
    loss, _ = policy_loss(logprobs, old, advantages, MASK)
    (grad,) = torch.autograd.grad(loss, logprobs)
    expected = -advantages[:, None] * log_ratio.exp() / MASK.sum()
    torch.testing.assert_close(grad, expected * MASK)


def test_clipped_tokens_get_no_gradient():
    logprobs, old = _logprobs_with_ratios([[1.5, 1.0], [0.5, 1.0]])
    logprobs.requires_grad_(True)
    loss, _ = policy_loss(logprobs, old, torch.tensor([1.0, -1.0]), torch.ones(2, 2))
    (grad,) = torch.autograd.grad(loss, logprobs)
    assert grad[0, 0] == 0 and grad[1, 0] == 0
    assert grad[0, 1] != 0 and grad[1, 1] != 0


def test_sequence_level_ratio_equals_token_level_when_every_token_moved_alike():
    logprobs, old = _logprobs_with_ratios([[1.1, 1.1, 1.1], [0.9, 3.0, 3.0]])
    advantages = torch.tensor([0.4, -0.6])
    token, _ = policy_loss(logprobs, old, advantages, MASK)
    sequence, _ = policy_loss(logprobs, old, advantages, MASK, importance_sampling_level="sequence")
    assert sequence.item() == pytest.approx(token.item(), rel=1e-6)


def test_a_registered_policy_loss_is_selectable_by_name(monkeypatch):
    monkeypatch.setattr(grpo_loss, "_POLICY_LOSSES", dict(grpo_loss._POLICY_LOSSES))

    @register_policy_loss("vanilla_pg")
    def vanilla_pg(logprobs, old_logprobs, advantages, mask, settings):
        return -advantages * logprobs, {}

    assert "vanilla_pg" in policy_loss_names()
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, 0.0, 0.0]])
    loss, _ = policy_loss(logprobs, logprobs, torch.tensor([1.0, 2.0]), MASK, loss_name="vanilla_pg")
    assert loss.item() == pytest.approx((1 + 2 + 3 + 8) / 4)
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("vanilla_pg")(vanilla_pg)
    with pytest.raises(ConfigError, match="vanilla_pg"):
        policy_loss(logprobs, logprobs, torch.ones(2), MASK, loss_name="nope")


def _reference_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.log_softmax(logits.double() / temperature, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_token_logprobs_equal_log_softmax_at_the_tokens(temperature):
    torch.manual_seed(2)
    logits = torch.randn(2, 5, 11) * 3
    tokens = torch.randint(0, 11, (2, 5))
    result = token_logprobs(logits, tokens, temperature)
    assert result.dtype == torch.float32
    torch.testing.assert_close(result.double(), _reference_logprobs(logits, tokens, temperature), atol=1e-5, rtol=0)


def test_token_logprobs_of_bfloat16_logits_are_float32_and_accurate():
    torch.manual_seed(3)
    logits = (torch.randn(2, 4, 300) * 4).to(torch.bfloat16)
    tokens = torch.randint(0, 300, (2, 4))
    result = token_logprobs(logits, tokens)
    assert result.dtype == torch.float32
    torch.testing.assert_close(result.double(), _reference_logprobs(logits.float(), tokens, 1.0), atol=1e-5, rtol=0)


def test_token_logprobs_gradient_matches_autograd_of_log_softmax():
    torch.manual_seed(4)
    logits = torch.randn(2, 3, 7, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 7, (2, 3))
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, tokens, 0.7), (logits,))


def test_token_logprobs_in_small_chunks_match_one_chunk(monkeypatch):
    torch.manual_seed(5)
    logits = torch.randn(2, 7, 13, requires_grad=True)
    tokens = torch.randint(0, 13, (2, 7))
    weights = torch.randn(2, 7)
    whole = token_logprobs(logits, tokens, 0.8)
    (whole_grad,) = torch.autograd.grad((whole * weights).sum(), logits)
    monkeypatch.setattr(grpo_loss, "_CHUNK_ELEMENTS", 13 * 3)  # three rows per chunk: 3 + 3 + 1
    chunked = token_logprobs(logits, tokens, 0.8)
    (chunked_grad,) = torch.autograd.grad((chunked * weights).sum(), logits)
    torch.testing.assert_close(chunked, whole)
    torch.testing.assert_close(chunked_grad, whole_grad)


def test_token_logprobs_reject_mismatched_shapes_and_bad_temperature():
    with pytest.raises(ValueError, match="must be"):
        token_logprobs(torch.zeros(1, 3, 5), torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(torch.zeros(1, 3, 5), torch.zeros(1, 3, dtype=torch.long), temperature=0.0)


def test_entropy_of_uniform_and_peaked_logits(monkeypatch):
    monkeypatch.setattr(grpo_loss, "_CHUNK_ELEMENTS", 16 * 2)
    logits = torch.zeros(2, 3, 16)
    logits[1, :, 0] = 100.0
    entropy = entropy_from_logits(logits)
    torch.testing.assert_close(entropy[0], torch.full((3,), math.log(16)))
    assert (entropy[1] < 1e-6).all()


def test_entropy_temperature_flattens_the_distribution():
    torch.manual_seed(6)
    logits = torch.randn(1, 4, 9)
    probs = torch.softmax(logits / 2.0, dim=-1)
    expected = -(probs * probs.log()).sum(-1)
    torch.testing.assert_close(entropy_from_logits(logits, temperature=2.0), expected)
    assert (entropy_from_logits(logits, temperature=2.0) > entropy_from_logits(logits)).all()


def test_a_huge_gap_to_the_reference_or_the_old_policy_stays_finite_and_bounded():
    """A token the policy finds far less likely than the reference (a stale or FP8-sampled one): k3 of a gap of 89
    overflowed to inf and a gap of 20 gave 5e8; the importance ratio overflowed the same way."""
    from physreason.train.grpo_loss import KL_BOUND

    logprobs = torch.tensor([[-100.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-1.0, -1.0]])
    kl = kl_k3(logprobs, ref)
    assert torch.isfinite(kl).all() and kl[0, 0].item() == KL_BOUND and kl[0, 1].item() == 0.0
    kl.sum().backward()
    assert torch.isfinite(logprobs.grad).all()
    mask = torch.ones(1, 2, dtype=torch.bool)
    old = torch.tensor([[-200.0, -1.0]])  # log-ratio +100: exp overflowed to inf
    for advantage in (1.0, 0.0, -1.0):
        policy = logprobs.detach().clone().requires_grad_(True)
        loss, _ = policy_loss(policy, old, torch.tensor([advantage]), mask, dual_clip=3.0)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(policy.grad).all(), advantage
