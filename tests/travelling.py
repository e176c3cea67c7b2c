"""Agents for the tests of games played in other processes (tests/test_game_processes.py).

They live in a module of their own because a copy of each is rebuilt in a new process,
which imports the agent's class by its module's name.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np


class Signing:
    """Plays `agent` and writes "pid seed" to `log` at the start of every game: which
    process played which game."""

    kind = "policy"
    portable = True

    def __init__(self, agent: Any, log: Path) -> None:
        self.agent = agent
        self.log = log

    @property
    def plays_batches(self) -> bool:
        return getattr(self.agent, "plays_batches", False)

    def reset(self, env: Any, seed: int) -> None:
        with self.log.open("a") as file:
            file.write(f"{os.getpid()} {seed}\n")
        self.agent.reset(env, seed)

    def act_batch(self, observations: np.ndarray) -> np.ndarray:
        return self.agent.act_batch(observations)

    def act(self, env: Any, observation: np.ndarray) -> int:
        return self.agent.act(env, observation)


class DiesOnSeed(Signing):
    """Signs its games, and the process playing game `seed` ends at its first step with
    exit code 3, as a process killed mid-game would, saying nothing."""

    def __init__(self, agent: Any, log: Path, seed: int) -> None:
        super().__init__(agent, log)
        self.fatal = seed
        self.seed = -1

    @property
    def plays_batches(self) -> bool:
        return False

    def reset(self, env: Any, seed: int) -> None:
        super().reset(env, seed)
        self.seed = seed

    def act(self, env: Any, observation: np.ndarray) -> int:
        if self.seed == self.fatal:
            os._exit(3)
        return self.agent.act(env, observation)
