"""Stage three, `oakemu finetune ppo`: the pure loss and schedule pieces against hand-computed
numbers, then short real runs in the emulator with a tiny model (checkpoints, lineage,
metrics, action mask, critic-first warm-up freeze, --resume, --from-scratch, BC loss and its
demos, NaN stop, CLI errors)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from oakemu_rl import PPOModel, PPOModelConfiguration, runs
from oakemu_rl.agents import load_policy_agent, recording
from oakemu_rl.agents.play import EvalConfig, play_games
from oakemu_rl.agents.scripted import make_demonstrator
from oakemu_rl.bootstrap.bc import BCConfig, train_bc
from oakemu_rl.bootstrap.calibrate import CalibrateConfig, calibrate
from oakemu_rl.checkpoint import (
    Checkpoint,
    lineage_inputs,
    load_checkpoint,
    plain_state_dict,
    save_checkpoint,
)
from oakemu_rl.cli import cli
from oakemu_rl.demos import DemoWriter, EpisodeBuffer
from oakemu_rl.envs import EnvSpec, action_mask, action_meanings
from oakemu_rl.errors import ConfigError, OakEmuError
from oakemu_rl.finetune import ppo as ppo_module
from oakemu_rl.finetune.ppo import (
    PPOConfig,
    _demo_batches,
    bc_weight,
    ent_at,
    finetune_ppo,
    kl_weight,
    lr_at,
    policy_lr_factor,
)
from oakemu_rl.metrics import read_metrics
from oakemu_rl.model import mixed_forward, mixed_logits
from oakemu_rl.rl import losses as losses_module
from oakemu_rl.rl.losses import (
    PPOBatch,
    PPOCoefficients,
    masked_kl,
    policy_loss,
    ppo_loss,
    value_loss,
)
from oakemu_rl.rl.rollout import Rollout, RolloutCollector

TINY = PPOModelConfiguration(conv_layers=((8, 8, 4), (16, 4, 2)), fc_hidden=(32,))
SHARED = ("conv.", "fc.", "policy_head.")
# (charts/episodic_return is a record of its own per finished game: tests/test_guards.py)
METRICS = ("charts/SPS", "charts/learning_rate",
           "charts/policy_lr_factor", "losses/approx_kl", "losses/clipfrac",
           "losses/explained_variance", "losses/entropy", "losses/policy_loss",
           "losses/value_loss", "guards/kl_coef", "charts/update")


def spec_for(forbid: tuple[str, ...] = ()) -> EnvSpec:
    return EnvSpec(game="pong", forbidden_actions=forbid)


def start_model(seed: int = 123) -> PPOModel:
    torch.manual_seed(seed)
    return PPOModel(spec_for().observation_shape, 6, TINY)


def write_start(run_dir: Path, model: PPOModel | None = None,
                forbid: tuple[str, ...] = (), spec: EnvSpec | None = None) -> Path:
    """A calibrate-stage checkpoint of the tiny model, as `calibrated.pt` in `run_dir`, on
    Pong (with `forbid`) unless `spec` names another game."""
    spec = spec if spec is not None else spec_for(forbid)
    meanings = list(action_meanings(spec))
    assert spec.game != "pong" or len(meanings) == 6
    run_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = Checkpoint.from_model(
        model if model is not None else start_model(), stage="calibrate",
        action_meanings=meanings, action_mask=action_mask(spec).tolist(),
        env_spec=spec.to_dict(), steps={"epochs": 2, "samples": 640},
    )
    return save_checkpoint(run_dir / "calibrated.pt", checkpoint)


def tiny(updates: int, **overrides) -> PPOConfig:
    """A PPO config of exactly `updates` updates of 2 envs × 16 steps."""
    options = dict(num_envs=2, num_steps=16, total_steps=updates * 32, num_minibatches=2,
                   update_epochs=2, eval_episodes=0, eval_max_steps=10, checkpoint_every=1)
    options.update(overrides)
    config = PPOConfig(**options)
    assert config.num_updates == updates
    return config


def run_ppo(run_dir: Path, config: PPOConfig, **places) -> Path:
    """`finetune_ppo` in `run_dir` without a progress bar; `places` are its other keyword
    arguments (resume, bc_demos, checkpoint)."""
    return finetune_ppo(config, run_dir=str(run_dir), progress=False, **places)


def update_records(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir / "ppo_metrics.jsonl") if "charts/update" in r]


def shared_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if k.startswith(SHARED)}


def value_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if k.startswith("value_head.")}


def adam_steps_by_group(last: Checkpoint) -> list[set[float]]:
    """Per parameter group of ppo_last.pt's Adam (0: trunk and policy, 1: value head), the
    step counts of its parameters that have state."""
    optimizer = last.extra["optimizer"]
    return [{float(optimizer["state"][i]["step"]) for i in group["params"]
             if i in optimizer["state"]} for group in optimizer["param_groups"]]


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


# -- pure pieces --------------------------------------------------------------------------


def test_policy_loss_is_the_clipped_surrogate() -> None:
    clip = 0.2
    #            A    ratio   unclipped   clipped     max (loss)
    cases = [(1.0, 1.5, -1.5, -1.2, -1.2),  # A>0, ratio above the range: clipped
             (1.0, 0.5, -0.5, -0.8, -0.5),  # A>0, ratio below: unclipped (pessimistic)
             (-1.0, 1.5, 1.5, 1.2, 1.5),  # A<0, ratio above: unclipped
             (-1.0, 0.5, 0.5, 0.8, 0.8),  # A<0, ratio below: clipped
             (2.0, 1.05, -2.1, -2.1, -2.1)]  # inside the range
    for adv, ratio, *_, expected in cases:
        got = policy_loss(torch.tensor([adv]), torch.tensor([ratio]), clip)
        assert float(got) == pytest.approx(expected, abs=1e-6), (adv, ratio)
    advantages = torch.tensor([c[0] for c in cases])
    ratios = torch.tensor([c[1] for c in cases], requires_grad=True)
    loss = policy_loss(advantages, ratios, clip)
    assert float(loss.detach()) == pytest.approx(-1.5 / 5, abs=1e-6)
    loss.backward()
    # where the clipped term wins the ratio gets no gradient; elsewhere -A / batch
    assert ratios.grad.tolist() == pytest.approx([0.0, -0.2, 0.2, 0.0, -0.4], abs=1e-6)


def test_value_loss_unclipped_and_clipped() -> None:
    new = torch.tensor([1.0, 0.0, 2.0, 3.0])
    old = torch.tensor([0.0, 0.0, 1.9, 0.0])
    returns = torch.tensor([2.0, 1.0, 0.0, 0.4])
    # unclipped squared errors 1, 1, 4, 6.76
    assert float(value_loss(new, old, returns, 0.5, clip=False)) == \
        pytest.approx(0.5 * 12.76 / 4, rel=1e-5)
    # clipped values 0.5, 0, 2.0, 0.5 → squared errors 2.25, 1, 4, 0.01; max per sample
    # 2.25, 1, 4, 6.76
    assert float(value_loss(new, old, returns, 0.5, clip=True)) == \
        pytest.approx(0.5 * 14.01 / 4, rel=1e-5)
    # clip off ignores old values entirely
    assert float(value_loss(new, old + 100, returns, 0.5, clip=False)) == \
        pytest.approx(0.5 * 12.76 / 4, rel=1e-5)
    # within the clip range both forms agree
    near = old + 0.1
    assert float(value_loss(near, old, returns, 0.5, clip=True)) == \
        pytest.approx(float(value_loss(near, old, returns, 0.5, clip=False)), rel=1e-6)


def test_masked_kl() -> None:
    mask3 = torch.tensor([True, True, False])
    same = torch.tensor([[0.3, -1.0, 2.0], [5.0, 0.0, -3.0]])
    assert float(masked_kl(same, same.clone(), mask3)) == 0.0
    assert float(masked_kl(same, same.clone(), torch.ones(3, dtype=torch.bool))) == \
        pytest.approx(0.0, abs=1e-7)
    # allowed probabilities: ref softmax(0, ln 3) = (1/4, 3/4), new (3/4, 1/4)
    # KL = 1/4 ln(1/3) + 3/4 ln 3 = ln(3) / 2; second row identical → 0; mean over rows
    ln3 = math.log(3.0)
    ref = torch.tensor([[0.0, ln3, 5.0], [1.0, 2.0, 0.0]])
    new = torch.tensor([[ln3, 0.0, -7.0], [1.0, 2.0, 9.0]])
    assert float(masked_kl(ref, new, mask3)) == pytest.approx(ln3 / 4, rel=1e-5)
    assert float(masked_kl(ref[:1], new[:1], mask3)) == pytest.approx(ln3 / 2, rel=1e-5)
    # the masked action's logits do not matter at all, however far apart
    for masked_ref, masked_new in ((100.0, -100.0), (-50.0, 80.0), (0.0, 0.0)):
        r, n = ref.clone(), new.clone()
        r[:, 2], n[:, 2] = masked_ref, masked_new
        assert float(masked_kl(r, n, mask3)) == pytest.approx(ln3 / 4, rel=1e-5)
    # and get no gradient (a finite one: the masked fill must not leak inf/nan)
    logits = new.clone().requires_grad_(True)
    masked_kl(ref, logits, mask3).backward()
    assert torch.isfinite(logits.grad).all()
    assert logits.grad[:, 2].abs().max() == 0.0
    # differs from the unmasked KL, which would count the third action
    assert float(masked_kl(ref, new, torch.ones(3, dtype=torch.bool))) > ln3


def _softmax_over(row: list[float], allowed: list[bool]) -> list[float]:
    """Probabilities of a logit row with the disallowed actions left out (0)."""
    top = max(x for x, ok in zip(row, allowed, strict=True) if ok)
    weights = [math.exp(x - top) if ok else 0.0 for x, ok in zip(row, allowed, strict=True)]
    total = sum(weights)
    return [w / total for w in weights]


def test_ppo_loss_against_hand_computed_numbers() -> None:
    ln2, ln3 = math.log(2.0), math.log(3.0)
    allowed = [True, True, False]
    # allowed probabilities (1/4, 3/4), (2/3, 1/3), (1/2, 1/2); the masked logits are large
    logit_rows = [[0.0, ln3, 7.0], [ln2, 0.0, 30.0], [0.0, 0.0, 4.0]]
    actions = [1, 0, 1]
    # chosen so that the ratios are 1.5 (above 1 + clip), 0.7 (below 1 - clip), 1.05 (inside)
    ratios = [1.5, 0.7, 1.05]
    probs = [_softmax_over(row, allowed) for row in logit_rows]
    new_logp = [math.log(p[a]) for p, a in zip(probs, actions, strict=True)]
    assert [math.exp(x) for x in new_logp] == pytest.approx([3 / 4, 2 / 3, 1 / 2])
    old_logp = [lp - math.log(r) for lp, r in zip(new_logp, ratios, strict=True)]
    advantages = [1.0, -2.0, 0.5]
    new_values, old_values, returns = [0.5, -1.0, 2.0], [0.0, -0.9, 1.0], [1.0, 0.0, 1.5]
    ref_rows = [[ln3, 0.0, -5.0], [0.0, 0.0, 9.0], [0.0, 0.0, 0.0]]
    clip, ent_coef, vf_coef = 0.2, 0.01, 0.5

    def by_hand(adv: list[float], clip_v: bool, kl_w: float) -> dict[str, float]:
        # clipped surrogate: max(-A r, -A clip(r)) per sample, then the mean
        surrogate = [max(-a * r, -a * min(max(r, 1 - clip), 1 + clip))
                     for a, r in zip(adv, ratios, strict=True)]
        pg = sum(surrogate) / 3
        # value loss: 0.5 × the larger of the plain and the clipped squared errors
        errors = []
        for new, old, ret in zip(new_values, old_values, returns, strict=True):
            plain = (new - ret) ** 2
            clipped = (old + min(max(new - old, -clip), clip) - ret) ** 2
            errors.append(max(plain, clipped) if clip_v else plain)
        v = 0.5 * sum(errors) / 3
        # entropy over the allowed actions only
        ent = sum(-sum(q * math.log(q) for q in p if q > 0) for p in probs) / 3
        out = {"pg": pg, "v": v, "ent": ent, "loss": pg - ent_coef * ent + vf_coef * v}
        if kl_w > 0:
            kls = []
            for ref_row, p in zip(ref_rows, probs, strict=True):
                q_ref = _softmax_over(ref_row, allowed)
                kls.append(sum(qr * (math.log(qr) - math.log(q))
                               for qr, q in zip(q_ref, p, strict=True) if qr > 0))
            out["kl_ref"] = sum(kls) / 3
            out["loss"] += kl_w * out["kl_ref"]
        log_r = [math.log(r) for r in ratios]
        out["old_approx_kl"] = sum(-x for x in log_r) / 3
        out["approx_kl"] = sum((r - 1) - x for r, x in zip(ratios, log_r, strict=True)) / 3
        out["clipfrac"] = sum(abs(r - 1) > clip for r in ratios) / 3
        return out

    # the worked numbers of the first case, as a check on the check
    plain = by_hand(advantages, clip_v=True, kl_w=0.0)
    assert plain["pg"] == pytest.approx((-1.2 + 1.6 - 0.525) / 3)
    assert plain["v"] == pytest.approx(0.5 * (0.64 + 1.0 + 0.25) / 3)
    assert plain["clipfrac"] == pytest.approx(2 / 3)

    mean = sum(advantages) / 3
    std = math.sqrt(sum((a - mean) ** 2 for a in advantages) / 2)  # torch's unbiased std
    normalised = [(a - mean) / (std + 1e-8) for a in advantages]
    cases = [
        (PPOCoefficients(clip_coef=clip, ent_coef=ent_coef, vf_coef=vf_coef, norm_adv=False),
         False, plain),
        (PPOCoefficients(clip_coef=clip, ent_coef=ent_coef, vf_coef=vf_coef, norm_adv=True,
                         clip_vloss=False, kl_weight=0.3),
         True, by_hand(normalised, clip_v=False, kl_w=0.3)),
    ]
    def f64(values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float64)

    for coef, with_ref, expected in cases:
        logits = f64(logit_rows).requires_grad_(True)
        batch = PPOBatch(actions=torch.tensor(actions), log_probs=f64(old_logp),
                         advantages=f64(advantages), returns=f64(returns),
                         values=f64(old_values), ref_logits=f64(ref_rows) if with_ref else None)
        loss, stats = ppo_loss(logits, f64(new_values), torch.tensor(allowed), batch, coef)
        assert float(loss.detach()) == pytest.approx(expected["loss"], rel=1e-6), coef
        assert set(stats) == set(expected) - {"loss"}, coef
        for key, value in expected.items():
            if key != "loss":
                assert float(stats[key]) == pytest.approx(value, rel=1e-6, abs=1e-9), key
            assert key == "loss" or not stats[key].requires_grad
        loss.backward()  # the masked action gets no gradient, and a finite one
        assert torch.isfinite(logits.grad).all() and logits.grad[:, 2].abs().max() == 0.0
    # the KL anchor and the value clip change the total as worked out above
    assert cases[1][2]["kl_ref"] > 0 and cases[1][2]["v"] == pytest.approx(0.5 * 1.5 / 3)


def test_lr_at_with_and_without_annealing() -> None:
    config = PPOConfig(lr=1e-3, num_envs=2, num_steps=16, total_steps=128)
    assert config.num_updates == 4
    assert [lr_at(config, u) for u in (1, 2, 3, 4)] == \
        pytest.approx([1e-3, 0.75e-3, 0.5e-3, 0.25e-3])
    flat = PPOConfig(lr=1e-3, num_envs=2, num_steps=16, total_steps=128, anneal_lr=False)
    assert [lr_at(flat, u) for u in (1, 2, 3, 4)] == [1e-3] * 4
    # fewer steps than one batch still make one update at the full rate
    one = PPOConfig(lr=1e-3, num_envs=2, num_steps=16, total_steps=5)
    assert one.num_updates == 1 and lr_at(one, 1) == 1e-3


def test_ent_at_anneals_the_bonus_only_when_asked() -> None:
    config = PPOConfig(ent_coef=0.02, num_envs=2, num_steps=16, total_steps=128)
    assert [ent_at(config, u) for u in (1, 2, 3, 4)] == [0.02] * 4
    annealed = dataclasses.replace(config, anneal_ent=True)
    assert [ent_at(annealed, u) for u in (1, 2, 3, 4)] == \
        pytest.approx([0.02, 0.015, 0.01, 0.005])
    # on two ranks the run has half the updates, and the bonus falls twice as fast
    assert ent_at(annealed, 2, world_size=2) == pytest.approx(0.01)


def test_annealed_entropy_bonus_reaches_the_loss(tmp_path: Path, monkeypatch) -> None:
    seen: list[float] = []
    original = ppo_module.ppo_loss

    def observed(logits, values, mask, batch, coef):
        seen.append(coef.ent_coef)
        return original(logits, values, mask, batch, coef)

    monkeypatch.setattr(ppo_module, "ppo_loss", observed)
    config = tiny(4, ent_coef=0.02, anneal_ent=True, warmup_updates=0,
                  warmup_ramp_updates=0)
    write_start(tmp_path / "run")
    run_ppo(tmp_path / "run", config)
    # 2 epochs × 2 minibatches per update, each with that update's bonus
    assert [round(ent, 6) for ent in seen] == \
        [0.02] * 4 + [0.015] * 4 + [0.01] * 4 + [0.005] * 4
    logged = [r["charts/ent_coef"] for r in update_records(tmp_path / "run")]
    assert logged == pytest.approx([0.02, 0.015, 0.01, 0.005])


def test_policy_lr_factor_warmup_then_linear_ramp() -> None:
    config = PPOConfig(warmup_updates=3, warmup_ramp_updates=4)
    factors = [policy_lr_factor(config, u) for u in range(1, 10)]
    assert factors == pytest.approx([0, 0, 0, 0.25, 0.5, 0.75, 1, 1, 1])
    assert policy_lr_factor(config, 10_000) == 1.0
    no_ramp = PPOConfig(warmup_updates=3, warmup_ramp_updates=0)
    assert [policy_lr_factor(no_ramp, u) for u in range(1, 6)] == [0, 0, 0, 1, 1]
    no_warmup = PPOConfig(warmup_updates=0, warmup_ramp_updates=2)
    assert [policy_lr_factor(no_warmup, u) for u in range(1, 4)] == [0.5, 1, 1]
    neither = PPOConfig(warmup_updates=0, warmup_ramp_updates=0)
    assert policy_lr_factor(neither, 1) == 1.0


def test_kl_and_bc_weights_decay_per_update() -> None:
    config = PPOConfig(kl_coef=0.2, kl_decay=0.5, bc_coef=1.0, bc_decay=0.9)
    assert [kl_weight(config, u) for u in (1, 2, 3, 4)] == pytest.approx([0.2, 0.1, 0.05, 0.025])
    assert [bc_weight(config, u) for u in (1, 2, 3)] == pytest.approx([1.0, 0.9, 0.81])
    off = PPOConfig(kl_coef=0.0, bc_coef=0.0)
    assert kl_weight(off, 7) == 0.0 and bc_weight(off, 7) == 0.0
    assert kl_weight(PPOConfig(kl_coef=0.3, kl_decay=1.0), 500) == pytest.approx(0.3)


def test_out_of_range_options_are_refused() -> None:
    for bad in ({"num_envs": 0}, {"lr": 0.0}, {"gamma": 0.0}, {"kl_decay": 0.0},
                {"num_minibatches": 10_000}, {"warmup_updates": -1}, {"checkpoint_every": 0}):
        with pytest.raises(ConfigError, match=f"ppo option {next(iter(bad))}="):
            PPOConfig(**bad)


# -- real runs --------------------------------------------------------------------------


def test_short_run_writes_checkpoints_metrics_and_tensorboard(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    source = write_start(run_dir)
    config = tiny(4, checkpoint_every=3, eval_episodes=1, eval_max_steps=10,
                  eval_every=2, warmup_updates=1, warmup_ramp_updates=1)
    path = run_ppo(run_dir, config)
    assert path == run_dir / "ppo.pt"

    start = load_checkpoint(source)
    final = load_checkpoint(path)
    last = load_checkpoint(run_dir / "ppo_last.pt")
    # ppo.pt is the evaluated policy that scored best (the latest of a tie), ppo_last.pt
    # the last one: their steps are those of their own update
    chosen = final.extra["selection"]["update"]
    assert chosen in (2, 4)
    assert final.steps["ppo/updates"] == chosen
    assert final.steps["ppo/global_step"] == chosen * 2 * 16
    assert last.steps["ppo/updates"] == 4 and last.steps["ppo/global_step"] == 4 * 2 * 16
    for checkpoint in (final, last):
        assert checkpoint.stage == "ppo"
        assert checkpoint.steps["calibrate/epochs"] == 2
        assert checkpoint.steps["calibrate/samples"] == 640
        assert checkpoint.action_meanings == start.action_meanings
        assert checkpoint.action_mask == start.action_mask
        assert checkpoint.env_spec == start.env_spec
        assert checkpoint.model_config == TINY
        assert [link["stage"] for link in checkpoint.lineage] == ["calibrate", "ppo"]
        assert checkpoint.lineage[-1]["inputs"] == [
            {"path": str(source.resolve()), "sha256": sha256(source)}]
        assert checkpoint.config["total_steps"] == 128
    assert {"optimizer", "reference", "generator", "torch_rng"} <= set(last.extra)
    assert "optimizer" not in final.extra  # ppo.pt is for playing, not resuming
    assert set(final.extra["eval"]) == {"eval/greedy_return", "eval/greedy_return_std",
                                        "eval/greedy_return_sem", "eval/episodes",
                                        "eval/greedy_length", "eval/seconds"}
    assert final.extra["eval"]["eval/greedy_length"] == 10  # cut at eval_max_steps
    assert set(final.extra["timings"]) == {"env", "inference", "learn", "evaluation"}
    # the evaluations' time is theirs alone, and the sum of what each took
    evaluated = [r["eval/seconds"] for r in read_metrics(run_dir / "ppo_metrics.jsonl")
                 if "eval/seconds" in r]
    assert len(evaluated) >= 2 and all(seconds > 0 for seconds in evaluated)
    assert last.extra["timings"]["evaluation"] == pytest.approx(sum(evaluated))

    records = read_metrics(run_dir / "ppo_metrics.jsonl")
    updates = [r for r in records if "charts/update" in r]
    assert [r["charts/update"] for r in updates] == [1, 2, 3, 4]
    assert [r["step"] for r in updates] == [32, 64, 96, 128]
    for u, record in enumerate(updates, start=1):
        assert set(METRICS) <= set(record), set(METRICS) - set(record)
        assert "charts/episodic_return" not in record  # a record of its own per game
        assert record["charts/SPS"] > 0
        assert record["losses/approx_kl"] >= -1e-6
        assert 0.0 <= record["losses/clipfrac"] <= 1.0
        ev = record["losses/explained_variance"]
        assert ev is None or (isinstance(ev, float) and ev <= 1.0)
        # pong has 6 actions, none masked here: entropy at most ln 6
        assert 0.0 < record["losses/entropy"] <= math.log(6) + 1e-5
        assert record["guards/kl_coef"] == pytest.approx(kl_weight(config, u))
        assert record["charts/learning_rate"] == pytest.approx(lr_at(config, u))
        assert record["charts/policy_lr_factor"] == policy_lr_factor(config, u)
    # greedy evaluations every eval_every updates (the last update is always evaluated)
    assert ["eval/greedy_return" in r for r in updates] == [False, True, False, True]
    assert updates[-1]["eval/episodes"] == 1
    assert updates[-1]["eval/selected_update"] == chosen
    assert records[-1]["step"] == 128 and len(records) == 4

    events = list((run_dir / "tb" / "ppo").glob("events.out.tfevents.*"))
    assert events and all(e.stat().st_size > 0 for e in events)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir / "tb" / "ppo"))
    accumulator.Reload()
    tags = set(accumulator.Tags()["scalars"])
    assert {"charts/SPS", "losses/approx_kl", "losses/clipfrac", "guards/kl_coef"} <= tags
    assert [e.step for e in accumulator.Scalars("losses/approx_kl")] == [32, 64, 96, 128]
    assert runs.last_run_dir() == run_dir.resolve()


def test_ppo_ships_the_policy_its_evaluations_picked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every evaluation plays the same selection games; ppo.pt holds the weights of the
    evaluation with the best mean as the metrics record it (the latest of a tie), with
    its score ± SE, and ppo_last.pt the last update's. The run trains on two threads, so
    its evaluations play on two processes; ppo.pt replays its selection score here."""
    seen: dict[int, dict[str, torch.Tensor]] = {}
    original = ppo_module._Trainer.evaluate

    def observed(self, update: int):  # the weights each evaluation plays, then the real one
        seen[update] = plain_state_dict(self.model)
        return original(self, update)

    monkeypatch.setattr(ppo_module._Trainer, "evaluate", observed)
    run_dir = tmp_path / "run"
    write_start(run_dir)
    config = tiny(3, eval_every=1, eval_episodes=2, eval_max_steps=40, eval_seed=20_000,
                  warmup_updates=0, warmup_ramp_updates=0, lr=1e-2, kl_coef=0.0, threads=2)
    path = run_ppo(run_dir, config)

    evals = [r for r in update_records(run_dir) if "eval/greedy_return" in r]
    assert [r["charts/update"] for r in evals] == [1, 2, 3] == sorted(seen)
    scores = [r["eval/greedy_return"] for r in evals]
    best = len(scores) - scores[::-1].index(max(scores))  # the last update with the best mean
    final, last = load_checkpoint(path), load_checkpoint(run_dir / "ppo_last.pt")
    selection = final.extra["selection"]
    assert selection["update"] == best == evals[-1]["eval/selected_update"]
    assert selection["mean"] == max(scores) and selection["episodes"] == 2
    assert selection["sem"] == pytest.approx(evals[best - 1]["eval/greedy_return_sem"])
    assert selection["seeds"] == [20_000, 20_001] and selection["last_update"] == 3
    assert [(e["update"], e["mean"]) for e in selection["evaluations"]] == \
        list(zip([1, 2, 3], scores, strict=True))
    assert final.steps["ppo/updates"] == best and last.steps["ppo/updates"] == 3
    for name, tensor in seen[best].items():
        assert torch.equal(final.state_dict[name], tensor), name
    for name, tensor in seen[3].items():
        assert torch.equal(last.state_dict[name], tensor), name
    # These short games tie, so the last evaluated policy is shipped, not the first one.
    assert scores == [scores[0]] * 3 and best == 3
    assert any(not torch.equal(final.state_dict[k], seen[1][k]) for k in final.state_dict)
    # ppo.pt replays its selection score on the selection games
    agent, spec = load_policy_agent(path, device="cpu")
    replay = play_games(agent, spec, EvalConfig(episodes=2, seed=20_000, max_steps=40),
                        progress=False)
    assert replay.mean == selection["mean"]


