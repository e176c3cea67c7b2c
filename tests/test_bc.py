"""Behaviour cloning: the loss, the augmentation, the demo dataset and `oakemu bootstrap bc`.

Demo files are real HDF5 files written with `DemoWriter`; their frames are synthetic so
that the demonstrated action can be read off the newest frame (a bright block whose
column depends on the action) and so that every sample can be identified.
"""

from __future__ import annotations

import collections
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from torch.utils.data import DataLoader

from oakemu_rl import runtime
from oakemu_rl.bootstrap.bc import (
    BCConfig,
    _initial_model,
    bc_loss,
    evaluate_bc,
    random_shift,
    train_bc,
)
from oakemu_rl.checkpoint import Checkpoint, lineage_inputs, load_checkpoint, save_checkpoint
from oakemu_rl.cli import cli
from oakemu_rl.demos import DemoFile, DemoWriter, EpisodeBuffer, stack_frames
from oakemu_rl.demos.dataset import DemoDataset, split_episodes
from oakemu_rl.envs import EnvSpec, action_mask, action_meanings
from oakemu_rl.errors import ConfigError, DemoFileError, OakEmuError
from oakemu_rl.fsutil import sha256_file
from oakemu_rl.metrics import read_metrics
from oakemu_rl.model import PPOModel, PPOModelConfiguration
from oakemu_rl.runtime import autocast_dtype, cpu_has_bf16

SMALL = PPOModelConfiguration(conv_layers=((8, 8, 4), (16, 4, 2)), fc_hidden=(64,))
SPEC = EnvSpec(game="pong", screen_size=42)  # observations (4, 42, 42); SMALL fits them
TINY = EnvSpec(game="pong", screen_size=8)  # 64-byte frames for the dataset tests
MEANINGS = list(action_meanings("pong"))  # NOOP FIRE RIGHT LEFT RIGHTFIRE LEFTFIRE
SHOWN = (0, 2, 3)  # NOOP, RIGHT, LEFT: the actions the synthetic demonstrator plays
COLUMNS = {0: 2, 2: 16, 3: 30}  # the action's block starts at this column of the frame


# -- synthetic demos -------------------------------------------------------------------------


def visible_episode(rng: np.random.Generator, length: int, columns: dict[int, int] = COLUMNS,
                    spec: EnvSpec = SPEC, forbidden_every: int = 0) -> EpisodeBuffer:
    """Random actions from SHOWN, each drawn as a bright block in the newest frame; with
    `forbidden_every`, every such step plays FIRE (drawn nowhere) instead."""
    buffer = EpisodeBuffer()
    for t in range(length):
        frame = rng.integers(0, 40, spec.frame_shape, dtype=np.uint8)
        if forbidden_every and t % forbidden_every == forbidden_every - 1:
            action = 1
        else:
            action = int(rng.choice(SHOWN))
            column = columns[action]
            frame[10:30, column:column + 10] = 255
        buffer.add(frame, action, 0.0, t == length - 1, False)
    return buffer


def write_demo(path: Path, episodes: list[EpisodeBuffer], spec: EnvSpec = SPEC) -> Path:
    DemoWriter(path, spec).write_episodes([(e, "scripted", i) for i, e in enumerate(episodes)])
    return path


def visible_demo(path: Path, lengths=(300, 300, 300, 300), seed: int = 0,
                 spec: EnvSpec = SPEC, **kwargs) -> Path:
    rng = np.random.default_rng(seed)
    return write_demo(path, [visible_episode(rng, n, spec=spec, **kwargs) for n in lengths],
                      spec)


def write_split(path: Path, train: list[str], valid: list[str]) -> None:
    with h5py.File(path, "a") as handle:
        handle.create_dataset("mask/train", data=np.array([n.encode() for n in train]))
        handle.create_dataset("mask/valid", data=np.array([n.encode() for n in valid]))


