"""Playing: anything that picks an action for a single env — a policy, a script, a person.

The recorder and the tester drive every kind the same way:
`agent.reset(env, seed)` at each episode start, then `agent.act(env, observation)` per step,
where `observation` is the stacked (frame_stack, size, size) uint8 frame and `env` the
single env from `oakemu_rl.envs.make_env` (its `.unwrapped.ale` gives RAM to scripts).
"""

from .base import Agent, DiscardEpisode, NoisyAgent, PolicyAgent, RandomAgent, StopRecording
from .policy import GREEDY_ENGINES, greedy_agent, load_policy_agent

__all__ = ["GREEDY_ENGINES", "Agent", "DiscardEpisode", "NoisyAgent", "PolicyAgent", "RandomAgent",
           "StopRecording", "greedy_agent", "load_policy_agent"]
