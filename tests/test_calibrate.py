"""Critic calibration on the real emulator, and the rollouts it learns from.

Checkpoints use tiny models on 42x42 Pong frames so that a calibration run takes seconds.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from oakemu_rl.bootstrap.calibrate import CalibrateConfig, calibrate, linear_ceiling
from oakemu_rl.checkpoint import Checkpoint, lineage_inputs, load_checkpoint, save_checkpoint
from oakemu_rl.cli import cli
from oakemu_rl.demos import DemoWriter, EpisodeBuffer
from oakemu_rl.envs import EnvSpec, action_mask, action_meanings
from oakemu_rl.errors import ConfigError, DemoFileError
from oakemu_rl.metrics import read_metrics
from oakemu_rl.model import PPOModel, PPOModelConfiguration
from oakemu_rl.rl.rollout import RolloutCollector

SPEC = EnvSpec(game="pong", screen_size=42)
MEANINGS = list(action_meanings("pong"))  # NOOP FIRE RIGHT LEFT RIGHTFIRE LEFTFIRE
SMALL = PPOModelConfiguration(conv_layers=((8, 8, 4), (16, 4, 2)), fc_hidden=(64,))
# One 6x6/6 convolution and no fc layer: 7x7x16 local features. The ball is a pixel at
# 42x42; these features see where it is, so a linear value head can learn to predict when
# the next point falls (least squares reaches ~0.6-0.9 explained variance on them, against
# ~0.5 and a far worse conditioning for SMALL's random fc features).
LOCAL = PPOModelConfiguration(conv_layers=((16, 6, 6),), fc_hidden=())
CPU = torch.device("cpu")


def one_action_model(config: PPOModelConfiguration = SMALL, action: int = 0, seed: int = 0,
                     spec: EnvSpec = SPEC) -> PPOModel:
    """A random trunk whose policy plays `action` (logit 20 above the others) everywhere."""
    torch.manual_seed(seed)
    model = PPOModel(spec.observation_shape, len(MEANINGS), config)
    with torch.no_grad():
        model.policy_head.weight.zero_()
        model.policy_head.bias.zero_()
        model.policy_head.bias[action] = 20.0
    return model


def save_bc(path: Path, model: PPOModel, spec: EnvSpec = SPEC) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_checkpoint(path, Checkpoint.from_model(
        model, stage="bc", action_meanings=MEANINGS, action_mask=action_mask(spec).tolist(),
        env_spec=spec.to_dict(), steps={"epochs": 1}, extra={"metrics": {"bc/val_loss": 0.5}}))
    return path


def run_calibrate(run_dir: Path, *, checkpoint: str | None = None, demos: tuple[str, ...] = (),
                  **overrides) -> Path:
    options = dict(num_envs=4, holdout_envs=1, num_steps=64, iterations=2)
    return calibrate(CalibrateConfig(**(options | overrides)), run_dir=str(run_dir),
                     checkpoint=checkpoint, demos=demos, device="cpu", progress=False)


def _assert_policy_kept(bc: dict, calibrated: dict) -> None:
    assert bc.keys() == calibrated.keys()
    for name in bc:
        if name.startswith(("conv.", "fc.", "policy_head.")):
            assert torch.equal(bc[name], calibrated[name]), name
    value = [n for n in bc if n.startswith("value_head.")]
    assert value == ["value_head.weight", "value_head.bias"]
    assert not torch.equal(bc["value_head.weight"], calibrated["value_head.weight"])


# -- a real calibration run ----------------------------------------------------------------------


class _SpyAdam(torch.optim.Adam):
    """The real Adam, noting which parameters it was given."""

    given: ClassVar[list[list[torch.Tensor]]] = []

    def __init__(self, params, *args, **kwargs) -> None:
        params = list(params)
        _SpyAdam.given.append(params)
        super().__init__(params, *args, **kwargs)


@pytest.fixture(scope="module")
def short_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """num_steps 64, 2 iterations; a sampling policy and a large learning rate."""
    run_dir = tmp_path_factory.mktemp("short")
    torch.manual_seed(3)
    model = PPOModel(SPEC.observation_shape, len(MEANINGS), SMALL)  # near-uniform policy
    save_bc(run_dir / "bc.pt", model)
    _SpyAdam.given.clear()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OAKEMU_RUNS", str(run_dir / "runs"))
        mp.setattr(torch.optim, "Adam", _SpyAdam)
        path = run_calibrate(run_dir, lr=0.1, epochs=2, minibatch_size=64)
    return {"path": path, "run_dir": run_dir, "model": model,
            "optimizers": list(_SpyAdam.given)}


def test_calibration_changes_only_the_value_head(short_run: dict) -> None:
    bc = load_checkpoint(short_run["run_dir"] / "bc.pt")
    calibrated = load_checkpoint(short_run["path"])
    assert short_run["path"] == short_run["run_dir"] / "calibrated.pt"
    assert calibrated.stage == "calibrate"
    _assert_policy_kept(bc.state_dict, calibrated.state_dict)
    assert calibrated.action_meanings == bc.action_meanings
    assert calibrated.action_mask == bc.action_mask and calibrated.env_spec == bc.env_spec
    assert calibrated.steps["bc/epochs"] == 1  # bc's steps are carried over
    assert calibrated.steps["calibrate/env_steps"] == 2 * 64 * 4
    assert calibrated.steps["calibrate/iterations"] == 2
    info = calibrated.extra["calibration"]
    assert len(info["history"]) == 2 and 1 <= info["best_iteration"] <= 2
    assert calibrated.extra["bc"] == {"metrics": {"bc/val_loss": 0.5}}
    records = read_metrics(short_run["run_dir"] / "calibrate_metrics.jsonl")
    assert [r["calibrate/iteration"] for r in records] == [1, 2]
    assert (short_run["run_dir"] / "calibration_scatter.png").stat().st_size > 0


def test_the_optimizer_holds_only_the_value_head(short_run: dict) -> None:
    [params] = short_run["optimizers"]
    head = short_run["model"].value_head
    assert [tuple(p.shape) for p in params] == [tuple(p.shape) for p in head.parameters()]
    assert sum(p.numel() for p in params) == 64 + 1
    assert all(p.requires_grad for p in params)


@pytest.fixture(scope="module")
def ev_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A NOOP policy in Pong loses a point every ~43 steps; its discounted returns depend
    on where the ball is. 4 iterations of 256 steps in 4 envs hold ~6 points per env."""
    run_dir = tmp_path_factory.mktemp("ev")
    save_bc(run_dir / "bc.pt", one_action_model(LOCAL, action=0))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OAKEMU_RUNS", str(run_dir / "runs"))
        path = run_calibrate(run_dir, num_steps=256, iterations=4, target="mc", lr=0.05,
                             epochs=16, minibatch_size=64, target_explained_variance=0.95)
    return {"path": path, "run_dir": run_dir}