def small_checkpoint(path: Path, spec: EnvSpec = SPEC, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    model = PPOModel(spec.observation_shape, len(MEANINGS), SMALL)
    checkpoint = Checkpoint.from_model(model, stage="scratch", action_meanings=MEANINGS,
                                       action_mask=action_mask(spec).tolist(),
                                       env_spec=spec.to_dict())
    save_checkpoint(path, checkpoint)
    return path


def bc_config(**overrides) -> BCConfig:
    options = dict(epochs=4, batch_size=64, lr=1e-3, augment_shift=0, val_fraction=0.25,
                   precision="fp32")
    return BCConfig(**(options | overrides))


def run_bc(demo: Path, run_dir: Path, start: Path | None, *, demos: tuple[Path, ...] = (),
           **overrides) -> Path:
    """`train_bc` on `demo` (or `demos`) from `start`'s weights, on the CPU, quietly."""
    return train_bc(bc_config(**overrides), [str(d) for d in demos or (demo,)],
                    run_dir=str(run_dir), init_from=None if start is None else str(start),
                    device="cpu", progress=False)


def id_episode(episode: int, length: int, rng: np.random.Generator,
               spec: EnvSpec = TINY, forbidden_every: int = 0) -> EpisodeBuffer:
    """Frames that name their episode and step in the first pixels: every sample differs."""
    buffer = EpisodeBuffer()
    for t in range(length):
        frame = rng.integers(0, 256, spec.frame_shape, dtype=np.uint8)
        frame[0, :3] = (episode, t % 256, t // 256)
        if forbidden_every and t % forbidden_every == 0:
            action = 1
        else:
            action = int(rng.choice([0, 2, 3, 4, 5]))
        buffer.add(frame, action, 0.0, t == length - 1, False)
    return buffer


def expected_samples(path: Path) -> collections.Counter:
    """(observation bytes, action) of every allowed step, rebuilt from the file directly."""
    expected: collections.Counter = collections.Counter()
    with DemoFile(path) as demo:
        k = demo.spec.frame_stack
        for i in range(len(demo.episodes)):
            frames, actions = demo.read(i, "frames"), demo.read(i, "actions")
            for t, action in enumerate(actions):
                if demo.action_mask[action]:
                    expected[stack_frames(frames, t, k).tobytes(), int(action)] += 1
    return expected


def collect(batches) -> tuple[collections.Counter, list[int]]:
    seen: collections.Counter = collections.Counter()
    sizes = []
    for obs, actions in batches:
        assert obs.dtype == torch.uint8 and actions.dtype == torch.int64
        assert obs.shape[0] == actions.shape[0]
        sizes.append(len(actions))
        for o, a in zip(obs.numpy(), actions.numpy(), strict=True):
            seen[o.tobytes(), int(a)] += 1
    return seen, sizes


@pytest.fixture(scope="module")
def id_demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """5,311 identifiable steps in episodes whose lengths leave partial blocks."""
    rng = np.random.default_rng(1)
    lengths = [1000, 777, 1501, 33, 2000]
    path = tmp_path_factory.mktemp("id") / "ids.h5"
    return write_demo(path, [id_episode(i, n, rng) for i, n in enumerate(lengths)], TINY)


def make_dataset(path: Path, *, streaming: bool, batch_size: int = 50, shuffle: bool = True,
                 block_size: int = 32, shuffle_blocks: int = 2) -> DemoDataset:
    demos = [DemoFile(path)]
    train, valid = split_episodes(demos, 0.0, 0)
    assert not valid
    return DemoDataset(demos, train, batch_size=batch_size, action_mask=demos[0].action_mask,
                       shuffle=shuffle, seed=3, cache_bytes=0 if streaming else 1 << 30,
                       block_size=block_size, shuffle_blocks=shuffle_blocks)


# -- bc_loss -----------------------------------------------------------------------------------


def test_bc_loss_is_cross_entropy_without_mask_smoothing_or_weights() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 6, generator=g) * 3
    actions = torch.randint(0, 6, (7,), generator=g)
    mask = torch.ones(6, dtype=torch.bool)
    torch.testing.assert_close(bc_loss(logits, actions, mask), F.cross_entropy(logits, actions))


def test_bc_loss_smoothing_spreads_over_allowed_actions_only() -> None:
    # Actions 0..2 with 1 forbidden; logits ln 3, 100, 0: the masked softmax is
    # p = (3/4, 0, 1/4). Smoothing 0.2 over the 2 allowed actions makes the target for
    # action 0 equal to (0.8 + 0.1, 0, 0.1), so the loss is
    # -(0.9 ln 0.75 + 0.1 ln 0.25) = 0.9 · 0.2876821 + 0.1 · 1.3862944 = 0.3975433.
    logits = torch.tensor([[math.log(3), 100.0, 0.0]], requires_grad=True)
    mask = torch.tensor([True, False, True])
    loss = bc_loss(logits, torch.tensor([0]), mask, label_smoothing=0.2)
    assert torch.isfinite(loss)
    value = float(loss.detach())
    assert value == pytest.approx(0.9 * math.log(4 / 3) + 0.1 * math.log(4), abs=1e-6)
    assert value == pytest.approx(0.3975433, abs=1e-6)
    loss.backward()
    assert torch.isfinite(logits.grad).all()
    assert logits.grad[0, 1] == 0  # no mass, no gradient on the forbidden action
    # The forbidden action's logit does not matter at all, however large.
    for forbidden_logit in (-1e30, 0.0, 1e30):
        other = torch.tensor([[math.log(3), forbidden_logit, 0.0]])
        assert float(bc_loss(other, torch.tensor([0]), mask, label_smoothing=0.2)) == \
            pytest.approx(value, abs=1e-6)
    # Without smoothing the loss is -ln p(target) under the masked softmax: -ln 0.75.
    assert float(bc_loss(logits.detach(), torch.tensor([0]), mask)) == \
        pytest.approx(math.log(4 / 3))


def test_bc_loss_class_weights_give_the_weighted_mean() -> None:
    # Two actions. Per-sample losses: logits (0, 0) target 0 -> ln 2; logits (ln 3, 0)
    # target 0 -> -ln(3/4) = ln(4/3); logits (ln 3, 0) target 1 -> -ln(1/4) = ln 4.
    # Class weights (1, 3): (1·ln 2 + 1·ln(4/3) + 3·ln 4) / (1 + 1 + 3) = 1.0279424.
    logits = torch.tensor([[0.0, 0.0], [math.log(3), 0.0], [math.log(3), 0.0]],
                          requires_grad=True)
    actions = torch.tensor([0, 0, 1])
    mask = torch.ones(2, dtype=torch.bool)
    loss = bc_loss(logits, actions, mask, class_weights=torch.tensor([1.0, 3.0]))
    expected = (math.log(2) + math.log(4 / 3) + 3 * math.log(4)) / 5
    value = float(loss.detach())
    assert value == pytest.approx(expected, abs=1e-6)
    assert value == pytest.approx(1.0279424, abs=1e-6)
    # unweighted: the plain mean (ln 2 + ln(4/3) + ln 4) / 3
    assert float(bc_loss(logits.detach(), actions, mask)) == pytest.approx(
        (math.log(2) + math.log(4 / 3) + math.log(4)) / 3, abs=1e-6)
    loss.backward()
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0


def test_bc_loss_masked_and_weighted_and_smoothed_stays_finite() -> None:
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(16, 6, generator=g) * 50).requires_grad_()
    mask = torch.tensor([True, False, True, True, False, True])
    actions = torch.tensor([0, 2, 3, 5] * 4)
    weights = torch.tensor([0.5, 0.0, 2.0, 1.0, 0.0, 4.0])
    loss = bc_loss(logits, actions, mask, label_smoothing=0.1, class_weights=weights)
    assert torch.isfinite(loss)
    loss.backward()
    assert torch.isfinite(logits.grad).all()
    assert (logits.grad[:, ~mask] == 0).all()


