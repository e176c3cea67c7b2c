"""Stage three: PPO fine-tuning, its rollouts and advantage maths."""
