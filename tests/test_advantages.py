"""gae, discounted_returns and explained_variance against numbers worked out by hand.

One rollout of T=4 steps in N=2 envs, γ = 0.5 so the arithmetic stays exact:

env 0: rewards 1, 0, 2, 1; values 1, 2, 3, 4; next_values 2, 99, 4, 8;
       terminated after t=1 (the 99 is the next episode's value and must be ignored).
env 1: rewards 0, 1, 1, 0; values 2, 2, 2, 2; next_values 2, 2, 10, 6;
       truncated after t=2 (10 is V(final observation): bootstrap from it); the rollout
       ends at t=3 with the episode going on (bootstrap from next_values[3] = 6).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from oakemu_rl.rl.returns import discounted_returns, explained_variance, gae

GAMMA = 0.5

REWARDS = [[1, 0], [0, 1], [2, 1], [1, 0]]
VALUES = [[1, 2], [2, 2], [3, 2], [4, 2]]
NEXT_VALUES = [[2, 2], [99, 2], [4, 10], [8, 6]]
TERMINATIONS = [[False, False], [True, False], [False, False], [False, False]]
TRUNCATIONS = [[False, False], [False, False], [False, True], [False, False]]

# One-step TD errors δ_t = r_t + γ·V(s_{t+1})·(1 - terminated_t) - V(s_t):
# env 0: δ0 = 1 + 0.5·2 - 1 = 1;  δ1 = 0 + 0 - 2 = -2 (terminated: 99 ignored);
#        δ2 = 2 + 0.5·4 - 3 = 1;  δ3 = 1 + 0.5·8 - 4 = 1 (rollout end bootstraps from 8)
# env 1: δ0 = 0 + 0.5·2 - 2 = -1; δ1 = 1 + 0.5·2 - 2 = 0;
#        δ2 = 1 + 0.5·10 - 2 = 4 (truncated: bootstraps from V(final) = 10);
#        δ3 = 0 + 0.5·6 - 2 = 1
DELTAS = [[1, -1], [-2, 0], [1, 4], [1, 1]]

# λ = 0.5, so γλ = 0.25; A_t = δ_t + γλ·(1 - done_t)·A_{t+1}, done = terminated | truncated.
# env 0: A3 = 1; A2 = 1 + 0.25·1 = 1.25; A1 = -2 (done); A0 = 1 + 0.25·(-2) = 0.5
# env 1: A3 = 1; A2 = 4 (done); A1 = 0 + 0.25·4 = 1; A0 = -1 + 0.25·1 = -0.75
ADV_HALF = [[0.5, -0.75], [-2, 1], [1.25, 4], [1, 1]]
# returns = A + V: env 0: 1.5, 0, 4.25, 5; env 1: 1.25, 3, 6, 3
RET_HALF = [[1.5, 1.25], [0, 3], [4.25, 6], [5, 3]]

# λ = 0: A = δ, returns = r + γ·V(s_{t+1})·(1 - terminated):
# env 0: 1 + 1 = 2, 0 + 0 = 0, 2 + 2 = 4, 1 + 4 = 5
# env 1: 0 + 1 = 1, 1 + 1 = 2, 1 + 5 = 6, 0 + 3 = 3
RET_ZERO = [[2, 1], [0, 2], [4, 6], [5, 3]]

# λ = 1, γλ = 0.5: env 0: A3 = 1, A2 = 1 + 0.5·1 = 1.5, A1 = -2, A0 = 1 + 0.5·(-2) = 0
#                  env 1: A3 = 1, A2 = 4, A1 = 0 + 0.5·4 = 2, A0 = -1 + 0.5·2 = 0
# returns = A + V: env 0: 1, 0, 4.5, 5; env 1: 2, 4, 6, 3. As Monte-Carlo sums:
# env 0: G3 = 1 + 0.5·8 = 5, G2 = 2 + 0.5·5 = 4.5, G1 = 0 (terminated), G0 = 1 + 0.5·0 = 1
# env 1: G3 = 0 + 0.5·6 = 3, G2 = 1 + 0.5·10 = 6 (truncated: V(final), not G3),
#        G1 = 1 + 0.5·6 = 4, G0 = 0 + 0.5·4 = 2
RET_ONE = [[1, 2], [0, 4], [4.5, 6], [5, 3]]


def _inputs(kind: str):
    arrays = {
        "rewards": np.array(REWARDS, np.float32),
        "values": np.array(VALUES, np.float32),
        "next_values": np.array(NEXT_VALUES, np.float32),
        "terminations": np.array(TERMINATIONS, bool),
        "truncations": np.array(TRUNCATIONS, bool),
    }
    if kind == "torch":
        return {k: torch.from_numpy(v) for k, v in arrays.items()}
    return arrays


def _td(inputs, lam: float):
    return gae(inputs["rewards"], inputs["values"], inputs["next_values"],
               inputs["terminations"], inputs["truncations"], GAMMA, lam)


def _mc(inputs):
    return discounted_returns(inputs["rewards"], inputs["terminations"], inputs["truncations"],
                              inputs["next_values"], GAMMA)


def _close(actual, expected) -> None:
    actual = actual.numpy() if isinstance(actual, torch.Tensor) else actual
    np.testing.assert_allclose(actual, np.array(expected, np.float32), rtol=0, atol=1e-6)


KINDS = ["numpy", "torch"]


@pytest.mark.parametrize("kind", KINDS)
def test_gae_hand_computed(kind: str) -> None:
    inputs = _inputs(kind)
    advantages, returns = _td(inputs, 0.5)
    assert type(advantages) is type(inputs["rewards"])
    assert advantages.shape == (4, 2) and returns.shape == (4, 2)
    _close(advantages, ADV_HALF)
    _close(returns, RET_HALF)


@pytest.mark.parametrize("kind", KINDS)
def test_lambda_zero_is_one_step_td(kind: str) -> None:
    inputs = _inputs(kind)
    advantages, returns = _td(inputs, 0.0)
    _close(advantages, DELTAS)
    _close(returns, RET_ZERO)


@pytest.mark.parametrize("kind", KINDS)
def test_lambda_one_equals_discounted_returns(kind: str) -> None:
    inputs = _inputs(kind)
    _, returns = _td(inputs, 1.0)
    _close(returns, RET_ONE)
    mc = _mc(inputs)
    assert type(mc) is type(inputs["rewards"])
    _close(mc, RET_ONE)


@pytest.mark.parametrize("kind", KINDS)
def test_value_after_a_termination_is_ignored(kind: str) -> None:
    inputs = _inputs(kind)
    base_td = _td(inputs, 0.5)[1]
    base_mc = _mc(inputs)
    inputs["next_values"][1, 0] = -1000.0  # the value after env 0's terminal step
    _close(_td(inputs, 0.5)[1], np.asarray(base_td))
    _close(_mc(inputs), np.asarray(base_mc))


@pytest.mark.parametrize("kind", KINDS)
def test_truncation_bootstraps_from_next_values(kind: str) -> None:
    inputs = _inputs(kind)
    inputs["next_values"][2, 1] = 20.0  # V(final obs) of env 1's truncated step: 10 -> 20
    # MC: G2 = 1 + 0.5·20 = 11, G1 = 1 + 0.5·11 = 6.5, G0 = 0 + 0.5·6.5 = 3.25; G3 unchanged.
    _close(_mc(inputs)[:, 1], [3.25, 6.5, 11, 3])
    # TD(0.5): δ2 = 1 + 0.5·20 - 2 = 9, A2 = 9, A1 = 0 + 0.25·9 = 2.25,
    # A0 = -1 + 0.25·2.25 = -0.4375; returns = A + 2: 1.5625, 4.25, 11, 3
    _close(_td(inputs, 0.5)[1][:, 1], [1.5625, 4.25, 11, 3])


@pytest.mark.parametrize("kind", KINDS)
def test_rollout_end_bootstraps_from_next_values(kind: str) -> None:
    inputs = _inputs(kind)
    inputs["next_values"][3, 0] = 0.0  # env 0 at the rollout's end: 8 -> 0
    # MC: G3 = 1 + 0 = 1, G2 = 2 + 0.5·1 = 2.5; G1, G0 are past the termination: 0, 1.
    _close(_mc(inputs)[:, 0], [1, 0, 2.5, 1])
    # TD(0.5): δ3 = 1 + 0 - 4 = -3, A3 = -3, A2 = 1 + 0.25·(-3) = 0.25; returns 4+(-3), 3+0.25
    _close(_td(inputs, 0.5)[1][:, 0], [1.5, 0, 3.25, 1])


@pytest.mark.parametrize("kind", KINDS)
def test_discounted_returns_without_bootstrap(kind: str) -> None:
    # One env, γ = 0.9, rewards 1, 2, 3, terminated at the end: G2 = 3,
    # G1 = 2 + 0.9·3 = 4.7, G0 = 1 + 0.9·4.7 = 5.23. The bootstrap is ignored (terminated).
    rewards = np.array([[1], [2], [3]], np.float32)
    terms = np.array([[False], [False], [True]])
    truncs = np.zeros_like(terms)
    bootstrap = np.full((3, 1), 50.0, np.float32)
    if kind == "torch":
        rewards, terms, truncs, bootstrap = map(torch.from_numpy,
                                                (rewards, terms, truncs, bootstrap))
    _close(discounted_returns(rewards, terms, truncs, bootstrap, 0.9), [[5.23], [4.7], [3]])


def test_numpy_and_torch_agree() -> None:
    for lam in (0.0, 0.5, 0.95, 1.0):
        a_np, r_np = _td(_inputs("numpy"), lam)
        a_t, r_t = _td(_inputs("torch"), lam)
        np.testing.assert_allclose(a_np, a_t.numpy(), atol=1e-6)
        np.testing.assert_allclose(r_np, r_t.numpy(), atol=1e-6)
    np.testing.assert_allclose(_mc(_inputs("numpy")), _mc(_inputs("torch")).numpy(), atol=1e-6)


def test_inputs_are_not_modified() -> None:
    for kind in KINDS:
        inputs = _inputs(kind)
        copies = {k: (v.clone() if kind == "torch" else v.copy()) for k, v in inputs.items()}
        _td(inputs, 0.5)
        _mc(inputs)
        for key, value in inputs.items():
            assert (np.asarray(value) == np.asarray(copies[key])).all(), (kind, key)


def test_explained_variance_known_values() -> None:
    target = np.array([1.0, 2.0, 3.0, 4.0])
    assert explained_variance(target, target) == pytest.approx(1.0)
    assert explained_variance(np.full(4, target.mean()), target) == pytest.approx(0.0)
    # residual 0, 0, 0, 1: Var = 0.25 - 0.0625 = 0.1875; Var(target) = 1.25 -> 1 - 0.15 = 0.85
    assert explained_variance(np.array([1.0, 2.0, 3.0, 3.0]), target) == pytest.approx(0.85)
    # a constant offset is not penalised (variance of the residual is 0)
    assert explained_variance(target + 5, target) == pytest.approx(1.0)
    # predicting the negation: residual 2·target, Var = 4·1.25 -> 1 - 4 = -3
    assert explained_variance(-target, target) == pytest.approx(-3.0)
    assert math.isnan(explained_variance(np.array([1.0, 2.0]), np.array([3.0, 3.0])))
    # torch tensors and (T, N) shapes are flattened the same way
    t2 = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    assert explained_variance(torch.tensor([[1.0, 2.0], [3.0, 3.0]]), t2) == pytest.approx(0.85)
    assert isinstance(explained_variance(t2, t2), float)
