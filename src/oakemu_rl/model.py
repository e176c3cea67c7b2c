"""The actor-critic network shared by every stage.

The public API is a contract (see the project's model spec): `PPOModelConfiguration`,
`PPOModel` and `PPOActionBundle`, with `forward`, `get_action_bundle`, `get_logits` and
`get_value(detach_features=...)`, and the attributes `action_shape`, `conv`, `fc`,
`policy_head` and `value_head`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, NamedTuple

import torch
from torch import nn

_ACTIVATIONS: dict[str, type[nn.Module]] = {
    "relu": nn.ReLU,
    "tanh": nn.Tanh,
    "elu": nn.ELU,
    "gelu": nn.GELU,
    "silu": nn.SiLU,
}


@dataclass(frozen=True)
class PPOModelConfiguration:
    """Architecture of `PPOModel`. The defaults are the Nature-DQN trunk used by Atari PPO."""

    conv_layers: tuple[tuple[int, int, int], ...] = ((32, 8, 4), (64, 4, 2), (64, 3, 1))
    """Convolutions as (out_channels, kernel_size, stride), applied in order."""
    fc_hidden: tuple[int, ...] = (512,)
    """Widths of the fully connected layers between the trunk and the heads."""
    activation: str = "relu"
    """Non-linearity after every conv and fc layer: one of relu, tanh, elu, gelu, silu."""
    trunk_gain: float = math.sqrt(2)
    """Orthogonal-init gain of the conv and fc layers."""
    policy_gain: float = 0.01
    """Orthogonal-init gain of the policy head (small: a near-uniform first policy)."""
    value_gain: float = 1.0
    """Orthogonal-init gain of the value head."""

    def __post_init__(self) -> None:
        conv = tuple(tuple(int(v) for v in layer) for layer in self.conv_layers)
        if any(len(layer) != 3 or min(layer) < 1 for layer in conv):
            raise ValueError(
                "conv_layers must be (out_channels, kernel_size, stride) triples of positive "
                f"integers, got {self.conv_layers!r}"
            )
        hidden = tuple(int(v) for v in self.fc_hidden)
        if any(v < 1 for v in hidden):
            raise ValueError(f"fc_hidden widths must be positive, got {self.fc_hidden!r}")
        if self.activation not in _ACTIVATIONS:
            raise ValueError(
                f"unknown activation {self.activation!r}; choose one of {sorted(_ACTIVATIONS)}"
            )
        # Normalise lists (from JSON or a checkpoint) to tuples so configs compare equal.
        object.__setattr__(self, "conv_layers", conv)
        object.__setattr__(self, "fc_hidden", hidden)

    def to_dict(self) -> dict[str, Any]:
        """Plain types only, so the configuration can live inside a weights-only checkpoint."""
        data = asdict(self)
        data["conv_layers"] = [list(layer) for layer in self.conv_layers]
        data["fc_hidden"] = list(self.fc_hidden)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PPOModelConfiguration:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown model configuration keys: {', '.join(unknown)}")
        return cls(**data)


ARCHITECTURES: dict[str, PPOModelConfiguration] = {
    "nature": PPOModelConfiguration(),
    "small": PPOModelConfiguration(conv_layers=((16, 8, 4), (32, 4, 2)), fc_hidden=(256,)),
    "tiny": PPOModelConfiguration(conv_layers=((8, 8, 4), (16, 4, 2)), fc_hidden=(64,)),
}
"""Named configurations: the Nature-DQN default, and smaller ones for quick CPU runs."""


class PPOActionBundle(NamedTuple):
    """What the policy says about a batch of states; every field has shape (batch,)."""

    action: torch.Tensor
    log_prob: torch.Tensor
    entropy: torch.Tensor
    value: torch.Tensor


def _orthogonal(layer: nn.Module, gain: float) -> nn.Module:
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.zeros_(layer.bias)
    return layer


class PPOModel(nn.Module):
    """Actor-critic model for PPO.

    A shared convolutional feature extractor (`conv`, then `fc`) feeds two linear heads:
    `policy_head` gives action logits and `value_head` a scalar state value.
    """

    def __init__(
        self,
        observation_shape: tuple[int, ...],
        action_shape: int,
        model_config: PPOModelConfiguration | None = None,
    ) -> None:
        super().__init__()
        config = model_config or PPOModelConfiguration()
        observation_shape = tuple(int(v) for v in observation_shape)
        if len(observation_shape) != 3 or min(observation_shape) < 1:
            raise ValueError(
                f"observation_shape must be (channels, height, width), got {observation_shape}"
            )
        if int(action_shape) < 1:
            raise ValueError(f"action_shape must be a positive action count, got {action_shape}")
        self.observation_shape = observation_shape
        self.action_shape = int(action_shape)
        self.model_config = config
        activation = _ACTIVATIONS[config.activation]

        conv_layers: list[nn.Module] = []
        channels = observation_shape[0]
        for out_channels, kernel, stride in config.conv_layers:
            conv = nn.Conv2d(channels, out_channels, kernel, stride)
            conv_layers += [_orthogonal(conv, config.trunk_gain), activation()]
            channels = out_channels
        conv_layers.append(nn.Flatten())
        self.conv = nn.Sequential(*conv_layers)

        with torch.no_grad():
            try:
                flat = self.conv(torch.zeros(1, *observation_shape)).shape[1]
            except RuntimeError as error:
                raise ValueError(
                    f"the conv layers {config.conv_layers} do not fit observations of shape "
                    f"{observation_shape}: {error}"
                ) from None

        fc_layers: list[nn.Module] = []
        in_features = flat
        for width in config.fc_hidden:
            fc_layers += [_orthogonal(nn.Linear(in_features, width), config.trunk_gain),
                          activation()]
            in_features = width
        self.fc = nn.Sequential(*fc_layers)

        self.policy_head = _orthogonal(nn.Linear(in_features, self.action_shape),
                                       config.policy_gain)
        self.value_head = _orthogonal(nn.Linear(in_features, 1), config.value_gain)

    # -- features -----------------------------------------------------------------------

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The shared trunk's output, (batch, fc width): what both heads read. Critic
        calibration fits the value head on these with the trunk frozen."""
        first = self.conv[0]
        if (x.dim() == 4 and isinstance(first, nn.Conv2d)
                and first.weight.is_contiguous(memory_format=torch.channels_last)):
            # A model moved to channels-last (PPO training on CPU does) gets its frames in
            # the same layout, so no convolution has to reorder them (~10% per step).
            x = x.contiguous(memory_format=torch.channels_last)
        if x.dtype == torch.uint8:
            # Frames arrive as stored; scaling here keeps rollouts and demos in uint8.
            x = x.float().div_(255.0)
        return self.fc(self.conv(x))

    # -- contract -----------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (action_logits (batch, actions), values (batch, 1))."""
        features = self.features(x)
        return self.policy_head(features), self.value_head(features)

    def get_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Action logits only, shape (batch, actions); used for greedy play and ONNX export."""
        return self.policy_head(self.features(x))

    def get_value(self, x: torch.Tensor, *, detach_features: bool = False) -> torch.Tensor:
        """State values, shape (batch,).

        With `detach_features=True` the trunk's output is detached, so a loss on the value
        reaches only `value_head`: critic calibration cannot reshape what BC imprinted.
        """
        features = self.features(x)
        if detach_features:
            features = features.detach()
        return self.value_head(features).squeeze(-1)

    def get_action_bundle(
        self,
        x: torch.Tensor,
        action: torch.Tensor | None = None,
        action_mask: torch.Tensor | None = None,
    ) -> PPOActionBundle:
        """Sample actions (or score the given ones) with log-probs, entropy and values.

        `action_mask` is a bool tensor of shape (actions,), True where an action is allowed:
        masked actions are never sampled and the entropy covers allowed actions only.
        """
        logits, value = self.forward(x)
        logits = self.masked_logits(logits, action_mask)
        log_probs = torch.log_softmax(logits, dim=-1)
        entropy = masked_entropy(log_probs)
        if action is None:
            action = torch.multinomial(log_probs.exp(), 1).squeeze(-1)
        else:
            action = action.to(device=logits.device).long().reshape(-1)
            if action.shape[0] != logits.shape[0]:
                raise ValueError(
                    f"action has {action.shape[0]} entries for a batch of {logits.shape[0]}"
                )
            if bool(((action < 0) | (action >= self.action_shape)).any()):
                raise ValueError(f"action out of range 0..{self.action_shape - 1}")
            if action_mask is not None and not bool(action_mask.to(logits.device)[action].all()):
                raise ValueError("cannot score an action that the action mask forbids")
        log_prob = log_probs.gather(-1, action.unsqueeze(-1)).squeeze(-1)
        return PPOActionBundle(action, log_prob, entropy, value.squeeze(-1))

    # -- helpers ------------------------------------------------------------------------

    def masked_logits(
        self, logits: torch.Tensor, action_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Logits with forbidden actions pushed to the dtype's lowest value."""
        if action_mask is None:
            return logits
        mask = check_action_mask(action_mask, self.action_shape).to(logits.device)
        return mask_logits(logits, mask)