# -- random_shift --------------------------------------------------------------------------------


def _frames(n: int = 8, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 4, 12, 12), generator=g, dtype=torch.uint8)


def _shifts(x: torch.Tensor, out: torch.Tensor, pad: int) -> list[tuple[int, int]]:
    """For each sample, the (dy, dx) whose crop of the replicate-padded input it equals."""
    padded = F.pad(x.float(), (pad, pad, pad, pad), mode="replicate").to(x.dtype)
    h, w = x.shape[-2:]
    found = []
    for i in range(len(x)):
        matches = [(dy, dx) for dy in range(2 * pad + 1) for dx in range(2 * pad + 1)
                   if torch.equal(out[i], padded[i, :, dy:dy + h, dx:dx + w])]
        assert matches, f"sample {i} is not a shifted crop of its padded input"
        found.append(matches[0])
    return found


def test_random_shift_keeps_shape_and_dtype_and_pad_zero_is_identity() -> None:
    x = _frames()
    g = torch.Generator().manual_seed(0)
    out = random_shift(x, 4, g)
    assert out.shape == x.shape and out.dtype == x.dtype == torch.uint8
    assert torch.equal(random_shift(x, 0, g), x)
    floats = x.float() / 255
    assert random_shift(floats, 2, g).dtype == torch.float32


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_random_shift_is_a_shifted_crop_of_the_padded_input(seed: int) -> None:
    x = _frames(seed=seed)
    out = random_shift(x, 3, torch.Generator().manual_seed(seed))
    shifts = _shifts(x, out, 3)  # every frame of a sample moves alike (whole-stack crop)
    assert len(set(shifts)) > 1  # and the samples do not all move the same way


def test_random_shift_is_deterministic_for_a_seeded_generator() -> None:
    x = _frames(16)
    a = random_shift(x, 4, torch.Generator().manual_seed(7))
    b = random_shift(x, 4, torch.Generator().manual_seed(7))
    c = random_shift(x, 4, torch.Generator().manual_seed(8))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


# -- config ----------------------------------------------------------------------------------


def test_bc_config_rejects_out_of_range_options() -> None:
    for bad in ({"epochs": 0}, {"lr": 0.0}, {"label_smoothing": 1.0}, {"augment_shift": 17},
                {"head_gain": -1.0}, {"val_fraction": 1.0}, {"lr_schedule": "step"},
                {"precision": "fp16"}, {"relabel_episodes": -1}, {"relabel_rounds": 0},
                {"relabel_epochs": 0}, {"relabel_epochs": (2, 3)}, {"relabel_seed": -1},
                {"sharpen": 0.0}, {"sharpen": -2.0}):
        with pytest.raises(ConfigError):
            BCConfig(**bad)
    # The demo files are an argument of train_bc now; none at all is still refused.
    with pytest.raises(DemoFileError, match="at least one demo file"):
        train_bc(BCConfig(), ())