def test_held_out_explained_variance_rises(ev_run: dict) -> None:
    # Seeds 0-5 gave initial ≈ 0.00 (the random head's output hardly varies) and best
    # 0.18-0.54; the margin below is half the worst of them.
    info = load_checkpoint(ev_run["path"]).extra["calibration"]
    initial, final = info["initial_explained_variance"], info["explained_variance"]
    assert final > initial + 0.08, info
    assert final > 0.08, info
    assert info["selection_explained_variance"] == max(info["history"])  # the best head is kept
    records = read_metrics(ev_run["run_dir"] / "calibrate_metrics.jsonl")
    assert [r["losses/explained_variance"] for r in records] == pytest.approx(info["history"])


def test_the_least_squares_ceiling_is_reported(ev_run: dict) -> None:
    # LOCAL's features carry where the ball is, so least squares on them explains much of
    # the return (the comment at LOCAL); a broken solve or mixed-up targets gives ~0 or less.
    info = load_checkpoint(ev_run["path"]).extra["calibration"]
    assert info["linear_ceiling_explained_variance"] > 0.3, info


def test_linear_ceiling_recovers_a_linear_target() -> None:
    torch.manual_seed(0)
    features, held = torch.randn(400, 8), torch.randn(200, 8)
    weights = torch.randn(8)
    targets, held_targets = features @ weights + 0.5, held @ weights + 0.5
    assert linear_ceiling(features, targets, held, held_targets) == pytest.approx(1.0, abs=1e-3)
    noise = torch.randn(200)  # a target the features say nothing about
    assert linear_ceiling(features, torch.randn(400), held, noise) < 0.05


def test_ev_run_keeps_the_policy_too(ev_run: dict) -> None:
    bc = load_checkpoint(ev_run["run_dir"] / "bc.pt").state_dict
    _assert_policy_kept(bc, load_checkpoint(ev_run["path"]).state_dict)


def test_calibrate_config_rejects_bad_options() -> None:
    for bad in ({"holdout_envs": 0}, {"holdout_envs": 4}, {"num_envs": 1}, {"target": "gae"},
                {"gamma": 0.0}, {"gae_lambda": 1.5}, {"lr": 0.0}, {"holdout_window": 0}):
        with pytest.raises(ConfigError):
            CalibrateConfig(**({"num_envs": 4} | bad))


# -- rollouts ------------------------------------------------------------------------------------


