"""The PPOModel contract: shapes, dtypes, masking, gradient isolation."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from oakemu_rl import PPOActionBundle, PPOModel, PPOModelConfiguration

OBS = (4, 84, 84)
ACTIONS = 6


@pytest.fixture(scope="module")
def model() -> PPOModel:
    torch.manual_seed(0)
    return PPOModel(OBS, ACTIONS)


def frames(batch: int = 3, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, *OBS), generator=g, dtype=torch.uint8)


def test_attributes_and_default_architecture(model: PPOModel) -> None:
    assert model.action_shape == ACTIONS
    assert isinstance(model.conv, nn.Sequential) and isinstance(model.fc, nn.Sequential)
    assert isinstance(model.policy_head, nn.Linear) and isinstance(model.value_head, nn.Linear)
    assert model.policy_head.in_features == model.value_head.in_features == 512
    assert model.policy_head.out_features == ACTIONS and model.value_head.out_features == 1
    convs = [m for m in model.conv if isinstance(m, nn.Conv2d)]
    assert [(c.out_channels, c.kernel_size[0], c.stride[0]) for c in convs] == [
        (32, 8, 4), (64, 4, 2), (64, 3, 1)
    ]
    linear = [m for m in model.fc if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linear] == [(3136, 512)]
    # Nature-DQN size: 1.68M parameters for 6 actions.
    assert sum(p.numel() for p in model.parameters()) == 1_687_719


def test_orthogonal_init_gains() -> None:
    torch.manual_seed(1)
    m = PPOModel(OBS, ACTIONS)
    # An orthogonal matrix scaled by g has singular values all equal to g.
    for layer, gain in [(m.policy_head, 0.01), (m.value_head, 1.0), (m.fc[0], math.sqrt(2))]:
        s = torch.linalg.svdvals(layer.weight.detach())
        assert torch.allclose(s, torch.full_like(s, gain), rtol=1e-4), layer
        assert torch.count_nonzero(layer.bias) == 0
    # A small policy gain means a near-uniform first policy.
    logits = m.get_logits(frames())
    assert logits.abs().max() < 0.5


def test_forward_shapes_and_agreement(model: PPOModel) -> None:
    x = frames(5)
    logits, values = model(x)
    assert logits.shape == (5, ACTIONS) and values.shape == (5, 1)
    assert logits.dtype == values.dtype == torch.float32
    assert torch.allclose(model.get_logits(x), logits)
    assert torch.allclose(model.get_value(x), values.squeeze(-1))
    assert model.get_value(x).shape == (5,)
    bundle = model.get_action_bundle(x)
    assert isinstance(bundle, PPOActionBundle)
    for field in ("action", "log_prob", "entropy", "value"):
        assert getattr(bundle, field).shape == (5,)
    assert torch.allclose(bundle.value, values.squeeze(-1))


def test_uint8_is_scaled_and_float_taken_as_is(model: PPOModel) -> None:
    x = frames(2)
    scaled = x.float() / 255.0
    assert torch.allclose(model.get_logits(x), model.get_logits(scaled), atol=1e-6)
    # Float input is not rescaled: feeding 0..255 floats gives a different answer.
    assert not torch.allclose(model.get_logits(x.float()), model.get_logits(scaled))


def test_scoring_given_actions_matches_log_softmax(model: PPOModel) -> None:
    x = frames(4)
    actions = torch.tensor([0, 5, 2, 3])
    bundle = model.get_action_bundle(x, action=actions)
    assert torch.equal(bundle.action, actions)
    log_probs = torch.log_softmax(model.get_logits(x), -1)
    assert torch.allclose(bundle.log_prob, log_probs[torch.arange(4), actions], atol=1e-6)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    assert torch.allclose(bundle.entropy, entropy, atol=1e-6)


def test_masked_actions_are_never_sampled() -> None:
    torch.manual_seed(0)
    m = PPOModel(OBS, ACTIONS)
    with torch.no_grad():
        m.policy_head.bias.copy_(torch.tensor([0.0, 50.0, 0.0, 0.0, 50.0, 50.0]))
    mask = torch.tensor([True, False, True, True, False, False])
    x = frames(64)
    for _ in range(5):
        bundle = m.get_action_bundle(x, action_mask=mask)
        assert mask[bundle.action].all()
    # Without the mask the favoured (forbidden) actions dominate.
    assert (~mask[m.get_action_bundle(x).action]).float().mean() > 0.9


def test_masked_entropy_covers_allowed_actions_only() -> None:
    m = PPOModel(OBS, ACTIONS)
    with torch.no_grad():
        m.policy_head.weight.zero_()
        m.policy_head.bias.zero_()
    mask = torch.tensor([True, True, False, False, False, True])
    bundle = m.get_action_bundle(frames(3), action_mask=mask)
    assert torch.allclose(bundle.entropy, torch.full((3,), math.log(3)), atol=1e-6)
    assert torch.allclose(bundle.log_prob, torch.full((3,), -math.log(3)), atol=1e-6)
    assert torch.isfinite(bundle.entropy).all()


def test_masked_entropy_gradient_is_finite() -> None:
    m = PPOModel(OBS, ACTIONS)
    mask = torch.tensor([True, False, True, False, True, True])
    bundle = m.get_action_bundle(frames(3), action=torch.tensor([0, 2, 5]), action_mask=mask)
    (bundle.entropy.sum() + bundle.log_prob.sum()).backward()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)


def test_mask_errors(model: PPOModel) -> None:
    x = frames(2)
    mask = torch.tensor([True, False, True, True, True, True])
    with pytest.raises(ValueError, match="forbids"):
        model.get_action_bundle(x, action=torch.tensor([1, 0]), action_mask=mask)
    with pytest.raises(ValueError, match="every action"):
        model.get_action_bundle(x, action_mask=torch.zeros(ACTIONS, dtype=torch.bool))
    with pytest.raises(ValueError, match="bool"):
        model.get_action_bundle(x, action_mask=torch.ones(ACTIONS))
    with pytest.raises(ValueError, match="shape"):
        model.get_action_bundle(x, action_mask=torch.ones(ACTIONS + 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="out of range"):
        model.get_action_bundle(x, action=torch.tensor([0, ACTIONS]))


def test_detach_features_isolates_the_value_head() -> None:
    m = PPOModel(OBS, ACTIONS)
    m.get_value(frames(), detach_features=True).pow(2).sum().backward()
    for name, p in m.named_parameters():
        if name.startswith("value_head"):
            assert p.grad is not None and p.grad.abs().sum() > 0
        else:
            assert p.grad is None, name
    m.zero_grad(set_to_none=True)
    m.get_value(frames()).pow(2).sum().backward()
    assert m.conv[0].weight.grad is not None and m.conv[0].weight.grad.abs().sum() > 0
    assert m.policy_head.weight.grad is None


def test_detached_value_equals_attached_value(model: PPOModel) -> None:
    x = frames()
    assert torch.equal(model.get_value(x, detach_features=True), model.get_value(x))


def test_custom_configuration() -> None:
    config = PPOModelConfiguration(
        conv_layers=((16, 8, 4), (32, 4, 2)), fc_hidden=(256, 128), activation="tanh",
        policy_gain=0.1,
    )
    m = PPOModel((2, 64, 64), 4, config)
    assert m.policy_head.in_features == 128
    logits, values = m(torch.zeros(1, 2, 64, 64, dtype=torch.uint8))
    assert logits.shape == (1, 4) and values.shape == (1, 1)
    assert any(isinstance(layer, nn.Tanh) for layer in m.fc)
    assert PPOModelConfiguration.from_dict(config.to_dict()) == config


def test_configuration_errors() -> None:
    with pytest.raises(ValueError, match="activation"):
        PPOModelConfiguration(activation="swish9")
    with pytest.raises(ValueError, match="conv_layers"):
        PPOModelConfiguration(conv_layers=((32, 8),))
    with pytest.raises(ValueError, match="unknown model configuration keys"):
        PPOModelConfiguration.from_dict({"depth": 3})
    with pytest.raises(ValueError, match="do not fit"):
        PPOModel((4, 16, 16), 6)
    with pytest.raises(ValueError, match="channels, height, width"):
        PPOModel((84, 84), 6)