# -- learning ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def learned(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("learned")
    demo = visible_demo(tmp / "visible.h5")
    start = small_checkpoint(tmp / "start.pt")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OAKEMU_RUNS", str(tmp / "runs"))
        path = run_bc(demo, tmp / "run", start, epochs=5)
    return {"demo": demo, "start": start, "path": path, "run": tmp / "run"}


@pytest.mark.parametrize("gain", [1.0, 0.3])
def test_fresh_bc_model_gets_a_policy_head_of_the_chosen_gain(gain: float) -> None:
    config = bc_config(architecture="tiny", head_gain=gain)
    model = _initial_model(config, SPEC, MEANINGS)
    weight = model.policy_head.weight.detach()  # (actions, features): orthogonal rows
    torch.testing.assert_close(weight @ weight.T, gain**2 * torch.eye(len(MEANINGS)))
    assert torch.count_nonzero(model.policy_head.bias) == 0
    # The stored architecture keeps PPO's init, so `finetune ppo --from-scratch` still
    # starts from a near-uniform policy.
    assert model.model_config.policy_gain == 0.01


def test_head_gain_zero_keeps_the_models_own_init() -> None:
    config = bc_config(architecture="tiny", head_gain=0.0)
    weight = _initial_model(config, SPEC, MEANINGS).policy_head.weight.detach()
    torch.testing.assert_close(weight @ weight.T, 0.01**2 * torch.eye(len(MEANINGS)))


def test_head_gain_leaves_a_start_checkpoints_head_alone(tmp_path: Path) -> None:
    start = small_checkpoint(tmp_path / "start.pt")
    model = _initial_model(bc_config(head_gain=1.0), SPEC, MEANINGS, load_checkpoint(start),
                           start)
    expected = load_checkpoint(start).build_model().policy_head.weight
    assert torch.equal(model.policy_head.weight, expected)


def test_bc_learns_an_action_visible_in_the_frame(learned: dict) -> None:
    checkpoint = load_checkpoint(learned["path"])
    assert checkpoint.stage == "bc"
    metrics = checkpoint.extra["metrics"]
    assert metrics["bc/val_accuracy"] > 0.9  # chance is 1/3
    assert metrics["bc/train_accuracy"] > 0.9
    records = read_metrics(learned["run"] / "bc_metrics.jsonl")
    assert records[-1]["bc/val_loss"] < records[0]["bc/val_loss"]
    assert records[-1]["bc/val_loss"] < 0.5 * math.log(3)
    # the saved model plays the demonstrated action on fresh frames
    model = checkpoint.build_model()
    rng = np.random.default_rng(99)
    with DemoFile(write_demo(learned["run"] / "fresh.h5",
                             [visible_episode(rng, 60)])) as fresh:
        obs = torch.from_numpy(np.stack([fresh.observation(0, t) for t in range(60)]))
        actions = torch.from_numpy(fresh.read(0, "actions"))
    with torch.no_grad():
        predicted = model.masked_logits(model.get_logits(obs),
                                        checkpoint.action_mask_tensor()).argmax(-1)
    assert (predicted == actions).float().mean() > 0.9


def test_bc_leaves_the_value_head_untouched(learned: dict) -> None:
    before = load_checkpoint(learned["start"]).state_dict
    after = load_checkpoint(learned["path"]).state_dict
    assert before.keys() == after.keys()
    for name in before:
        if name.startswith("value_head."):
            assert torch.equal(before[name], after[name]), name
    for prefix in ("conv.", "fc.", "policy_head."):
        names = [n for n in before if n.startswith(prefix)]
        assert names and all(not torch.equal(before[n], after[n]) for n in names), prefix


def test_bf16_autocast_bc_learns_and_keeps_fp32_weights(tmp_path: Path) -> None:
    demo = visible_demo(tmp_path / "visible.h5")
    start = small_checkpoint(tmp_path / "start.pt")
    path = run_bc(demo, tmp_path / "run", start, epochs=5, precision="bf16")
    checkpoint = load_checkpoint(path)
    assert checkpoint.config["precision_used"] == "bf16"
    assert checkpoint.extra["metrics"]["bc/val_accuracy"] > 0.9  # chance is 1/3
    assert all(v.dtype == torch.float32 for v in checkpoint.state_dict.values())


def test_precision_resolves_to_an_autocast_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert autocast_dtype("fp32", cpu) is None
    assert autocast_dtype("bf16", cpu) == torch.bfloat16
    assert autocast_dtype("auto", cpu) is None  # fp32 on the CPU, whatever its flags
    # PPO's auto takes bf16 on a CPU that does bf16 arithmetic, and fp32 on one that
    # would emulate it
    for native in (True, False):
        monkeypatch.setattr(runtime, "cpu_has_bf16", lambda n=native: n)
        assert autocast_dtype("auto", cpu, native_cpu=True) == \
            (torch.bfloat16 if native else None)
        assert autocast_dtype("auto", cpu) is None
        assert autocast_dtype("fp32", cpu, native_cpu=True) is None
    with pytest.raises(ConfigError, match="precision"):
        autocast_dtype("fp16", cpu)
    for native in (True, False):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda n=native: n)
        assert autocast_dtype("auto", gpu) == (torch.bfloat16 if native else None)
        assert autocast_dtype("fp32", gpu) is None
    with pytest.raises(ConfigError, match="no bfloat16 support"):
        autocast_dtype("bf16", gpu)