def test_selection_keeps_the_best_evaluation_and_the_latest_of_a_tie(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each evaluation of a CATCH run plays one fixed move (a policy head that always picks
    it), so the selection games score LEFT -2.5, NOOP -2 and RIGHT -3 on the real game:
    of LEFT, NOOP, NOOP, RIGHT the second NOOP is shipped, not the earlier tie nor the
    worse last update."""
    pytest.importorskip("pyboy")
    spec = EnvSpec(game="catch")
    meanings = list(action_meanings(spec))
    moves = ["LEFT", "NOOP", "NOOP", "RIGHT"]
    seen: dict[int, dict[str, torch.Tensor]] = {}
    original = ppo_module._Trainer.evaluate

    def fixed_move(self, update: int):
        with torch.no_grad():
            self.model.policy_head.weight.zero_()
            self.model.policy_head.bias.zero_()
            self.model.policy_head.bias[meanings.index(moves[update - 1])] = 100.0
        seen[update] = plain_state_dict(self.model)
        return original(self, update)

    monkeypatch.setattr(ppo_module._Trainer, "evaluate", fixed_move)
    run_dir = tmp_path / "run"
    torch.manual_seed(0)
    write_start(run_dir, PPOModel(spec.observation_shape, len(meanings), TINY), spec=spec)
    config = tiny(4, eval_every=1, eval_episodes=2, eval_max_steps=200, eval_seed=20_000,
                  warmup_updates=0, warmup_ramp_updates=0, kl_coef=0.0)
    final = load_checkpoint(run_ppo(run_dir, config))
    selection = final.extra["selection"]
    assert [(e["update"], e["mean"]) for e in selection["evaluations"]] == [
        (1, -2.5), (2, -2.0), (3, -2.0), (4, -3.0)]
    assert selection["update"] == 3 and selection["mean"] == -2.0
    for name, tensor in seen[3].items():
        assert torch.equal(final.state_dict[name], tensor), name
    assert any(not torch.equal(final.state_dict[k], seen[2][k]) for k in final.state_dict)


def test_selection_seeds_must_not_be_training_seeds() -> None:
    config = PPOConfig(num_envs=8, num_steps=128, total_steps=200_000)
    assert config.training_seeds() == range(1, 195 + 8)
    assert config.selection_seeds == range(10_000, 10_010)
    with pytest.raises(ConfigError, match=r"ppo option eval_seed=100 is out of range: "
                                          r"--eval-seed must be outside the training envs' "
                                          r"seeds \(1 to 202\)"):
        PPOConfig(num_envs=8, num_steps=128, total_steps=200_000, eval_seed=100)


def test_cli_runs_ppo_on_the_last_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    write_start(run_dir)
    runs.remember_run(run_dir)  # as `oakemu bootstrap calibrate` leaves it
    result = CliRunner().invoke(cli, [
        "finetune", "ppo", "--total-steps", "144", "--num-envs", "3", "--num-steps", "16",
        "--num-minibatches", "2", "--update-epochs", "1", "--warmup-updates", "1",
        "--checkpoint-every", "2", "--eval-episodes", "0", "--no-progress",
    ])
    assert result.exit_code == 0, result.output
    assert f"wrote {run_dir.resolve() / 'ppo.pt'}" in result.output
    final = load_checkpoint(run_dir / "ppo.pt")
    assert final.steps["ppo/updates"] == 3 and final.steps["ppo/global_step"] == 3 * 3 * 16
    assert final.config["num_envs"] == 3 and final.config["warmup_updates"] == 1
    assert load_checkpoint(run_dir / "ppo_last.pt").steps["ppo/updates"] == 3
    assert [r["charts/update"] for r in update_records(run_dir)] == [1, 2, 3]


def test_never_takes_a_masked_action(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fire = list(action_meanings("pong")).index("FIRE")
    model = start_model()
    with torch.no_grad():  # a policy that, unmasked, always fires
        model.policy_head.weight.zero_()
        model.policy_head.bias.zero_()
        model.policy_head.bias[fire] = 30.0
    run_dir = tmp_path / "run"
    write_start(run_dir, model, forbid=("FIRE",))
    start = load_checkpoint(run_dir / "calibrated.pt")
    assert start.action_mask[fire] is False and sum(start.action_mask) == 5
    mask = start.action_mask_tensor()

    # the collector on its own: unmasked the policy fires, masked it never does
    collector = RolloutCollector(spec_for(("FIRE",)), start.build_model(), mask, num_envs=2,
                                 num_steps=32, device=torch.device("cpu"), seed=3)
    try:
        rollout = collector.collect()
    finally:
        collector.close()
    unmasked = start.build_model().get_action_bundle(rollout.obs[:, 0]).action
    assert (unmasked == fire).all()
    assert not (rollout.actions == fire).any()
    assert len(torch.unique(rollout.actions)) > 1  # uniform over the five others
    assert torch.allclose(rollout.log_probs, torch.full_like(rollout.log_probs, -math.log(5)),
                          atol=1e-4)

    # a whole PPO run, policy learning from update 1: observe every rollout it collects
    taken: list[torch.Tensor] = []
    original = RolloutCollector.collect

    def observed(self: RolloutCollector):
        out = original(self)
        taken.append(out.actions.clone())
        return out

    monkeypatch.setattr(RolloutCollector, "collect", observed)
    # the final greedy eval raises AgentActionError if the policy picks a forbidden action
    path = run_ppo(run_dir, tiny(3, warmup_updates=0, warmup_ramp_updates=0, lr=1e-3,
                                 eval_episodes=1, eval_max_steps=30))
    assert len(taken) == 3
    actions = torch.cat([a.reshape(-1) for a in taken])
    assert actions.numel() == 3 * 32 and not (actions == fire).any()
    final = load_checkpoint(path)
    assert final.action_mask == start.action_mask
    assert final.state_dict["policy_head.bias"][fire] > 20  # still wants FIRE, never gets it
    for record in update_records(run_dir):  # entropy covers the five allowed actions only
        assert record["losses/entropy"] <= math.log(5) + 1e-5


def test_critic_first_warmup_freezes_trunk_and_policy(tmp_path: Path) -> None:
    run_dir = tmp_path / "warm"
    write_start(run_dir)
    start = load_checkpoint(run_dir / "calibrated.pt").state_dict
    config = tiny(3, warmup_updates=3, warmup_ramp_updates=2, kl_coef=0.5, lr=1e-3)
    final = load_checkpoint(run_ppo(run_dir, config)).state_dict
    shared = shared_tensors(start)
    assert {k.split(".")[0] for k in shared} == {"conv", "fc", "policy_head"}
    for name, tensor in shared.items():
        assert torch.equal(final[name], tensor), f"{name} moved during the warm-up"
    for name, tensor in value_tensors(start).items():
        assert not torch.equal(final[name], tensor), f"{name} did not learn"
    records = update_records(run_dir)
    assert [r["charts/policy_lr_factor"] for r in records] == [0.0, 0.0, 0.0]
    assert all(r["guards/kl_ref"] == 0.0 for r in records)  # the policy never left the anchor

    # the same run without a warm-up moves every tensor of the trunk and policy
    free_dir = tmp_path / "free"
    write_start(free_dir)
    free = load_checkpoint(run_ppo(
        free_dir, tiny(2, warmup_updates=0, warmup_ramp_updates=0, kl_coef=0.5, lr=1e-3)
    )).state_dict
    for name, tensor in shared.items():
        assert not torch.equal(free[name], tensor), f"{name} did not learn without warm-up"


def test_warmup_keeps_no_optimizer_state_for_trunk_and_policy(tmp_path: Path) -> None:
    """The warm-up is a freeze, not a zero learning rate: Adam never sees the trunk and
    policy (no moments, no step count), and only afterwards starts on them."""
    run_dir = tmp_path / "warm"
    write_start(run_dir)
    start = load_checkpoint(run_dir / "calibrated.pt").state_dict
    config = tiny(2, update_epochs=1, warmup_updates=2, warmup_ramp_updates=2, lr=1e-3)
    run_ppo(run_dir, config)
    last = load_checkpoint(run_dir / "ppo_last.pt")
    optimizer = last.extra["optimizer"]
    trunk_group, value_group = optimizer["param_groups"]
    assert len(value_group["params"]) == len(value_tensors(start)) == 2
    assert len(trunk_group["params"]) == len(shared_tensors(start))
    assert set(optimizer["state"]) == set(value_group["params"])  # none for group 0
    assert adam_steps_by_group(last) == [set(), {2.0 * config.num_minibatches}]
    for name, tensor in shared_tensors(start).items():
        assert torch.equal(last.state_dict[name], tensor), f"{name} moved during the warm-up"
    for name, tensor in value_tensors(start).items():
        assert not torch.equal(last.state_dict[name], tensor), f"{name} did not learn"

    # one warm-up update, then the ramp: trunk and policy get state from update 2 on
    ramp_dir = tmp_path / "ramp"
    write_start(ramp_dir)
    config = tiny(3, update_epochs=1, warmup_updates=1, warmup_ramp_updates=2, lr=1e-3)
    run_ppo(ramp_dir, config)
    last = load_checkpoint(ramp_dir / "ppo_last.pt")
    optimizer = last.extra["optimizer"]
    assert set(optimizer["state"]) == {i for g in optimizer["param_groups"] for i in g["params"]}
    assert adam_steps_by_group(last) == [{2.0 * config.num_minibatches},
                                         {3.0 * config.num_minibatches}]
    for name, tensor in shared_tensors(start).items():
        assert not torch.equal(last.state_dict[name], tensor), f"{name} did not learn"


def test_resume_continues_counters_and_schedules(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    total, stop_after = 4, 2

    config = tiny(total, warmup_updates=1, warmup_ramp_updates=2, kl_coef=0.2, kl_decay=0.5,
                  lr=1e-3)

    straight = tmp_path / "a"
    write_start(straight)
    run_ppo(straight, config)
    a_final = load_checkpoint(straight / "ppo.pt")
    a_last = load_checkpoint(straight / "ppo_last.pt")

    broken = tmp_path / "b"
    write_start(broken)
    original = RolloutCollector.collect
    calls = {"n": 0}

    def interrupted(self: RolloutCollector):
        calls["n"] += 1
        if calls["n"] > stop_after:
            raise KeyboardInterrupt  # Ctrl-C in the middle of update 3's rollout
        return original(self)

    monkeypatch.setattr(RolloutCollector, "collect", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_ppo(broken, config)
    monkeypatch.setattr(RolloutCollector, "collect", original)
    assert not (broken / "ppo.pt").exists()
    cut = load_checkpoint(broken / "ppo_last.pt")
    assert cut.steps["ppo/updates"] == stop_after
    assert cut.steps["ppo/global_step"] == stop_after * 32
    assert [r["charts/update"] for r in update_records(broken)] == [1, 2]

    run_ppo(broken, config, resume=True)
    b_final = load_checkpoint(broken / "ppo.pt")
    b_last = load_checkpoint(broken / "ppo_last.pt")
    assert b_final.steps == a_final.steps == {
        "calibrate/epochs": 2, "calibrate/samples": 640, "ppo/updates": total,
        "ppo/global_step": total * 32}
    assert b_last.steps == a_last.steps

    records = update_records(broken)
    assert [r["charts/update"] for r in records] == [1, 2, 3, 4]  # continues from K + 1
    assert [r["step"] for r in records] == [32, 64, 96, 128]
    a_records = update_records(straight)
    for u, (b, a) in enumerate(zip(records, a_records, strict=True), start=1):
        assert b["charts/learning_rate"] == pytest.approx(lr_at(config, u))
        assert b["charts/learning_rate"] == pytest.approx(a["charts/learning_rate"])
        assert b["charts/policy_lr_factor"] == policy_lr_factor(config, u) == \
            a["charts/policy_lr_factor"]
        assert b["guards/kl_coef"] == pytest.approx(kl_weight(config, u))
        assert b["guards/kl_coef"] == pytest.approx(a["guards/kl_coef"])
    assert records[2]["guards/kl_coef"] == pytest.approx(0.2 * 0.5 ** 2)  # not restarted

    # the optimizer state came along: Adam counted every minibatch of all 4 updates for the
    # value head, and of the 3 after the one warm-up update (a freeze) for trunk and policy
    steps_per_update = config.update_epochs * config.num_minibatches
    for last in (a_last, b_last):
        assert adam_steps_by_group(last) == [
            {float((total - config.warmup_updates) * steps_per_update)},
            {float(total * steps_per_update)}]
    # the KL anchor is still the starting policy, not the policy at the interruption
    start = load_checkpoint(broken / "calibrated.pt").state_dict
    for name, tensor in start.items():
        assert torch.equal(b_last.extra["reference"][name], tensor), name
    assert len(list((broken / "tb" / "ppo").glob("events.out.tfevents.*"))) == 2


def test_a_paused_run_keeps_the_whole_runs_schedules_and_resumes(tmp_path: Path) -> None:
    """--stop-after-steps pauses at the first update reaching the steps, writes ppo_last.pt
    and no ppo.pt, keeps the whole run's schedules, and --resume finishes the run."""
    config = tiny(4, kl_coef=0.2, kl_decay=0.5, lr=1e-3, checkpoint_every=10)
    whole = tmp_path / "whole"
    write_start(whole)
    run_ppo(whole, config)

    paused = tmp_path / "paused"
    write_start(paused)
    options = ["finetune", "ppo", "--run-dir", str(paused), "--no-progress", "--device", "cpu",
               "--num-envs", "2", "--num-steps", "16", "--total-steps", "128",
               "--num-minibatches", "2", "--update-epochs", "2", "--eval-episodes", "0",
               "--kl-coef", "0.2", "--kl-decay", "0.5", "--lr", "1e-3",
               "--checkpoint-every", "10"]
    result = CliRunner().invoke(cli, [*options, "--stop-after-steps", "40"])
    assert result.exit_code == 0, result.output
    assert result.output.strip().splitlines()[-1] == (
        f"paused at update 2 (64 agent steps): wrote {paused / 'ppo_last.pt'}; the same "
        "options with --resume go on")
    assert not (paused / "ppo.pt").exists()
    cut = load_checkpoint(paused / "ppo_last.pt")
    assert cut.steps["ppo/updates"] == 2  # 40 steps end inside update 2 (32 steps each)
    records = update_records(paused)
    assert [r["charts/update"] for r in records] == [1, 2]
    # the schedules are the 4-update run's, not a 2-update run's
    assert records[1]["charts/learning_rate"] == pytest.approx(lr_at(config, 2))
    assert lr_at(config, 2) > lr_at(dataclasses.replace(config, total_steps=64), 2)

    # a pause the run is already past is refused in one line, and ppo_last.pt is kept
    result = CliRunner().invoke(cli, [*options, "--resume", "--stop-after-steps", "32"])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert result.output.strip().splitlines() == [
        f"Error: {paused / 'ppo_last.pt'} is already at update 2 (64 agent steps), past the "
        "pause at 32 steps"]
    assert load_checkpoint(paused / "ppo_last.pt").steps == cut.steps

    result = CliRunner().invoke(cli, [*options, "--resume"])
    assert result.exit_code == 0, result.output
    # (a resume starts fresh games, so the weights differ from the whole run's)
    records, whole_records = update_records(paused), update_records(whole)
    assert [r["charts/update"] for r in records] == [1, 2, 3, 4]
    for key in ("charts/learning_rate", "guards/kl_coef"):
        assert [r[key] for r in records] == pytest.approx([r[key] for r in whole_records])
    assert load_checkpoint(paused / "ppo.pt").steps == load_checkpoint(whole / "ppo.pt").steps


def test_a_resume_in_another_trunk_precision_says_so(tmp_path: Path) -> None:
    """A run paused in bf16 and resumed in fp32 goes on (the weights are fp32 either way)
    and says, in one line of its output, that the trunk's precision changed; a resume in
    the same precision says nothing of it."""
    run_dir = tmp_path / "run"
    write_start(run_dir)
    options = ["finetune", "ppo", "--run-dir", str(run_dir), "--no-progress", "--device", "cpu",
               "--num-envs", "2", "--num-steps", "16", "--total-steps", "128",
               "--num-minibatches", "2", "--update-epochs", "1", "--eval-episodes", "0"]
    result = CliRunner().invoke(cli, [*options, "--precision", "bf16", "--stop-after-steps", "32"])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(cli, [*options, "--precision", "bf16", "--resume",
                                      "--stop-after-steps", "64"])
    assert result.exit_code == 0, result.output
    assert "trained its trunk in" not in result.output
    result = CliRunner().invoke(cli, [*options, "--precision", "fp32", "--resume"])
    assert result.exit_code == 0, result.output
    notes = [line for line in result.output.splitlines() if "trained its trunk in" in line]
    assert notes == [f"note: {run_dir / 'ppo_last.pt'} trained its trunk in bf16; the resumed "
                     "updates train it in fp32 (--precision fp32)"]
    assert load_checkpoint(run_dir / "ppo.pt").steps["ppo/global_step"] == 128


def test_resume_without_a_resumable_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    write_start(run_dir)
    with pytest.raises(OakEmuError, match=r"nothing to resume: .*ppo_last\.pt does not exist"):
        run_ppo(run_dir, tiny(2), resume=True)
    result = CliRunner().invoke(cli, ["finetune", "ppo", "--run-dir", str(run_dir), "--resume",
                                      "--no-progress"])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert result.output.strip().splitlines() == [
        f"Error: nothing to resume: {run_dir / 'ppo_last.pt'} does not exist"
    ]
    # a checkpoint of another stage under that name is not resumable either
    shutil.copy(run_dir / "calibrated.pt", run_dir / "ppo_last.pt")
    with pytest.raises(OakEmuError, match="is not a resumable PPO checkpoint"):
        run_ppo(run_dir, tiny(2), resume=True)


def test_from_scratch_starts_from_fresh_weights(tmp_path: Path, monkeypatch) -> None:
    run_dir = tmp_path / "run"
    write_start(run_dir)  # built with seed 123
    start = load_checkpoint(run_dir / "calibrated.pt")
    first: dict[str, torch.Tensor] = {}
    original = RolloutCollector.collect

    def observed(self: RolloutCollector):
        if not first:  # the weights PPO starts from, before any update
            first.update({k: v.clone() for k, v in self.model.state_dict().items()})
        return original(self)

    monkeypatch.setattr(RolloutCollector, "collect", observed)
    path = run_ppo(run_dir, tiny(2, from_scratch=True, warmup_updates=2, seed=0))
    final = load_checkpoint(path)
    torch.manual_seed(0)
    fresh = PPOModel(start.observation_shape, start.action_count, TINY).state_dict()
    for name, tensor in fresh.items():
        assert torch.equal(first[name], tensor), f"{name} is not a fresh init"
        if name.endswith(".weight"):  # (biases start at 0 in every init)
            assert not torch.equal(first[name], start.state_dict[name]), f"{name} is the start's"
    # From scratch there is nothing to protect: the guards are off.
    assert final.config["from_scratch"] is True
    assert final.config["warmup_updates"] == 0 and final.config["kl_coef"] == 0.0
    assert not torch.equal(final.state_dict["conv.0.weight"], fresh["conv.0.weight"])
    assert final.env_spec == start.env_spec and final.action_mask == start.action_mask


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "run"
    write_start(run_dir)
    config = tiny(5, num_minibatches=2, update_epochs=1)
    per_update = config.num_minibatches * config.update_epochs
    calls = {"n": 0}
    real_value_loss = losses_module.value_loss

    def poisoned(*args, **kwargs):
        calls["n"] += 1
        out = real_value_loss(*args, **kwargs)
        return out * float("nan") if calls["n"] > 2 * per_update else out

    monkeypatch.setattr(losses_module, "value_loss", poisoned)
    with pytest.raises(OakEmuError) as error:
        run_ppo(run_dir, config)
    message = str(error.value)
    assert "the PPO loss became nan at update 3" in message
    assert str(run_dir / "ppo_last.pt") in message
    assert not (run_dir / "ppo.pt").exists()
    last = load_checkpoint(run_dir / "ppo_last.pt")
    assert last.steps["ppo/updates"] == 2 and last.steps["ppo/global_step"] == 64
    assert all(torch.isfinite(t).all() for t in last.state_dict.values())
    assert [r["charts/update"] for r in update_records(run_dir)] == [1, 2]

    # and the run can go on from it
    monkeypatch.setattr(losses_module, "value_loss", real_value_loss)
    final = load_checkpoint(run_ppo(run_dir, tiny(5, num_minibatches=2, update_epochs=1),
                                    resume=True))
    assert final.steps["ppo/updates"] == 5 and final.steps["ppo/global_step"] == 160
    assert [r["charts/update"] for r in update_records(run_dir)] == [1, 2, 3, 4, 5]


def test_cli_without_calibrated_checkpoint_names_the_command(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    result = CliRunner().invoke(cli, ["finetune", "ppo", "--run-dir", str(empty)])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert f"{empty / 'calibrated.pt'} does not exist" in result.output
    assert "`oakemu bootstrap calibrate`" in result.output
    assert len(result.output.strip().splitlines()) == 1
    # no run directory at all (no .last-run): the same advice
    result = CliRunner().invoke(cli, ["finetune", "ppo"])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "calibrated.pt" in result.output and "`oakemu bootstrap calibrate`" in result.output
    assert not list(empty.iterdir())  # nothing was written


def test_rollout_shapes_and_global_step(tmp_path: Path) -> None:
    """The collector's rollout is (num_steps, num_envs, ...) and advances global_step."""
    start = start_model()
    collector = RolloutCollector(spec_for(), start, torch.ones(6, dtype=torch.bool),
                                 num_envs=3, num_steps=8, device=torch.device("cpu"), seed=0)
    try:
        first = collector.collect()
        collector.collect()
    finally:
        collector.close()
    assert first.obs.shape == (8, 3, 4, 84, 84) and first.obs.dtype == torch.uint8
    for name in ("actions", "log_probs", "values", "rewards", "terminations", "truncations",
                 "next_values"):
        assert getattr(first, name).shape == (8, 3), name
    assert first.num_steps == 24 and collector.global_step == 48
    assert np.isfinite(first.log_probs.numpy()).all()


def test_target_kl_stops_the_epochs_early(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    write_start(run_dir)
    config = tiny(2, update_epochs=3, num_minibatches=2, target_kl=1e-9,
                  warmup_updates=0, warmup_ramp_updates=0, lr=1e-3)
    run_ppo(run_dir, config)
    records = update_records(run_dir)
    assert [r["guards/target_kl_stop"] for r in records] == [True, True]
    last = load_checkpoint(run_dir / "ppo_last.pt")
    # one epoch of 2 minibatches per update instead of 3 epochs
    assert adam_steps_by_group(last) == [{2.0 * 2}, {2.0 * 2}]


def test_bc_loss_on_demo_batches(tmp_path: Path) -> None:
    demos = tmp_path / "pong.h5"
    result = CliRunner().invoke(cli, ["record", "--demonstrator", "scripted", "--episodes", "1",
                                      "--max-steps", "40", "--out", str(demos)])
    assert result.exit_code == 0, result.output
    run_dir = tmp_path / "run"
    source = write_start(run_dir)
    with pytest.raises(ConfigError, match="--bc-coef needs demo files"):
        run_ppo(run_dir, tiny(2, bc_coef=1.0))  # no --bc-demos and no bc stage in the lineage
    config = tiny(2, bc_coef=1.0, bc_decay=0.5, bc_batch_size=8)
    final = load_checkpoint(run_ppo(run_dir, config, bc_demos=(str(demos),)))
    assert lineage_inputs(final, "ppo") == [str(source.resolve()), str(demos.resolve())]
    records = update_records(run_dir)
    assert [r["guards/bc_coef"] for r in records] == pytest.approx([1.0, 0.5])
    assert all(isinstance(r["guards/bc_loss"], float) and r["guards/bc_loss"] > 0
               for r in records)

    other = tmp_path / "pong-nosticky.h5"
    result = CliRunner().invoke(cli, ["record", "--demonstrator", "scripted", "--episodes", "1",
                                      "--max-steps", "10", "--sticky", "0", "--out", str(other)])
    assert result.exit_code == 0, result.output
    with pytest.raises(OakEmuError, match="different env specs"):
        run_ppo(run_dir, tiny(2, bc_coef=1.0), bc_demos=(str(other),))


def test_bc_loss_defaults_to_the_demos_of_the_lineage(tmp_path: Path) -> None:
    """Without --bc-demos the BC loss reads the demo files bc.pt was cloned from, found in
    the starting checkpoint's lineage; ppo.pt names them, with their sha256, twice: in the
    bc link (what the clone read) and in the ppo link (what PPO read)."""
    spec = EnvSpec(game="pong")
    demo = tmp_path / "demos" / "pong.h5"
    recording.record(recording.RecordConfig(out=demo, spec=spec, episodes=1, seed=0,
                                            max_steps=40, progress=False),
                     make_demonstrator(spec, seed=0))
    demo_sha = hashlib.sha256(demo.read_bytes()).hexdigest()
    run_dir = tmp_path / "run"
    train_bc(BCConfig(epochs=1, architecture="tiny", batch_size=16), [str(demo)],
             run_dir=run_dir, device="cpu", progress=False)
    calibrate(CalibrateConfig(num_envs=2, holdout_envs=1, num_steps=16, iterations=1),
              run_dir=run_dir, device="cpu", progress=False)
    assert lineage_inputs(load_checkpoint(run_dir / "calibrated.pt"), "bc") == \
        [str(demo.resolve())]

    config = tiny(2, update_epochs=1, bc_coef=1.0, bc_decay=0.5, bc_batch_size=8)
    final = load_checkpoint(run_ppo(run_dir, config))  # no bc_demos
    records = update_records(run_dir)
    assert [r["guards/bc_coef"] for r in records] == pytest.approx([1.0, 0.5])
    for record in records:
        assert isinstance(record["guards/bc_loss"], float)
        assert math.isfinite(record["guards/bc_loss"]) and record["guards/bc_loss"] > 0
    assert [link["stage"] for link in final.lineage] == ["bc", "calibrate", "ppo"]
    demo_input = {"path": str(demo.resolve()), "sha256": demo_sha}
    bc_link, calibrate_link, ppo_link = final.lineage
    assert bc_link["inputs"] == [demo_input]
    assert calibrate_link["inputs"] == [{"path": str((run_dir / "bc.pt").resolve()),
                                         "sha256": sha256(run_dir / "bc.pt")}]
    assert ppo_link["inputs"] == [{"path": str((run_dir / "calibrated.pt").resolve()),
                                   "sha256": sha256(run_dir / "calibrated.pt")}, demo_input]


def test_bc_demo_batches_leave_out_forbidden_actions(tmp_path: Path) -> None:
    """Demo labels of a forbidden action (here FIRE, in a file recorded under the spec that
    forbids it) are never fed to the BC loss; every other sample is, once per epoch, with
    its own observation."""
    forbid = ("FIRE",)
    spec = spec_for(forbid)
    run_dir = tmp_path / "run"
    start = load_checkpoint(write_start(run_dir, forbid=forbid))
    meanings = list(action_meanings("pong"))
    fire = meanings.index("FIRE")
    assert [m for m, ok in zip(meanings, start.action_mask, strict=True) if not ok] == ["FIRE"]
    buffer = EpisodeBuffer()
    labels = [t % len(meanings) for t in range(30)]  # every action, FIRE five times
    for t, action in enumerate(labels):
        frame = np.full(spec.frame_shape, t, dtype=np.uint8)  # the frame says its step
        buffer.add(frame, action, 0.0, t == len(labels) - 1, False)
    demo = tmp_path / "fire.h5"
    DemoWriter(demo, spec).write_episodes([(buffer, "scripted", 0)])

    allowed_steps = [t for t, a in enumerate(labels) if a != fire]
    assert len(allowed_steps) == 25
    batches = _demo_batches(tiny(2, bc_coef=1.0, bc_batch_size=8), start, (str(demo),))
    for _epoch in range(2):
        seen: list[int] = []
        while len(seen) < len(allowed_steps):
            obs, actions = next(batches)
            assert obs.shape[1:] == start.observation_shape and obs.dtype == torch.uint8
            assert not (actions == fire).any(), actions
            for observation, action in zip(obs, actions, strict=True):
                step = int(observation[-1, 0, 0])  # the newest frame is the labelled step's
                assert torch.all(observation[-1] == step)
                assert int(action) == labels[step]
                seen.append(step)
        assert sorted(seen) == allowed_steps  # each allowed sample once per epoch


def test_resume_with_other_settings_does_not_silently_change_the_schedule(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`oakemu finetune ppo --resume` without repeating every option of the interrupted run
    must not quietly continue on another schedule (README: "--resume continues with the
    same global step, optimizer state and schedules"): either it refuses, naming the
    option, or it continues the saved run's schedule."""
    run_dir = tmp_path / "run"
    write_start(run_dir)
    original = tiny(4, lr=1e-3, warmup_updates=1, warmup_ramp_updates=1)
    real_collect = RolloutCollector.collect
    calls = {"n": 0}

    def interrupted(self: RolloutCollector):
        calls["n"] += 1
        if calls["n"] > 2:
            raise KeyboardInterrupt
        return real_collect(self)

    monkeypatch.setattr(RolloutCollector, "collect", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_ppo(run_dir, original)
    monkeypatch.setattr(RolloutCollector, "collect", real_collect)

    # as `oakemu finetune ppo --run-dir RUN --resume` would build it: other options default
    other = PPOConfig(num_envs=3, num_steps=16, total_steps=6 * 48, num_minibatches=2,
                      update_epochs=1, eval_episodes=0, checkpoint_every=1)
    try:
        final = load_checkpoint(run_ppo(run_dir, other, resume=True))
    except OakEmuError as error:
        assert re.search(r"num[_-]envs|total[_-]steps", str(error)), str(error)
        return
    records = update_records(run_dir)
    assert final.steps["ppo/global_step"] == 4 * 32, final.steps
    assert [r["charts/update"] for r in records] == [1, 2, 3, 4]
    assert [r["charts/learning_rate"] for r in records] == \
        pytest.approx([lr_at(original, u) for u in (1, 2, 3, 4)])


def test_missing_bc_demos_are_refused_before_the_run_directory_is_touched(
        tmp_path: Path) -> None:
    """The demo files of the BC loss are checked before any env starts or file opens: a
    refused run leaves the previous run's metrics as they were."""
    run_dir = tmp_path / "run"
    write_start(run_dir)
    run_ppo(run_dir, tiny(1))
    before = (run_dir / "ppo_metrics.jsonl").read_bytes()
    events = sorted((run_dir / "tb").rglob("*"))
    with pytest.raises(ConfigError, match="--bc-coef needs demo files"):
        run_ppo(run_dir, tiny(1, bc_coef=1.0))
    assert (run_dir / "ppo_metrics.jsonl").read_bytes() == before
    assert sorted((run_dir / "tb").rglob("*")) == events


def labelled_rollout(spec: EnvSpec, style: str, steps: int) -> Rollout:
    """One rollout of a tiny random policy in 2 envs (seeds 4 and 5), labelled by the
    scripted player in `style`; the envs step in worker processes."""
    torch.manual_seed(0)
    model = PPOModel(spec.observation_shape, len(action_meanings(spec)), TINY)
    mask = torch.from_numpy(action_mask(spec))
    collector = RolloutCollector(spec, model, mask, num_envs=2, num_steps=steps,
                                 device=torch.device("cpu"), seed=4, labeller=style)
    try:
        assert collector.env.pool.processes
        rollout = collector.collect()
    finally:
        collector.close()
    assert rollout.labels is not None and rollout.labels.shape == (steps, 2)
    return rollout


def test_rollout_labels_are_the_scripts_actions_on_the_observations_beside_them() -> None:
    """Replaying a labelled rollout's actions in single envs, a scripted player reading
    each env's RAM gives the label stored beside every observation, episode ends included."""
    pytest.importorskip("pyboy")
    from oakemu_rl.agents.scripted_catch import CatchDemonstrator
    from oakemu_rl.envs.gameboy import GameBoyEnv

    config = json.loads(EnvSpec(game="catch").game_config)
    config["game"]["max_steps"] = 15  # episodes end inside the rollout
    spec = EnvSpec(game="catch", game_config=json.dumps(config))
    rollout = labelled_rollout(spec, "planner", 40)
    script = CatchDemonstrator(spec)
    for i in range(2):
        env = GameBoyEnv(spec.for_evaluation())
        try:
            obs, _ = env.reset(seed=4 + i)
            for t in range(40):
                np.testing.assert_array_equal(rollout.obs[t, i].numpy(), obs)
                assert int(rollout.labels[t, i]) == script.decide(env.memory), (t, i)
                obs, _, terminated, truncated, _ = env.step(int(rollout.actions[t, i]))
                if terminated or truncated:
                    obs, _ = env.reset()
        finally:
            env.close()
    assert len(set(rollout.labels.flatten().tolist())) >= 2


@pytest.mark.parametrize("spec", [
    EnvSpec(game="pong", max_episode_frames=160),
    EnvSpec(game="breakout", fire_reset=True, max_episode_frames=160),
], ids=["pong", "breakout-serving"])
def test_atari_rollout_labels_are_the_human_players_actions_on_the_played_keys(
        spec: EnvSpec) -> None:
    """An Atari labelled rollout steps single envs in worker processes: replaying its
    actions in single envs, the human-style player gives every stored label when told
    each step which key was played (the agent's, or FIRE where the env serves), and is
    reset for each new game on its own seed (env i's first game seed + i, each later one
    2 further on). Games are cut at 40 steps, so each env starts new games inside the
    rollout."""
    from oakemu_rl.envs import make_env

    steps = 100
    fire = action_meanings(spec).index("FIRE")
    rollout = labelled_rollout(spec, "human", steps)
    for i in range(2):
        env = make_env(spec.for_evaluation())
        script = make_demonstrator(spec.for_evaluation(), style="human")
        games = 0
        try:
            obs, info = env.reset(seed=4 + i)
            script.reset(env, 4 + i)
            serve, lives = spec.fire_reset, info["lives"]
            for t in range(steps):
                np.testing.assert_array_equal(rollout.obs[t, i].numpy(), obs)
                assert int(rollout.labels[t, i]) == script.act(env, obs), (t, i)
                action = int(rollout.actions[t, i])
                script.was_taken(fire if serve else action)
                obs, _, terminated, truncated, info = env.step(action)
                serve, lives = spec.fire_reset and info["lives"] < lives, info["lives"]
                if terminated or truncated:
                    games += 1
                    obs, info = env.reset()
                    script.reset(env, 4 + i + 2 * games)
                    serve, lives = spec.fire_reset, info["lives"]
        finally:
            env.close()
        assert games >= 2
    moves = {int(a) for a in rollout.labels.flatten()} - {0, fire}
    assert moves  # the script moves the paddle on the agent's states


def test_label_rollouts_add_a_bc_loss_on_the_agents_own_states(tmp_path: Path) -> None:
    """With --label-rollouts each update logs the BC loss on its rollout's labels beside
    the one on demo batches; without it that loss is absent."""
    pytest.importorskip("pyboy")
    spec = EnvSpec(game="catch")
    demo = tmp_path / "catch.h5"
    recording.record(recording.RecordConfig(out=demo, spec=spec, episodes=1, seed=0,
                                            max_steps=64, progress=False),
                     make_demonstrator(spec, seed=0))
    run_dir = tmp_path / "run"
    train_bc(BCConfig(epochs=1, architecture="tiny", batch_size=16), [str(demo)],
             run_dir=run_dir, device="cpu", progress=False)
    plain = tmp_path / "plain"
    shutil.copytree(run_dir, plain)
    config = tiny(2, bc_coef=1.0, bc_batch_size=8, label_rollouts="planner")
    run_ppo(run_dir, config, checkpoint=str(run_dir / "bc.pt"))
    records = update_records(run_dir)
    assert len(records) == 2
    for record in records:
        assert math.isfinite(record["guards/bc_rollout_loss"])
        assert record["guards/bc_rollout_loss"] > 0 and record["guards/bc_loss"] > 0
    run_ppo(plain, dataclasses.replace(config, label_rollouts=None),
            checkpoint=str(plain / "bc.pt"))
    assert update_records(plain)[0]["guards/bc_rollout_loss"] is None


def test_label_rollouts_are_refused_where_no_script_can_give_them(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="label_rollouts='planner' is out of range"):
        tiny(1, label_rollouts="planner")  # no BC loss to feed
    run_dir = tmp_path / "run"
    write_start(run_dir)
    with pytest.raises(ConfigError, match=r"--label-rollouts dreamer: .*no style 'dreamer'"):
        run_ppo(run_dir, tiny(1, bc_coef=1.0, label_rollouts="dreamer"))
    assert not (run_dir / "ppo_metrics.jsonl").exists()
    other = tmp_path / "other"
    write_start(other, spec=EnvSpec(game="space_invaders"))
    with pytest.raises(ConfigError, match="no scripted demonstrator for space_invaders"):
        run_ppo(other, tiny(1, bc_coef=1.0, label_rollouts="planner"))
    assert not (other / "ppo_metrics.jsonl").exists()


# -- bf16 trunk -----------------------------------------------------------------------------


def test_bf16_runs_the_trunk_in_bf16_and_the_heads_in_fp32() -> None:
    """`mixed_forward` under bf16: the convolutions and the trunk's linear layer compute in
    bf16, the heads read fp32 features and give fp32 logits and values, near the fp32
    forward's but not equal to them. Gradients reach every parameter in fp32."""
    model = start_model()
    seen: dict[str, torch.dtype] = {}
    layers = {"conv": model.conv[0], "fc": model.fc[0], "policy_head": model.policy_head,
              "value_head": model.value_head}
    for name, module in layers.items():
        module.register_forward_hook(
            lambda m, args, out, name=name: seen.update({name: out.dtype,
                                                         f"{name} in": args[0].dtype}))
    x = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (5, 4, 84, 84),
                                                             dtype=np.uint8))
    logits32, values32 = mixed_forward(model, x, None)
    assert set(seen.values()) == {torch.float32}
    logits, values = mixed_forward(model, x, torch.bfloat16)
    assert {k: v for k, v in seen.items() if not k.endswith(" in")} == {
        "conv": torch.bfloat16, "fc": torch.bfloat16,
        "policy_head": torch.float32, "value_head": torch.float32}
    assert seen["policy_head in"] == seen["value_head in"] == torch.float32
    assert logits.dtype == values.dtype == torch.float32
    assert logits.shape == (5, 6) and values.shape == (5, 1)
    assert not torch.equal(logits, logits32)
    assert torch.allclose(logits, logits32, atol=0.05) and \
        torch.allclose(values, values32, atol=0.05)
    assert torch.equal(mixed_logits(model, x, torch.bfloat16), logits)
    (logits.sum() + values.sum()).backward()
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None and parameter.grad.dtype == torch.float32, name
        assert parameter.grad.abs().sum() > 0, name


def test_a_bf16_rollout_scores_its_actions_as_the_bf16_learning_step_does() -> None:
    """With amp the collector's log-probabilities and values are the bf16 forward's on the
    frames it stored, so PPO's first ratio starts at 1; they are not the fp32 forward's."""
    model = start_model()
    with torch.no_grad():  # logits of a clone's size, not a fresh head's near-zero ones
        model.policy_head.weight.mul_(300.0)
    mask = torch.ones(6, dtype=torch.bool)
    collector = RolloutCollector(spec_for(), model, mask, num_envs=2, num_steps=12,
                                 device=torch.device("cpu"), seed=4, amp=torch.bfloat16)
    try:
        rollout = collector.collect()
    finally:
        collector.close()
    obs = rollout.obs.reshape(-1, 4, 84, 84)
    actions = rollout.actions.reshape(-1, 1)
    with torch.no_grad():
        scored = {}
        for dtype in (torch.bfloat16, None):
            logits, values = mixed_forward(model, obs, dtype)
            log_probs = torch.log_softmax(logits, -1).gather(-1, actions)[:, 0]
            scored[dtype] = (log_probs, values[:, 0])
    error = (rollout.log_probs.reshape(-1) - scored[torch.bfloat16][0]).abs().max()
    gap = (rollout.log_probs.reshape(-1) - scored[None][0]).abs().max()
    assert error < 1e-3 < gap and error < gap / 10  # the fp32 forward scores them otherwise
    assert torch.allclose(rollout.values.reshape(-1), scored[torch.bfloat16][1], atol=1e-3)


def test_a_bf16_run_learns_and_saves_fp32_weights(tmp_path: Path) -> None:
    """`precision="bf16"` trains every tensor, saves fp32 weights and records its
    precision; from the same start and seed it ends elsewhere than the fp32 run."""
    ends = {}
    for precision in ("bf16", "fp32"):
        run_dir = tmp_path / precision
        write_start(run_dir)
        start = load_checkpoint(run_dir / "calibrated.pt").state_dict
        path = run_ppo(run_dir, tiny(2, warmup_updates=0, warmup_ramp_updates=0, lr=1e-3,
                                     precision=precision))
        final = load_checkpoint(path)
        assert final.config["precision"] == precision
        assert final.config["precision_used"] == precision
        for name, tensor in final.state_dict.items():
            assert tensor.dtype == torch.float32 and torch.isfinite(tensor).all(), name
            assert not torch.equal(tensor, start[name]), f"{name} did not learn"
        ends[precision] = final.state_dict
    assert any(not torch.equal(ends["bf16"][k], ends["fp32"][k]) for k in ends["fp32"])
    with pytest.raises(ConfigError, match="fp16"):
        PPOConfig(precision="fp16")
