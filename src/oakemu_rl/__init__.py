"""OakEmu-RL: recorded play of an emulated game in, a PPO agent out."""

__version__ = "0.1.0"

from .model import PPOActionBundle, PPOModel, PPOModelConfiguration

__all__ = ["PPOActionBundle", "PPOModel", "PPOModelConfiguration", "__version__"]