def test_the_cpus_bf16_arithmetic_is_read_from_its_flags() -> None:
    line = "flags\t\t: fpu vme sse2 avx2 avx512f {}\n"
    assert cpu_has_bf16("processor\t: 0\n" + line.format("avx512_bf16 avx512_vnni"))
    assert cpu_has_bf16(line.format("amx_bf16 amx_tile"))
    assert not cpu_has_bf16(line.format("avx512_vnni avx512_fp16"))
    assert not cpu_has_bf16("model name\t: amx_bf16 in a name, not a flag\n")
    assert not cpu_has_bf16("")


def test_bc_trains_channels_last_on_cpu_but_writes_the_default_layout(learned: dict) -> None:
    raw = torch.load(learned["path"], weights_only=True)
    conv_weights = [v for v in raw["model"].values() if v.dim() == 4]
    assert conv_weights and all(v.is_contiguous() for v in conv_weights)
    assert not any(v.is_contiguous(memory_format=torch.channels_last) for v in conv_weights)


def test_bc_writes_metrics_and_curves(learned: dict) -> None:
    records = read_metrics(learned["run"] / "bc_metrics.jsonl")
    assert [r["epoch"] for r in records] == list(range(1, len(records) + 1))
    for key in ("bc/train_loss", "bc/train_accuracy", "bc/val_loss", "bc/val_accuracy",
                "bc/lr", "bc/val_accuracy/NOOP"):
        assert key in records[0], key
    assert records[0]["bc/val_accuracy/FIRE"] is None  # no FIRE in the validation episode
    assert (learned["run"] / "bc_curves.png").stat().st_size > 0
    checkpoint = load_checkpoint(learned["path"])
    best = int(np.argmin([r["bc/val_loss"] for r in records])) + 1
    assert checkpoint.steps["bc/epochs"] == best
    assert checkpoint.steps["bc/samples"] == 900 * best  # 3 training episodes of 300 steps
    assert checkpoint.steps["bc/updates"] == 15 * best  # ceil(900 / 64) batches an epoch


def test_bc_is_deterministic_on_cpu(tmp_path: Path) -> None:
    demo = visible_demo(tmp_path / "d.h5", lengths=(200, 200, 200))
    start = small_checkpoint(tmp_path / "start.pt")
    states = []
    for name, seed in (("a", 5), ("b", 5), ("c", 6)):
        path = run_bc(demo, tmp_path / name, start, epochs=2, augment_shift=2, seed=seed,
                      val_fraction=0.34)
        states.append(load_checkpoint(path).state_dict)
    a, b, c = states
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
    metrics_a = read_metrics(tmp_path / "a" / "bc_metrics.jsonl")
    metrics_b = read_metrics(tmp_path / "b" / "bc_metrics.jsonl")
    strip = lambda rs: [{k: v for k, v in r.items() if "per_second" not in k} for r in rs]  # noqa: E731
    assert strip(metrics_a) == strip(metrics_b)


def test_sharpen_scales_the_saved_logits_and_nothing_else(tmp_path: Path) -> None:
    """The same training with `sharpen` 3 saves the policy head times 3 and the rest as
    it is: the same greedy actions, sharper sampling, the same validation record."""
    demo = visible_demo(tmp_path / "d.h5", lengths=(200, 200, 200))
    start = small_checkpoint(tmp_path / "start.pt")
    plain, sharp = (load_checkpoint(run_bc(demo, tmp_path / name, start, epochs=2, seed=5,
                                           val_fraction=0.34, sharpen=k))
                    for name, k in (("plain", 1.0), ("sharp", 3.0)))
    for key, value in plain.state_dict.items():
        expected = 3 * value if key.startswith("policy_head.") else value
        torch.testing.assert_close(sharp.state_dict[key], expected, rtol=1e-6, atol=0)
    assert sharp.config["sharpen"] == 3.0
    learning = [{k: v for k, v in c.extra["metrics"].items() if "per_second" not in k}
                for c in (plain, sharp)]
    assert learning[0] == learning[1] and "bc/val_loss" in learning[0]
    with DemoFile(demo) as file:
        obs = torch.from_numpy(np.stack([file.observation(0, t) for t in range(100)]))
    mask = plain.action_mask_tensor()
    with torch.no_grad():
        a, b = (m.masked_logits(m.get_logits(obs), mask)
                for m in (plain.build_model(), sharp.build_model()))
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    # Sampling picks the greedy action more often on every frame.
    assert (b.softmax(-1).amax(-1) > a.softmax(-1).amax(-1)).all()


