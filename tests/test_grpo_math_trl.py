"""Our GRPO math equals TRL's on identical tensors (TRL is a test-only dependency; skipped when absent).

What of TRL runs: a real ``trl.GRPOTrainer`` (trl 1.16) is built on the tiny Qwen2 model, then

- the loss: ``GRPOTrainer._compute_loss(model, inputs)`` itself, with only the instance's
  ``_get_per_token_logps_and_entropies`` replaced by one that returns our chosen log-probs, so
  TRL's ratio, clipping, k3 KL, aggregation per ``loss_type`` and clip metrics all run as shipped.
  The settings it reads (``loss_type``, ``beta``, ``epsilon_low/high``,
  ``importance_sampling_level``, ``max_completion_length``, ``args.use_bias_correction_kl``, True
  by default in TRL 1.16) are set on the instance between cases, which is where its ``__init__``
  stores them; gradient accumulation is 1.
- the advantages: ``GRPOTrainer._generate_and_score_completions`` itself, generating with the tiny
  model and scoring with a reward function that returns the rewards we chose, so TRL's group
  mean, ``scale_rewards`` std (its ``nanstd``, Bessel-corrected) and ``+ 1e-4`` run as shipped.
- ``trl.trainer.utils.selective_log_softmax`` and ``entropy_from_logits`` for token log-probs.
- end to end on the model: ``_compute_loss`` with TRL's own forward of left-padded prompts and right-padded
  completions (its fused log-prob head) against physreason's packed policy rows (a prompt once, then its
  completions) and ``policy_loss``: the loss and the gradient of every parameter.

Mapping of names: TRL ``grpo`` = our ``seq-mean-token-mean``; ``bnpo`` and ``dapo`` (one process)
= ``token-mean``; ``dr_grpo`` = ``seq-mean-token-sum-norm`` with norm_length = max_completion_length.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

from physreason.train.grpo_advantages import compute_group_advantages
from physreason.train.grpo_loss import entropy_from_logits, policy_loss, token_logprobs

pytestmark = pytest.mark.slow  # importing TRL and building its trainer takes ~7 s on 2 cores

GROUP = 4
MAX_COMPLETION = 6
TRL_ADVANTAGE_EPS = 1e-4  # TRL adds this constant to the std


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from physreason.models.tiny import save_tiny_model

    folder = save_tiny_model("qwen2", tmp_path_factory.mktemp("trl-tiny-qwen2"))

    def chosen_reward(completions, target, **kwargs):
        return [float(value) for value in target]

    args = GRPOConfig(
        output_dir=str(tmp_path_factory.mktemp("trl-out")),
        per_device_train_batch_size=2 * GROUP,
        num_generations=GROUP,
        max_completion_length=MAX_COMPLETION,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
    )
    dataset = Dataset.from_dict({"prompt": ["a ball rolls"] * (2 * GROUP), "target": [0.0] * (2 * GROUP)})
    built = GRPOTrainer(model=str(folder), reward_funcs=chosen_reward, args=args, train_dataset=dataset)
    built.model.train()
    built.current_gradient_accumulation_steps = 1
    return built


def _batch(seed: int) -> dict[str, torch.Tensor]:
    """Log-probs near the old ones (some ratios past the clip range), padded masks, group advantages."""
    generator = torch.Generator().manual_seed(seed)
    batch, length = 2 * GROUP, MAX_COMPLETION
    old = -torch.rand(batch, length, generator=generator) * 3  # [B, T]
    logprobs = old + 0.25 * torch.randn(batch, length, generator=generator)
    ref = old + 0.3 * torch.randn(batch, length, generator=generator)
    lengths = torch.tensor([6, 3, 1, 5, 6, 2, 4, 6])
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()  # [B, T]
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.2, 0.9, 0.1])
    advantages = compute_group_advantages(rewards, GROUP, "grpo", eps=TRL_ADVANTAGE_EPS)  # [B]
    return {"old": old, "logprobs": logprobs, "ref": ref, "mask": mask, "advantages": advantages}


def _trl_loss(trainer, tensors, *, loss_type, beta, epsilon_low, epsilon_high, level="token", kl_correction=False):
    """TRL's own _compute_loss on our tensors; returns (loss, d loss / d logprobs, TRL's logged metrics)."""
    trainer.args.use_bias_correction_kl = kl_correction
    trainer.loss_type = loss_type
    trainer.beta = beta
    trainer.epsilon_low, trainer.epsilon_high = epsilon_low, epsilon_high
    trainer.importance_sampling_level = level
    trainer.max_completion_length = MAX_COMPLETION
    trainer._metrics["train"].clear()
    logprobs = tensors["logprobs"].clone().requires_grad_(True)
    entropies = torch.zeros_like(logprobs)
    trainer._get_per_token_logps_and_entropies = lambda *args, **kwargs: (logprobs, entropies, None)
    batch = logprobs.shape[0]
    inputs = {
        "prompt_ids": torch.ones(batch, 2, dtype=torch.long),
        "prompt_mask": torch.ones(batch, 2, dtype=torch.long),
        "completion_ids": torch.ones(batch, MAX_COMPLETION, dtype=torch.long),
        "completion_mask": tensors["mask"],
        "advantages": tensors["advantages"],
        "old_per_token_logps": tensors["old"],
        "ref_per_token_logps": tensors["ref"],
        "num_items_in_batch": tensors["mask"].sum(),
    }
    loss = trainer._compute_loss(trainer.model, inputs)
    (grad,) = torch.autograd.grad(loss, logprobs)
    metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    return loss.detach(), grad, metrics


def _our_loss(
    tensors, *, agg_mode, beta, epsilon_low, epsilon_high, level="token", kl_correction=False, norm_length=None
):
    logprobs = tensors["logprobs"].clone().requires_grad_(True)
    loss, metrics = policy_loss(
        logprobs,
        tensors["old"],
        tensors["advantages"],
        tensors["mask"],
        epsilon_low,
        epsilon_high,
        None,
        agg_mode,
        norm_length=norm_length,
        kl_beta=beta,
        ref_logprobs=tensors["ref"] if beta > 0 else None,
        kl_importance_correction=kl_correction,
        importance_sampling_level=level,
    )
    (grad,) = torch.autograd.grad(loss, logprobs)
    return loss.detach(), grad, metrics


CASES = [
    # (TRL loss_type, our agg_mode, beta, epsilon_low, epsilon_high, importance_sampling_level, KL correction)
    ("grpo", "seq-mean-token-mean", 0.0, 0.2, 0.2, "token", False),
    ("grpo", "seq-mean-token-mean", 0.04, 0.2, 0.28, "token", False),
    ("grpo", "seq-mean-token-mean", 0.04, 0.2, 0.28, "token", True),
    ("bnpo", "token-mean", 0.0, 0.2, 0.28, "token", False),
    ("bnpo", "token-mean", 0.04, 0.1, 0.3, "token", False),
    ("dapo", "token-mean", 0.04, 0.2, 0.28, "token", True),
    ("dr_grpo", "seq-mean-token-sum-norm", 0.0, 0.2, 0.2, "token", False),
    ("dr_grpo", "seq-mean-token-sum-norm", 0.04, 0.2, 0.28, "token", False),
    ("grpo", "seq-mean-token-mean", 0.0, 3e-4, 4e-4, "sequence", False),
]


@pytest.mark.parametrize(("loss_type", "agg_mode", "beta", "eps_low", "eps_high", "level", "kl_correction"), CASES)
def test_policy_loss_value_gradient_and_clip_metrics_equal_trl(
    trainer, loss_type, agg_mode, beta, eps_low, eps_high, level, kl_correction
):
    tensors = _batch(seed=len(loss_type) + int(beta * 100))
    settings = {
        "beta": beta,
        "epsilon_low": eps_low,
        "epsilon_high": eps_high,
        "level": level,
        "kl_correction": kl_correction,
    }
    trl_loss, trl_grad, trl_metrics = _trl_loss(trainer, tensors, loss_type=loss_type, **settings)
    norm_length = MAX_COMPLETION if agg_mode == "seq-mean-token-sum-norm" else None
    loss, grad, metrics = _our_loss(tensors, agg_mode=agg_mode, norm_length=norm_length, **settings)

    torch.testing.assert_close(loss, trl_loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, trl_grad, rtol=1e-5, atol=1e-7)
    if beta > 0:
        assert metrics["kl_ref"].item() == pytest.approx(trl_metrics["kl"], rel=1e-5)
    if level == "sequence":
        # TRL counts clipped sequences there; we count the tokens whose gradient the clip removed.
        return
    assert metrics["clip_frac_low"].item() == pytest.approx(trl_metrics["clip_ratio/low_mean"], abs=1e-7)
    assert metrics["clip_frac_high"].item() == pytest.approx(trl_metrics["clip_ratio/high_mean"], abs=1e-7)
    # The batch must exercise the clip, or equality would prove little about it.
    assert metrics["clip_frac_low"] + metrics["clip_frac_high"] > 0


@pytest.mark.parametrize(("scale_rewards", "mode"), [("group", "grpo"), ("none", "drgrpo")])
def test_group_advantages_equal_trl_scale_rewards(trainer, scale_rewards, mode):
    trainer.scale_rewards = scale_rewards
    rewards = [1.0, 0.0, 0.0, 1.0, 0.5, 0.2, 0.9, 0.9]
    scored = trainer._generate_and_score_completions([{"prompt": "a ball rolls", "target": r} for r in rewards])
    ours = compute_group_advantages(torch.tensor(rewards), GROUP, mode, eps=TRL_ADVANTAGE_EPS)
    torch.testing.assert_close(ours, scored["advantages"], rtol=1e-6, atol=1e-6)


def test_all_equal_group_gives_zero_advantages_like_trl(trainer):
    trainer.scale_rewards = "group"
    rewards = [0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    scored = trainer._generate_and_score_completions([{"prompt": "a ball rolls", "target": r} for r in rewards])
    ours = compute_group_advantages(torch.tensor(rewards), GROUP, "grpo", eps=TRL_ADVANTAGE_EPS)
    assert torch.equal(ours, torch.zeros(8))
    torch.testing.assert_close(scored["advantages"], ours)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_and_entropy_equal_trl_utils(temperature):
    from trl.trainer.utils import entropy_from_logits as trl_entropy
    from trl.trainer.utils import selective_log_softmax

    torch.manual_seed(7)
    logits = torch.randn(3, 5, 64) * 2
    tokens = torch.randint(0, 64, (3, 5))
    expected = selective_log_softmax(logits, tokens, temperature=temperature)
    torch.testing.assert_close(token_logprobs(logits, tokens, temperature), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(entropy_from_logits(logits / temperature), trl_entropy(logits / temperature))


def test_packed_policy_loss_and_gradients_equal_trls_own_forward(trainer, monkeypatch):
    """TRL's _compute_loss with its own padded forward of the model vs physreason's packed rows + policy_loss."""
    import contextlib

    from physreason.engines import Completion
    from physreason.train.policy import PolicyScorer, build_completion_batch
    from physreason.train.rollout import RolloutSample

    # Earlier cases put a stand-in for the log-prob forward on the instance: TRL's own method runs here.
    monkeypatch.delitem(trainer.__dict__, "_get_per_token_logps_and_entropies", raising=False)
    # GRPOConfig defaults to bf16, which TRL applies as CPU autocast around its forward: both sides run float32 here.
    monkeypatch.setattr(trainer.accelerator, "autocast", lambda *args, **kwargs: contextlib.nullcontext())
    for name, value in (("loss_type", "dapo"), ("beta", 0.0), ("epsilon_low", 0.2), ("epsilon_high", 0.28),
                        ("importance_sampling_level", "token"), ("temperature", 1.0)):
        monkeypatch.setattr(trainer, name, value)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 400, (5,), generator=generator).tolist(),
               torch.randint(5, 400, (8,), generator=generator).tolist()]
    lengths = [6, 3, 1, 5, 6, 2, 4, 6]
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.2, 0.9, 0.1])
    advantages = compute_group_advantages(rewards, GROUP, "grpo", eps=TRL_ADVANTAGE_EPS)  # [B]
    samples = []
    for index, length in enumerate(lengths):
        tokens = torch.randint(5, 400, (length,), generator=generator).tolist()
        samples.append(RolloutSample(index // GROUP, None, prompts[index // GROUP],
                                     Completion("-", tokens, [0.0] * length, "length"), {}, None,
                                     float(advantages[index])))
    model = trainer.model

    # TRL: left-padded prompts, right-padded completions, as _generate_and_score_completions lays them out.
    pad = 0
    width = max(len(p) for p in prompts)
    prompt_ids = torch.tensor([[pad] * (width - len(s.prompt_ids)) + s.prompt_ids for s in samples])
    prompt_mask = (torch.arange(width)[None] >= torch.tensor([width - len(s.prompt_ids) for s in samples])[:, None])
    completion_ids = torch.tensor([s.completion.token_ids + [pad] * (MAX_COMPLETION - n)
                                   for s, n in zip(samples, lengths, strict=True)])
    completion_mask = (torch.arange(MAX_COMPLETION)[None] < torch.tensor(lengths)[:, None]).long()
    inputs = {
        "prompt_ids": prompt_ids, "prompt_mask": prompt_mask.long(), "completion_ids": completion_ids,
        "completion_mask": completion_mask, "advantages": advantages, "old_per_token_logps": None,
        "num_items_in_batch": completion_mask.sum(),
    }
    model.zero_grad(set_to_none=True)
    trl_loss = trainer._compute_loss(model, inputs)
    trl_loss.backward()
    trl_grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    model.zero_grad(set_to_none=True)
    batch = build_completion_batch(samples, pad, None, pack=True)
    assert batch.model_batch.input_ids.shape[0] == 2  # one packed row per prompt
    logprobs = PolicyScorer(model)(batch, 1.0).logprobs  # [B, T]
    loss, _ = policy_loss(logprobs, logprobs.detach(), batch.advantages, batch.mask, 0.2, 0.28, None, "token-mean")
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    torch.testing.assert_close(loss.detach(), trl_loss.detach(), rtol=1e-5, atol=1e-7)
    assert set(grads) == set(trl_grads) and grads
    for name, trl_grad in trl_grads.items():
        scale = float(trl_grad.abs().max()) + 1e-12
        assert float((grads[name] - trl_grad).abs().max()) <= 1e-4 * scale, name