@pytest.mark.parametrize("greedy", [False, True])
def test_masked_actions_are_never_taken(greedy: bool) -> None:
    spec = EnvSpec(game="pong", screen_size=42, forbidden_actions=("FIRE",))
    model = one_action_model(SMALL, action=1, spec=spec)  # FIRE's logit is 20 above the rest
    mask = torch.as_tensor(action_mask(spec))
    assert not mask[1]
    collector = RolloutCollector(spec, model, mask, num_envs=2, num_steps=100, device=CPU,
                                 seed=0, greedy=greedy)
    try:
        rollout = collector.collect()
    finally:
        collector.close()
    actions = rollout.actions.flatten()
    assert not (actions == 1).any()
    assert torch.isfinite(rollout.log_probs).all()
    if greedy:
        assert (actions == actions[0]).all()
    else:  # the other five logits are equal: sampling spreads over all of them
        assert set(actions.tolist()) == {0, 2, 3, 4, 5}
        np.testing.assert_allclose(rollout.log_probs.numpy(), np.log(1 / 5), rtol=1e-5)


def test_truncated_steps_bootstrap_from_the_final_observation() -> None:
    # 200 emulator frames = 50 agent steps: with no NOOP starts both envs are cut after
    # step 49 and start again at step 50.
    spec = EnvSpec(game="pong", screen_size=42, max_episode_frames=200, noop_max=0)
    model = one_action_model(SMALL, action=2, seed=1)
    with torch.no_grad():
        # The trunk ignores the newest frame, so V(final observation) can be recomputed
        # from what the rollout stores: the final stack's older frames are obs[t]'s newest.
        model.conv[0].weight[:, -1] = 0
        model.value_head.weight.mul_(50)  # values that differ visibly between stacks
    collector = RolloutCollector(spec, model, torch.ones(len(MEANINGS), dtype=torch.bool),
                                 num_envs=2, num_steps=64, device=CPU, seed=0)
    try:
        rollout = collector.collect()
        last_obs = torch.from_numpy(collector.next_obs.copy())
    finally:
        collector.close()
    truncated = rollout.truncations.nonzero().tolist()
    assert truncated == [[49, 0], [49, 1]], truncated
    assert not rollout.terminations.any()
    assert list(collector.stats.lengths) == [50, 50]

    with torch.no_grad():
        for t, env in truncated:
            final = torch.zeros_like(rollout.obs[t, env])
            final[:-1] = rollout.obs[t, env, 1:]  # the newest frame is ignored by the trunk
            expected = float(model.get_value(final[None])[0])
            reset_value = float(rollout.values[t + 1, env])
            got = float(rollout.next_values[t, env])
            assert got == pytest.approx(expected, abs=1e-5)
            assert abs(got - reset_value) > 1e-3  # not the next episode's first state
            # the next episode starts from an empty stack (zeros before its first frame)
            assert not rollout.obs[t + 1, env, :-1].any()
        assert torch.allclose(rollout.next_values[-1], model.get_value(last_obs), atol=1e-5)
    # everywhere else next_values is the following step's value
    mask = torch.ones_like(rollout.truncations)
    mask[-1] = False
    mask &= ~rollout.truncations
    assert torch.equal(rollout.next_values[:-1][mask[:-1]], rollout.values[1:][mask[:-1]])


# -- the CLI -------------------------------------------------------------------------------------

CALIBRATE_ARGS = ["bootstrap", "calibrate", "--num-envs", "4", "--holdout-envs", "1",
                  "--num-steps", "32", "--iterations", "1", "--device", "cpu", "--no-progress"]


def _one_error_line(output: str) -> str:
    lines = output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), output
    assert "Traceback" not in output
    return lines[0]


def _visible_demo(path: Path, spec: EnvSpec = SPEC, length: int = 120) -> Path:
    """Two episodes whose action (NOOP, RIGHT or LEFT) is a block in the newest frame."""
    rng = np.random.default_rng(0)
    columns = {0: 2, 2: 16, 3: 30}
    episodes = []
    for seed in range(2):
        buffer = EpisodeBuffer()
        for t in range(length):
            action = int(rng.choice(list(columns)))
            frame = rng.integers(0, 40, spec.frame_shape, dtype=np.uint8)
            frame[10:30, columns[action]:columns[action] + 10] = 255
            reward = -1.0 if t % 40 == 39 else 0.0
            buffer.add(frame, action, reward, t == length - 1, False)
        episodes.append((buffer, "scripted", seed))
    DemoWriter(path, spec).write_episodes(episodes)
    return path