def mask_logits(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Logits with the actions `mask` forbids pushed to the dtype's lowest value, so a
    softmax gives them probability 0 and an argmax never picks them."""
    return logits.masked_fill(~mask, torch.finfo(logits.dtype).min)


def masked_log_softmax(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Log-probabilities over the allowed actions (forbidden ones are hugely negative)."""
    return torch.log_softmax(mask_logits(logits, mask), dim=-1)


def masked_entropy(log_probs: torch.Tensor) -> torch.Tensor:
    """Entropy of each row of log-probabilities. Forbidden actions have probability 0:
    they are left out rather than multiplying 0 by a huge negative number."""
    probs = log_probs.exp()
    return -torch.where(probs > 0, probs * log_probs, torch.zeros_like(probs)).sum(-1)


def check_action_mask(action_mask: torch.Tensor, action_count: int) -> torch.Tensor:
    """Validate a mask (bool, shape (actions,), at least one True) and return it."""
    mask = torch.as_tensor(action_mask)
    if mask.dtype != torch.bool:
        raise ValueError(f"action_mask must be a bool tensor, got dtype {mask.dtype}")
    if mask.shape != (action_count,):
        raise ValueError(
            f"action_mask must have shape ({action_count},), got {tuple(mask.shape)}"
        )
    if not bool(mask.any()):
        raise ValueError("action_mask forbids every action; at least one must be allowed")
    return mask


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def mixed_features(model: PPOModel, x: torch.Tensor, dtype: torch.dtype | None
                   ) -> torch.Tensor:
    """`model.features(x)` as fp32, with the trunk under autocast to `dtype` (None: plain
    fp32). Only the trunk, where the convolutions spend the time, runs in the lower
    precision: the heads read these fp32 features and compute fp32 logits and values, so
    the log-probabilities whose ratios PPO clips carry no rounding of their own."""
    if dtype is None:
        return model.features(x)
    with torch.autocast(x.device.type, dtype=dtype):
        features = model.features(x)
    return features.float()


def mixed_forward(
    model: PPOModel, x: torch.Tensor, dtype: torch.dtype | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`model(x)` with the trunk under autocast, as in `mixed_features`."""
    features = mixed_features(model, x, dtype)
    return model.policy_head(features), model.value_head(features)


def mixed_logits(model: PPOModel, x: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """`model.get_logits(x)` with the trunk under autocast, as in `mixed_features`."""
    return model.policy_head(mixed_features(model, x, dtype))