def test_stored_split_and_early_stopping_keep_the_best_epoch(tmp_path: Path) -> None:
    # Training episodes map NOOP/RIGHT/LEFT to block columns 2/16/30; the stored validation
    # episode uses them rotated (16/30/2), so the better BC fits the training episodes, the
    # worse its validation loss gets: the first epoch is the best, and patience 2 stops it
    # after epoch 3.
    rng = np.random.default_rng(0)
    swapped = {0: 16, 2: 30, 3: 2}
    episodes = [visible_episode(rng, 250) for _ in range(3)]
    episodes.insert(1, visible_episode(rng, 150, columns=swapped))
    demo = write_demo(tmp_path / "split.h5", episodes)
    write_split(demo, ["demo_0", "demo_2", "demo_3"], ["demo_1"])

    with DemoFile(demo) as opened:
        assert opened.split == {"train": ["demo_0", "demo_2", "demo_3"], "valid": ["demo_1"]}
    demos = [DemoFile(demo)]
    for fraction, seed in ((0.0, 0), (0.5, 1), (0.9, 2)):  # the stored split wins
        train, valid = split_episodes(demos, fraction, seed)
        assert [r.episode for r in train] == [0, 2, 3] and [r.episode for r in valid] == [1]
    val_set = DemoDataset(demos, valid, batch_size=64, action_mask=demos[0].action_mask,
                          shuffle=False)
    assert val_set.num_samples == 150  # the valid episode's steps, nothing else
    assert sum(len(a) for _, a in val_set) == 150

    start = small_checkpoint(tmp_path / "start.pt")
    path = run_bc(demo, tmp_path / "run", start, epochs=12, patience=2,
                  lr_schedule="constant", val_fraction=0.5)
    records = read_metrics(tmp_path / "run" / "bc_metrics.jsonl")
    checkpoint = load_checkpoint(path)
    val_losses = [r["bc/val_loss"] for r in records]
    best = int(np.argmin(val_losses)) + 1
    assert checkpoint.steps["bc/epochs"] == best
    assert len(records) < 12, "training did not stop early"
    assert len(records) == best + 2  # patience 2: two epochs without improvement, then stop
    assert all(v >= val_losses[best - 1] for v in val_losses[best:])
    assert checkpoint.steps["bc/samples"] == 750 * best  # 3 training episodes of 250 steps
    assert checkpoint.extra["metrics"]["bc/val_loss"] == pytest.approx(val_losses[best - 1])
    # the train accuracy climbs while the (rotated) validation accuracy collapses: proof
    # that the stored valid episode, not a random one, was held out
    assert records[-1]["bc/train_accuracy"] > 0.8
    assert records[-1]["bc/val_accuracy"] < 0.5
    # bc.pt holds that epoch's weights: its validation loss is the one logged for it
    model = checkpoint.build_model()
    val = evaluate_bc(model, val_set, torch.as_tensor(demos[0].action_mask), torch.device("cpu"))
    assert val["loss"] == pytest.approx(val_losses[best - 1], rel=1e-4)
    demos[0].close()


# -- dataset: cached and streaming -----------------------------------------------------------------


def test_streaming_yields_every_sample_once_with_bounded_memory(id_demo: Path) -> None:
    expected = expected_samples(id_demo)
    assert sum(expected.values()) == 5311 and max(expected.values()) == 1
    streaming = make_dataset(id_demo, streaming=True, block_size=32, shuffle_blocks=2)
    cached = make_dataset(id_demo, streaming=False)
    assert not streaming.cached and cached.cached
    assert streaming.num_samples == cached.num_samples == 5311
    orders = []
    for epoch in (1, 2):
        streaming.set_epoch(epoch)
        batches = list(streaming)
        seen, sizes = collect(batches)
        assert seen == expected, f"epoch {epoch}: some sample is missing or repeated"
        assert all(s == 50 for s in sizes[:-1]) and 0 < sizes[-1] <= 50
        assert len(sizes) == len(streaming) == math.ceil(5311 / 50)
        orders.append(torch.cat([a for _, a in batches]))
    assert not torch.equal(orders[0], orders[1])  # a new shuffle each epoch
    k = TINY.frame_stack
    assert 0 < streaming.max_resident_frames <= 2 * (32 + k - 1)

    cached.set_epoch(1)
    seen, sizes = collect(cached)
    assert seen == expected  # cached and streaming modes yield the same multiset
    assert all(s == 50 for s in sizes[:-1]) and 0 < sizes[-1] <= 50
    assert cached.max_resident_frames == 0


def test_streaming_unshuffled_is_in_file_order(id_demo: Path) -> None:
    dataset = make_dataset(id_demo, streaming=True, shuffle=False, batch_size=64)
    first = next(iter(dataset))[0].numpy()
    with DemoFile(id_demo) as demo:
        frames = demo.read(0, "frames", slice(0, 64))
    for t in range(64):
        np.testing.assert_array_equal(first[t], stack_frames(frames, t, TINY.frame_stack))


