"""The random agent: the bottom of the random-to-demonstrator scale."""

from __future__ import annotations

import numpy as np
import pytest

from oakemu_rl.agents import RandomAgent


def test_random_agent_takes_only_allowed_actions_and_is_seeded() -> None:
    mask = np.array([True, False, True, True, False, False])
    agent = RandomAgent(mask)
    agent.reset(None, 7)
    first = [agent.act(None, None) for _ in range(300)]
    assert set(first) == {0, 2, 3}
    agent.reset(None, 7)
    assert [agent.act(None, None) for _ in range(300)] == first
    agent.reset(None, 8)
    assert [agent.act(None, None) for _ in range(300)] != first


def test_random_agent_needs_an_allowed_action() -> None:
    with pytest.raises(ValueError, match="allows no action"):
        RandomAgent(np.zeros(4, dtype=bool))