def test_cli_calibrate_after_bc_finds_the_last_run(tmp_path: Path, runs_root: Path) -> None:
    demo = _visible_demo(tmp_path / "demo.h5")
    start = save_bc(tmp_path / "start.pt", PPOModel(SPEC.observation_shape, len(MEANINGS),
                                                    SMALL))
    run_dir = tmp_path / "elsewhere" / "my-run"  # not the default run dir of the game
    runner = CliRunner()
    bc = runner.invoke(cli, ["bootstrap", "bc", str(demo), "--run-dir", str(run_dir),
                             "--epochs", "1", "--checkpoint", str(start), "--batch-size", "64",
                             "--augment-shift", "0", "--device", "cpu", "--no-progress"])
    assert bc.exit_code == 0, bc.output
    assert (runs_root / ".last-run").read_text().strip() == str(run_dir.resolve())

    result = runner.invoke(cli, CALIBRATE_ARGS)
    assert result.exit_code == 0, result.output
    path = run_dir / "calibrated.pt"
    assert f"wrote {path.resolve()}" in result.output or f"wrote {path}" in result.output
    calibrated = load_checkpoint(path)
    assert lineage_inputs(calibrated, "calibrate") == [str((run_dir / "bc.pt").resolve())]
    assert calibrated.steps["calibrate/env_steps"] == 32 * 4
    _assert_policy_kept(load_checkpoint(run_dir / "bc.pt").state_dict, calibrated.state_dict)
    assert not (runs_root / "pong").exists()


def test_cli_calibrate_without_a_run_says_to_run_bc_first() -> None:
    result = CliRunner().invoke(cli, CALIBRATE_ARGS)
    assert result.exit_code != 0
    line = _one_error_line(result.output)
    assert "oakemu bootstrap bc" in line


def test_cli_calibrate_run_dir_without_bc_pt(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    result = CliRunner().invoke(cli, [*CALIBRATE_ARGS, "--run-dir", str(tmp_path / "empty")])
    assert result.exit_code != 0
    line = _one_error_line(result.output)
    assert "bc.pt does not exist" in line and "oakemu bootstrap bc" in line


def test_cli_calibrate_demos_of_another_spec(tmp_path: Path) -> None:
    checkpoint = save_bc(tmp_path / "run" / "bc.pt", one_action_model())
    demo = _visible_demo(tmp_path / "big.h5", EnvSpec(game="pong", screen_size=84), length=20)
    args = [*CALIBRATE_ARGS, "--checkpoint", str(checkpoint), "--demos", str(demo)]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code != 0
    line = _one_error_line(result.output)
    assert "different env specs" in line and str(demo) in line
    assert not (tmp_path / "run" / "calibrated.pt").exists()
    with pytest.raises(DemoFileError, match="different env specs"):
        run_calibrate(tmp_path / "run", checkpoint=str(checkpoint), demos=(str(demo),))


def test_non_finite_value_loss_stops_and_overwrites_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    save_bc(run_dir / "bc.pt", one_action_model())
    previous = save_bc(run_dir / "calibrated.pt", one_action_model(seed=1)).read_bytes()
    # Adam moves the value head by ~lr on its first step: values of ~1e31 square to inf.
    args = [*CALIBRATE_ARGS, "--run-dir", str(run_dir), "--lr", "1e30", "--num-envs", "2"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code != 0
    line = _one_error_line(result.output)
    assert "value loss became" in line and "nothing was overwritten" in line
    assert (run_dir / "calibrated.pt").read_bytes() == previous
    # In a real terminal nothing but that line reaches stderr (no Python warning either).
    proc = subprocess.run([sys.executable, "-m", "oakemu_rl", *args], capture_output=True,
                          text=True, check=False, env=os.environ | {"OMP_NUM_THREADS": "1"},
                          timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [line], proc.stderr
    assert (run_dir / "calibrated.pt").read_bytes() == previous


@pytest.mark.parametrize("ratio", [1.0, 0.001])  # 0.001 of 96 fit samples: no demo sample
def test_calibrate_with_matching_demos(tmp_path: Path, ratio: float) -> None:
    checkpoint = save_bc(tmp_path / "run" / "bc.pt", one_action_model())
    demo = _visible_demo(tmp_path / "demo.h5")
    path = run_calibrate(tmp_path / "out", checkpoint=str(checkpoint), demos=(str(demo),),
                         num_steps=32, iterations=1, demo_ratio=ratio)
    assert path == tmp_path / "out" / "calibrated.pt"
    calibrated = load_checkpoint(path)
    assert lineage_inputs(calibrated, "calibrate") == [str(checkpoint.resolve()),
                                                       str(demo.resolve())]
    _assert_policy_kept(load_checkpoint(checkpoint).state_dict, calibrated.state_dict)