def test_dataloader_workers_yield_every_sample_once(id_demo: Path) -> None:
    dataset = make_dataset(id_demo, streaming=True, block_size=32, shuffle_blocks=2)
    dataset.set_epoch(1)
    loader = DataLoader(dataset, batch_size=None, num_workers=2)
    seen, sizes = collect(loader)
    assert seen == expected_samples(id_demo)
    assert max(sizes) == 50
    assert sum(1 for s in sizes if s < 50) <= 2  # at most one short batch per worker


def test_forbidden_demo_actions_are_dropped(tmp_path: Path) -> None:
    spec = EnvSpec(game="pong", screen_size=8, forbidden_actions=("FIRE",))
    rng = np.random.default_rng(0)
    episodes = [id_episode(i, n, rng, spec, forbidden_every=5) for i, n in enumerate((97, 203))]
    demo = write_demo(tmp_path / "fire.h5", episodes, spec)
    fire = sum(a == 1 for e in episodes for a in e.actions)
    assert fire == 20 + 41
    expected = expected_samples(demo)
    assert sum(expected.values()) == 300 - fire
    for streaming in (True, False):
        dataset = make_dataset(demo, streaming=streaming, block_size=16)
        assert dataset.dropped == fire
        assert dataset.num_samples == 300 - fire
        assert dataset.action_counts(len(MEANINGS))[1] == 0
        seen, _ = collect(dataset)
        assert seen == expected
        assert all(action != 1 for _, action in seen)


def test_bc_never_trains_on_forbidden_actions(tmp_path: Path) -> None:
    spec = EnvSpec(game="pong", screen_size=42, forbidden_actions=("FIRE",))
    demo = visible_demo(tmp_path / "fire.h5", lengths=(200, 200), spec=spec, forbidden_every=4)
    start = small_checkpoint(tmp_path / "start.pt", spec)
    path = run_bc(demo, tmp_path / "run", start, epochs=1, val_fraction=0.5,
                  class_balance=True, label_smoothing=0.1)
    record = read_metrics(tmp_path / "run" / "bc_metrics.jsonl")[0]
    # A forbidden target would cost -log(0) ≈ 3e38 under the masked softmax.
    assert record["bc/train_loss"] < 5 and record["bc/val_loss"] < 5
    assert load_checkpoint(path).action_mask[1] is False

    # Validation episodes of forbidden actions only are no validation set: no val loss of
    # 0.0 that early stopping could never beat, and the last epoch is the one saved.
    rng = np.random.default_rng(1)
    episodes = [visible_episode(rng, 150, spec=spec) for _ in range(2)]
    episodes.append(visible_episode(rng, 20, spec=spec, forbidden_every=1))
    split = write_demo(tmp_path / "split.h5", episodes, spec)
    write_split(split, ["demo_0", "demo_1"], ["demo_2"])
    path = run_bc(split, tmp_path / "run3", start, epochs=3, patience=1)
    records = read_metrics(tmp_path / "run3" / "bc_metrics.jsonl")
    assert len(records) == 3 and all("bc/val_loss" not in r for r in records)
    assert load_checkpoint(path).steps["bc/epochs"] == 3

    only_fire = write_demo(tmp_path / "only_fire.h5",
                           [visible_episode(np.random.default_rng(0), 8, spec=spec,
                                            forbidden_every=1)], spec)
    with pytest.raises(DemoFileError, match="forbidden"):
        run_bc(only_fire, tmp_path / "run2", start, epochs=1)


# -- the CLI -------------------------------------------------------------------------------------


def _bc_args(demo: Path, run_dir: Path, start: Path, *extra: str) -> list[str]:
    return ["bootstrap", "bc", str(demo), "--run-dir", str(run_dir), "--epochs", "1",
            "--checkpoint", str(start), "--batch-size", "64", "--lr", "1e-3",
            "--augment-shift", "0", "--device", "cpu", "--no-progress", *extra]


def _one_error_line(output: str) -> str:
    lines = output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), output
    assert "Traceback" not in output
    return lines[0]


def test_cli_bc_writes_its_files_and_remembers_the_run(tmp_path: Path, runs_root: Path) -> None:
    demo = visible_demo(tmp_path / "d.h5", lengths=(120, 120))
    start = small_checkpoint(tmp_path / "start.pt")
    run_dir = tmp_path / "run"
    result = CliRunner().invoke(cli, _bc_args(demo, run_dir, start))
    assert result.exit_code == 0, result.output
    assert f"wrote {run_dir / 'bc.pt'}" in result.output
    for name in ("bc.pt", "bc_metrics.jsonl", "bc_curves.png"):
        assert (run_dir / name).stat().st_size > 0, name
    assert (runs_root / ".last-run").read_text().strip() == str(run_dir.resolve())
    checkpoint = load_checkpoint(run_dir / "bc.pt")
    assert checkpoint.stage == "bc" and checkpoint.steps["bc/epochs"] == 1
    assert checkpoint.config["lr"] == 1e-3
    # The demo file and the start checkpoint are the lineage's, not the config's.
    assert "demos" not in checkpoint.config and "checkpoint" not in checkpoint.config
    assert [link["stage"] for link in checkpoint.lineage] == ["scratch", "bc"]
    assert checkpoint.lineage[-1]["inputs"] == [{"path": str(demo.resolve()),
                                                 "sha256": sha256_file(demo)}]
    assert lineage_inputs(checkpoint, "bc") == [str(demo.resolve())]
    assert checkpoint.lineage[-1]["config"]["lr"] == 1e-3
    assert EnvSpec.from_dict(checkpoint.env_spec) == SPEC.for_evaluation()
    record = json.loads((run_dir / "bc_metrics.jsonl").read_text().splitlines()[0])
    assert record["epoch"] == 1


