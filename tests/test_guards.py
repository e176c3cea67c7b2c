"""Fine-tuning that keeps and builds on the imprint: the critic is calibrated for the returns
PPO trains it on, calibration reports on data that chose nothing, and training logs one
point per finished game."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from builders import write_checkpoint

from oakemu_rl.bootstrap.calibrate import CalibrateConfig, calibrate
from oakemu_rl.checkpoint import load_checkpoint, save_checkpoint
from oakemu_rl.envs import EnvSpec
from oakemu_rl.errors import ConfigError
from oakemu_rl.finetune.ppo import PPOConfig, finetune_ppo
from oakemu_rl.metrics import read_metrics
from oakemu_rl.pipeline import load_pipeline

# Short games: a game ends (truncated) after 200 emulator frames, 50 agent steps.
SHORT = EnvSpec(game="pong", max_episode_frames=200)
PPO = dict(num_envs=2, num_steps=16, num_minibatches=1, update_epochs=1, eval_episodes=0,
           warmup_updates=0, warmup_ramp_updates=0, checkpoint_every=1)


def calibrated(path: Path, **config) -> Path:
    """A calibrate-stage checkpoint whose config says which returns its critic predicts."""
    write_checkpoint(path, SHORT, stage="calibrate")
    checkpoint = load_checkpoint(path)
    checkpoint.config = {"reward_clipping": True, "episodic_life": True, "gamma": 0.99} | config
    return save_checkpoint(path, checkpoint)


def test_ppo_refuses_a_critic_calibrated_for_other_returns(tmp_path: Path) -> None:
    start = calibrated(tmp_path / "calibrated.pt", reward_clipping=False)
    with pytest.raises(ConfigError, match=r"calibrated for other returns than this PPO trains "
                                          r"on \(reward_clipping False there, True here\)"):
        finetune_ppo(PPOConfig(total_steps=32, **PPO), checkpoint=start,
                     run_dir=tmp_path / "run", progress=False, device="cpu")
    assert not (tmp_path / "run" / "ppo_metrics.jsonl").exists()
    # the same returns train; so does a start from scratch, which keeps no critic
    same = calibrated(tmp_path / "same.pt")
    finetune_ppo(PPOConfig(total_steps=32, **PPO), checkpoint=same, run_dir=tmp_path / "ok",
                 progress=False, device="cpu")
    finetune_ppo(PPOConfig(total_steps=32, from_scratch=True, **PPO), checkpoint=start,
                 run_dir=tmp_path / "scratch", progress=False, device="cpu")


def test_the_pipeline_calibrates_for_ppos_returns(tmp_path: Path) -> None:
    text = ('name = "t"\n[env]\ngame = "pong"\n[demos]\nstyle = "follow"\n'
            '[ppo]\ngamma = 0.98\nreward_clipping = false\n')
    path = tmp_path / "t.toml"
    path.write_text(text)
    pipeline = load_pipeline(path)
    assert (pipeline.calibrate.gamma, pipeline.calibrate.reward_clipping,
            pipeline.calibrate.episodic_life) == (0.98, False, True)
    path.write_text(text + "[calibrate]\ngamma = 0.9\n")
    with pytest.raises(ConfigError, match=r"calibrate.gamma=0.9 differs from ppo.gamma=0.98"):
        load_pipeline(path)


def test_calibration_reports_on_fresh_games(tmp_path: Path) -> None:
    start = write_checkpoint(tmp_path / "bc.pt", SHORT)
    config = CalibrateConfig(num_envs=4, holdout_envs=1, num_steps=32, iterations=2,
                             holdout_window=3)
    made = load_checkpoint(calibrate(config, checkpoint=start, run_dir=tmp_path / "run",
                                     progress=False, device="cpu"))
    info = made.extra["calibration"]
    # as many steps as the held-out window: 1 env x 32 steps x 3 iterations, over 4 envs
    assert info["report_steps"] == 4 * 24
    assert info["selection_explained_variance"] == max(info["history"])
    assert info["explained_variance"] != info["selection_explained_variance"]
    assert (tmp_path / "run" / "calibration_scatter.png").exists()


def test_training_logs_one_point_per_finished_game(tmp_path: Path) -> None:
    start = calibrated(tmp_path / "calibrated.pt")
    config = dataclasses.replace(PPOConfig(total_steps=4 * 32, **PPO))
    path = finetune_ppo(config, checkpoint=start, run_dir=tmp_path / "run", progress=False,
                        device="cpu")
    records = read_metrics(tmp_path / "run" / "ppo_metrics.jsonl")
    games = [r for r in records if "charts/episodic_return" in r]
    updates = [r for r in records if "charts/update" in r]
    # 2 envs x 64 steps each, games of 50 steps: 2 finished games, one record each
    assert len(games) == 2 and len(updates) == 4
    assert all("charts/update" not in r and r["charts/episodic_length"] == 50 for r in games)
    assert all("charts/episodic_return" not in r for r in updates)
    assert [r["step"] for r in games] == [100, 100]  # both ended at step 50 of each env
    assert load_checkpoint(path).steps["ppo/global_step"] == 128