def test_cli_bc_defaults_to_the_games_run_dir(tmp_path: Path, runs_root: Path) -> None:
    demo = visible_demo(tmp_path / "d.h5", lengths=(64,))
    start = small_checkpoint(tmp_path / "start.pt")
    args = [a for a in _bc_args(demo, tmp_path, start) if a != str(tmp_path)]
    args.remove("--run-dir")
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert (runs_root / "pong" / "bc.pt").exists()
    assert (runs_root / ".last-run").read_text().strip() == str((runs_root / "pong").resolve())
    assert "no validation episodes" in result.output  # a single episode cannot be split


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_cli_bc_corrupt_demo_file_is_one_clear_line(tmp_path: Path, damage: str) -> None:
    demo = visible_demo(tmp_path / "d.h5", lengths=(100, 100))
    data = demo.read_bytes()
    demo.write_bytes(b"this is not an HDF5 file\n" * 40 if damage == "garbage"
                     else data[: len(data) // 2])
    start = small_checkpoint(tmp_path / "start.pt")
    result = CliRunner().invoke(cli, _bc_args(demo, tmp_path / "run", start))
    assert result.exit_code != 0
    line = _one_error_line(result.output)
    assert str(demo) in line
    assert not (tmp_path / "run" / "bc.pt").exists()


def test_cli_bc_demo_files_with_different_specs(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    a = write_demo(tmp_path / "a.h5", [visible_episode(rng, 50)])
    other = EnvSpec(game="pong", screen_size=42, repeat_action_probability=0.0)
    b = write_demo(tmp_path / "b.h5", [visible_episode(rng, 50, spec=other)], other)
    start = small_checkpoint(tmp_path / "start.pt")
    args = _bc_args(a, tmp_path / "run", start)
    args.insert(3, str(b))
    result = CliRunner().invoke(cli, args)
    assert result.exit_code != 0
    line = _one_error_line(result.output)
    assert "different env specs" in line and str(a) in line and str(b) in line
    with pytest.raises(DemoFileError, match="different env specs"):
        run_bc(a, tmp_path / "run", start, demos=(a, b))


def test_cli_bc_start_checkpoint_for_another_spec(tmp_path: Path) -> None:
    demo = visible_demo(tmp_path / "d.h5", lengths=(50,))
    start = small_checkpoint(tmp_path / "start.pt", EnvSpec(game="pong", screen_size=84))
    result = CliRunner().invoke(cli, _bc_args(demo, tmp_path / "run", start))
    assert result.exit_code != 0
    assert "different env specs" in _one_error_line(result.output)


def test_cli_bc_nan_loss_stops_and_keeps_the_previous_bc_pt(tmp_path: Path) -> None:
    demo = visible_demo(tmp_path / "d.h5", lengths=(200, 200))
    start = small_checkpoint(tmp_path / "start.pt")
    run_dir = tmp_path / "run"
    assert CliRunner().invoke(cli, _bc_args(demo, run_dir, start)).exit_code == 0
    previous = load_checkpoint(run_dir / "bc.pt").state_dict
    # Adam moves every weight by about lr on its first step: with lr 1e30 the next forward
    # pass overflows float32 and the loss is no longer finite.
    args = _bc_args(demo, run_dir, start, "--lr", "1e30", "--lr-schedule", "constant")
    result = CliRunner().invoke(cli, args)
    assert result.exit_code != 0
    line = _one_error_line(result.output)
    assert "BC loss became" in line and "lower --lr" in line
    kept = load_checkpoint(run_dir / "bc.pt").state_dict  # still loadable, and untouched
    assert all(torch.equal(previous[k], kept[k]) for k in previous)
    with pytest.raises(OakEmuError, match="BC loss became"):
        run_bc(demo, run_dir, start, lr=1e30, lr_schedule="constant")
    # In a real terminal nothing but that line reaches stderr (no Python warning either).
    proc = subprocess.run([sys.executable, "-m", "oakemu_rl", *args], capture_output=True,
                          text=True, check=False, env=os.environ | {"OMP_NUM_THREADS": "1"},
                          timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [line], proc.stderr
