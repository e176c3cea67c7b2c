"""`oakemu pipeline run FILE.toml`: record → bc → calibrate → ppo → test in one run directory.

A pipeline file names the env spec, where demos come from, and each stage's settings
(the fields of `BCConfig`, `CalibrateConfig`, `PPOConfig`; unknown keys and wrong types
are errors naming the key). Each stage's output is recorded in `pipeline_state.json` with
a fingerprint of everything that made it (its settings and its inputs' fingerprints): a
re-run skips stages whose output exists with the same fingerprint, so a crash or Ctrl-C
costs only the stage in progress, and `--force STAGE` redoes one (and what follows it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import runs
from .bootstrap.bc import BCConfig, train_bc
from .bootstrap.calibrate import CalibrateConfig, calibrate
from .checkpoint import load_checkpoint, policy_differences
from .envs import EnvSpec
from .errors import ConfigError, OakEmuError
from .finetune.ppo import PPOConfig, finetune_ppo
from .fsutil import atomic_write_text

STAGES = ("record", "bc", "calibrate", "ppo", "test")
STATE_FILE = "pipeline_state.json"


@dataclass(frozen=True)
class DemoSource:
    """Where the demos come from: an existing file, or the scripted demonstrator."""

    path: str | None = None
    """An existing demo file (used as is)."""
    episodes: int = 10
    """Episodes the scripted demonstrator records when `path` is not given."""
    noise: float = 0.0
    """Scripted demonstrator: chance per step of a random allowed action."""
    style: str = "planner"
    """Scripted demonstrator's style: planner, or on Pong follow (which BC copies well)."""
    max_steps: int | None = None
    """Cut each recorded episode after this many agent steps."""
    seed: int = 0
    """Seed of the first recorded episode."""
    relabel_episodes: int = 0
    """After BC, the clone plays this many episodes while the scripted demonstrator labels
    every frame with what it would do; a fresh BC model then trains on the demos and those
    frames (one DAgger round, for a clone that drifts from the demonstrator's states)."""
    relabel_rounds: int = 1
    """Relabelling rounds: each round's newest clone plays `relabel_episodes` episodes into
    relabelled.h5, relabelled2.h5, ..., and a fresh BC trains on the demos and all of them."""
    relabel_epochs: int | tuple[int, ...] | None = None
    """Epochs of each BC after a relabelling round: one number for every round, or a list
    with one per round (default: bc.epochs)."""

    def __post_init__(self) -> None:
        from .agents import SEED_MAX

        _check_section("demos", [
            ("episodes", self.episodes >= 1, "≥ 1", self.episodes),
            ("relabel_episodes", self.relabel_episodes >= 0, "≥ 0", self.relabel_episodes),
            ("relabel_rounds", self.relabel_rounds >= 1, "≥ 1", self.relabel_rounds),
            ("relabel_epochs", all(e >= 1 for e in self._epochs_per_round()),
             "≥ 1 (each)", self.relabel_epochs),
            ("relabel_epochs", not isinstance(self.relabel_epochs, tuple)
             or len(self.relabel_epochs) == self.relabel_rounds,
             f"one number, or a list of relabel_rounds = {self.relabel_rounds} numbers",
             self.relabel_epochs),
            ("noise", 0 <= self.noise <= 1, "in [0, 1]", self.noise),
            ("max_steps", self.max_steps is None or self.max_steps >= 1, "≥ 1", self.max_steps),
            ("seed", 0 <= self.seed <= SEED_MAX, f"from 0 to {SEED_MAX}", self.seed),
        ])

    def _epochs_per_round(self) -> list[int]:
        """relabel_epochs as one entry per round (empty when unset)."""
        epochs = self.relabel_epochs
        if epochs is None:
            return []
        return list(epochs) if isinstance(epochs, tuple) else [epochs] * self.relabel_rounds

    def epochs_after_round(self, round_: int, default: int) -> int:
        """Epochs of the BC that follows relabelling round `round_` (from 1)."""
        epochs = self._epochs_per_round()
        return epochs[round_ - 1] if epochs else default


@dataclass(frozen=True)
class EvalSettings:
    """The final greedy test."""

    episodes: int = 5
    """Greedy episodes per scored agent."""
    max_steps: int | None = None
    """Cut each test episode after this many agent steps."""
    seed: int = 1000
    """Seed of the first test episode."""
    demonstrator: bool = True
    """Also score the scripted demonstrator (when the game has one)."""

    def __post_init__(self) -> None:
        from .agents import SEED_MAX

        _check_section("evaluate", [
            ("episodes", self.episodes >= 1, "≥ 1", self.episodes),
            ("max_steps", self.max_steps is None or self.max_steps >= 1, "≥ 1", self.max_steps),
            ("seed", 0 <= self.seed <= SEED_MAX, f"from 0 to {SEED_MAX}", self.seed),
        ])


def _check_section(section: str, checks: list[tuple[str, bool, str, Any]]) -> None:
    for name, ok, rule, value in checks:
        if not ok:
            raise ConfigError(f"{section}.{name}={value!r} is out of range: it must be {rule}")


@dataclass(frozen=True)
class Pipeline:
    name: str
    env: EnvSpec
    demos: DemoSource
    bc: dict[str, Any] = field(default_factory=dict)
    calibrate: dict[str, Any] = field(default_factory=dict)
    ppo: dict[str, Any] = field(default_factory=dict)
    evaluate: EvalSettings = field(default_factory=EvalSettings)
    device: str = "auto"


# -- loading and validation ----------------------------------------------------------------

_STAGE_FIXED = {
    "bc": {"demos", "run_dir", "progress", "device"},
    "calibrate": {"run_dir", "checkpoint", "progress", "device"},
    "ppo": {"run_dir", "checkpoint", "resume", "progress", "device"},
}


_KINDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
_PLURALS = {int: "integers", float: "numbers", str: "strings"}


def _check_value(where: str, annotation: Any, value: Any) -> Any:
    """Check a TOML value against a dataclass field's annotation; return it converted."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        for choice in inner:  # the first alternative that takes the value
            try:
                return _check_value(where, choice, value)
            except ConfigError:
                if len(inner) == 1:
                    raise
        kinds = " or ".join(_KINDS.get(a) or "a list of " + _PLURALS.get(
            (typing.get_args(a) or (None,))[0], "values") for a in inner)
        raise ConfigError(f"{where} must be {kinds}, got {value!r}")
    if origin is tuple:
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be a list")
        return tuple(_check_value(f"{where}[{i}]", args[0], v) for i, v in enumerate(value))
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        return value
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a string, got {value!r}")
        return value
    raise ConfigError(f"{where} has a type this file cannot set")


def _fields(cls: type, table: Any, where: str, fixed: set[str] = frozenset()) -> dict[str, Any]:
    if not isinstance(table, dict):
        raise ConfigError(f"[{where}] must be a table")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)} - set(fixed)
    out = {}
    for key, value in table.items():
        if key not in names:
            raise ConfigError(f"unknown key {where}.{key} (known: {', '.join(sorted(names))})")
        out[key] = _check_value(f"{where}.{key}", hints[key], value)
    return out


def load_pipeline(path: str | Path) -> Pipeline:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"pipeline file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read pipeline file {path}: {error}") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"pipeline file {path} is not valid TOML: {error}") from None
    known = {"name", "device", "env", "demos", "bc", "calibrate", "ppo", "evaluate"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{path}: unknown key {unknown[0]} (known: {', '.join(sorted(known))})")
    try:
        env_fields = _fields(EnvSpec, data.get("env", {}), "env")
        env = EnvSpec(**env_fields)
        demos = DemoSource(**_fields(DemoSource, data.get("demos", {}), "demos"))
        stages = {
            "bc": _fields(BCConfig, data.get("bc", {}), "bc", _STAGE_FIXED["bc"]),
            "calibrate": _fields(CalibrateConfig, data.get("calibrate", {}), "calibrate",
                                 _STAGE_FIXED["calibrate"]),
            "ppo": _fields(PPOConfig, data.get("ppo", {}), "ppo", _STAGE_FIXED["ppo"]),
        }
        evaluate = EvalSettings(**_fields(EvalSettings, data.get("evaluate", {}), "evaluate"))
        if demos.path is None or demos.relabel_episodes:
            from .demos.scripted import SCRIPTED_STYLES

            styles = SCRIPTED_STYLES.get(env.game)
            if styles is None and demos.path is not None:
                raise ConfigError(f"demos.relabel_episodes needs a scripted {env.game} player "
                                  "to label the frames, and there is none: set it to 0")
            if styles is None:
                raise ConfigError(f"no scripted demonstrator for {env.game}: set demos.path "
                                  "to a recorded demo file")
            if demos.style not in styles:
                raise ConfigError(f"demos.style={demos.style!r} is not a style of the scripted "
                                  f"{env.game} player (styles: {', '.join(styles)})")
        # Build each stage's config once now, so a bad value fails before any work starts.
        BCConfig(demos=("x.h5",), **stages["bc"])
        CalibrateConfig(**stages["calibrate"])
        PPOConfig(**stages["ppo"])
    except OakEmuError as error:
        raise ConfigError(f"{path}: {error}") from None
    name = data.get("name", path.stem)
    if not isinstance(name, str):
        raise ConfigError(f"{path}: name must be a string")
    device = data.get("device", "auto")
    if not isinstance(device, str):
        raise ConfigError(f"{path}: device must be a string")
    return Pipeline(name=name, env=env, demos=demos, evaluate=evaluate, device=device,
                    **stages)


# -- state ------------------------------------------------------------------------------------


def _fingerprint(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _read_state(run_dir: Path) -> dict[str, Any]:
    try:
        state = json.loads((run_dir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


@dataclass
class StageResult:
    stage: str
    output: str
    fingerprint: str
    wall_seconds: float
    skipped: bool
    info: dict[str, Any] = field(default_factory=dict)


class PipelineRun:
    """Runs the stages of `pipeline` in `run_dir`, skipping up-to-date ones."""

    def __init__(self, pipeline: Pipeline, run_dir: Path, force: tuple[str, ...] = (),
                 progress: bool = True) -> None:
        self.pipeline = pipeline
        self.run_dir = runs.prepare_run_dir(run_dir, pipeline.env.game)
        self.force = set(force)
        self.progress = progress
        self.state = _read_state(self.run_dir)
        self.results: dict[str, StageResult] = {}
        unknown = self.force - set(STAGES)
        if unknown:
            raise ConfigError(f"--force takes one of {', '.join(STAGES)}, got {sorted(unknown)}")

    def _say(self, text: str) -> None:
        if self.progress:
            from tqdm import tqdm

            tqdm.write(text)

    def _stage(self, stage: str, settings: Any, upstream: list[str], output: Path,
               work) -> StageResult:
        fingerprint = _fingerprint(stage, settings, [self.results[u].fingerprint
                                                     for u in upstream])
        previous = self.state.get(stage, {})
        redo = stage in self.force or any(not self.results[u].skipped for u in upstream)
        if not redo and previous.get("fingerprint") == fingerprint and output.exists():
            self._say(f"[{stage}] up to date: {output}")
            result = StageResult(stage, str(output), fingerprint,
                                 float(previous.get("wall_seconds", 0.0)), True,
                                 previous.get("info", {}))
        else:
            self._say(f"[{stage}] running")
            start = time.perf_counter()
            info = work() or {}
            result = StageResult(stage, str(output), fingerprint, time.perf_counter() - start,
                                 False, info)
            self.state[stage] = dataclasses.asdict(result)
            atomic_write_text(self.run_dir / STATE_FILE, json.dumps(self.state, indent=2))
        self.results[stage] = result
        return result

    def run(self) -> dict[str, StageResult]:
        p = self.pipeline
        spec = p.env.for_evaluation()
        demo_path = Path(p.demos.path) if p.demos.path else self.run_dir / "demos.h5"

        def record_demos() -> dict[str, Any]:
            from .demos.record import RecordConfig, record
            from .demos.scripted import make_demonstrator

            if demo_path.exists():  # a stale or partial recording of a changed config
                demo_path.unlink()
            agent = make_demonstrator(spec, seed=p.demos.seed, noise=p.demos.noise,
                                      style=p.demos.style)
            result = record(RecordConfig(out=demo_path, spec=spec, episodes=p.demos.episodes,
                                         seed=p.demos.seed, max_steps=p.demos.max_steps,
                                         progress=self.progress), agent)
            returns = [e["return"] for e in result.episodes]
            return {"episodes": len(returns), "steps": sum(e["length"] for e in result.episodes),
                    "mean_return": sum(returns) / len(returns)}

        if p.demos.path:
            if not demo_path.exists():
                raise ConfigError(f"demos.path {demo_path} does not exist")
            stat = demo_path.stat()
            settings: Any = {"path": str(demo_path.resolve()), "size": stat.st_size,
                             "mtime": stat.st_mtime_ns}
            self._stage("record", settings, [], demo_path, lambda: None)
        else:
            recording = {k: v for k, v in dataclasses.asdict(p.demos).items()
                         if not k.startswith("relabel_")}
            self._stage("record", [recording, spec.to_dict()], [], demo_path, record_demos)

        bc_config = BCConfig(demos=(str(demo_path),), run_dir=str(self.run_dir),
                             device=p.device, progress=self.progress, **p.bc)
        relabel = {"episodes": p.demos.relabel_episodes, "epochs": p.demos.relabel_epochs,
                   "rounds": p.demos.relabel_rounds}
        self._stage("bc", [p.bc, relabel] if p.demos.relabel_episodes else p.bc, ["record"],
                    self.run_dir / "bc.pt", lambda: self._steps(self._bc(bc_config)))
        cal_config = CalibrateConfig(run_dir=str(self.run_dir), device=p.device,
                                     progress=self.progress, **p.calibrate)
        self._stage("calibrate", p.calibrate, ["bc"], self.run_dir / "calibrated.pt",
                    lambda: self._steps(calibrate(cal_config)))
        ppo_config = PPOConfig(run_dir=str(self.run_dir), device=p.device,
                               progress=self.progress, **p.ppo)
        resume = (self.run_dir / "ppo_last.pt").exists() and "ppo" not in self.force \
            and self.results["calibrate"].skipped \
            and self.state.get("ppo_started") == _fingerprint(
                "ppo", p.ppo, [self.results["calibrate"].fingerprint])

        def run_ppo() -> dict[str, Any]:
            self.state["ppo_started"] = _fingerprint(
                "ppo", p.ppo, [self.results["calibrate"].fingerprint])
            atomic_write_text(self.run_dir / STATE_FILE, json.dumps(self.state, indent=2))
            config = dataclasses.replace(ppo_config, resume=resume)
            return self._steps(finetune_ppo(config))

        self._stage("ppo", p.ppo, ["calibrate"], self.run_dir / "ppo.pt", run_ppo)
        self._stage("test", dataclasses.asdict(p.evaluate), ["ppo"],
                    self.run_dir / "test.json", self._test)
        return self.results

    def _bc(self, config: BCConfig) -> Path:
        """BC on the demos; with demos.relabel_episodes, relabelling rounds, each followed by
        a fresh BC on the demos and every relabelled file so far."""
        path = train_bc(config)
        demos = self.pipeline.demos
        if not demos.relabel_episodes:
            return path
        from .demos.record import RecordConfig, record, relabelling_agents

        files = list(config.demos)
        for round_ in range(1, demos.relabel_rounds + 1):
            suffix = "" if round_ == 1 else str(round_)
            relabelled = self.run_dir / f"relabelled{suffix}.h5"
            if relabelled.exists():  # left by an interrupted run: its clone is gone
                relabelled.unlink()
            labeller, driver, spec = relabelling_agents(path, style=demos.style,
                                                        seed=demos.seed, device=config.device)
            self._say(f"[bc] relabelling round {round_}/{demos.relabel_rounds}: the clone "
                      f"plays {demos.relabel_episodes} episode(s), the scripted demonstrator "
                      "labels them")
            record(RecordConfig(out=relabelled, spec=spec, episodes=demos.relabel_episodes,
                                seed=demos.seed + demos.episodes
                                + (round_ - 1) * demos.relabel_episodes,
                                max_steps=demos.max_steps, progress=self.progress),
                   labeller, driver)
            files.append(str(relabelled))
            # Keep the curves of the BC this round replaces: bc_first_* for the clone of the
            # demos alone, bc_round{k}_* for the clone after round k.
            keep = "bc_first_" if round_ == 1 else f"bc_round{round_ - 1}_"
            for name in ("bc_metrics.jsonl", "bc_curves.png"):
                done = self.run_dir / name
                if done.exists():
                    done.replace(self.run_dir / name.replace("bc_", keep, 1))
            # A fresh model: continuing the first clone for 5 epochs gained about a third of
            # what retraining did (benchmarks/bc_quality.py --relabel-episodes).
            path = train_bc(dataclasses.replace(
                config, demos=tuple(files), epochs=demos.epochs_after_round(round_, config.epochs)))
        return path

    @staticmethod
    def _steps(path: Path) -> dict[str, Any]:
        checkpoint = load_checkpoint(path)
        info: dict[str, Any] = {"steps": checkpoint.steps}
        calibration = checkpoint.extra.get("calibration")
        if calibration:
            info["explained_variance"] = calibration.get("explained_variance")
            info["initial_explained_variance"] = calibration.get("initial_explained_variance")
            info["linear_ceiling"] = calibration.get("linear_ceiling_explained_variance")
        return info

    def _test(self) -> dict[str, Any]:
        from .tester import EvalConfig, evaluate, load_policy_agent

        p = self.pipeline
        config = EvalConfig(episodes=p.evaluate.episodes, seed=p.evaluate.seed,
                            max_steps=p.evaluate.max_steps, progress=self.progress)
        scores: dict[str, Any] = {}
        for stage, name in (("bc", "bc.pt"), ("calibrate", "calibrated.pt"), ("ppo", "ppo.pt")):
            if stage == "calibrate" and _same_policy(self.run_dir / "bc.pt",
                                                     self.run_dir / name):
                # Calibration leaves the policy bit-identical, and greedy games on the same
                # seeds replay exactly: BC's games are the calibrated policy's games.
                scores[stage] = {**scores["bc"], "same_policy_as": "bc"}
                continue
            agent, spec = load_policy_agent(self.run_dir / name, device=p.device)
            scores[stage] = evaluate(agent, spec, config).to_dict()
        if p.evaluate.demonstrator:
            from .demos.scripted import SCRIPTED_GAMES, make_demonstrator

            spec = p.env.for_evaluation()
            if spec.game in SCRIPTED_GAMES:
                agent = make_demonstrator(spec, seed=p.evaluate.seed, style=p.demos.style)
                scores["demonstrator"] = evaluate(agent, spec, config).to_dict()
        atomic_write_text(self.run_dir / "test.json", json.dumps(scores, indent=2))
        return {"scores": {k: v["mean"] for k, v in scores.items()}}


def _same_policy(first: Path, second: Path) -> bool:
    """Whether two checkpoints hold equal tensors everywhere outside the value head."""
    return not policy_differences(load_checkpoint(first).state_dict,
                                  load_checkpoint(second).state_dict)


# -- report ----------------------------------------------------------------------------------


_STAGE_STEPS = {
    "bc": ("epochs", "samples"),
    "calibrate": ("calibrate_iterations", "calibrate_env_steps"),
    "ppo": ("updates", "global_step"),
}


def summary_table(results: dict[str, StageResult]) -> str:
    """Scores, calibration and per-stage steps and wall time, as aligned text."""
    scores = results["test"].info.get("scores", {}) if "test" in results else {}
    lines = ["agent          greedy score"]
    for name in ("demonstrator", "bc", "calibrate", "ppo"):
        if name in scores:
            label = {"calibrate": "calibrated"}.get(name, name)
            lines.append(f"{label:<14} {scores[name]:+9.2f}")
    cal = results.get("calibrate")
    if cal and cal.info.get("explained_variance") is not None:
        lines.append("")
        lines.append(f"calibration explained variance {cal.info['initial_explained_variance']:.3f}"
                     f" -> {cal.info['explained_variance']:.3f} (held-out)")
        if cal.info.get("linear_ceiling") is not None:
            lines.append(f"  least-squares value head on the BC features: "
                         f"{cal.info['linear_ceiling']:.3f}")
    lines.append("")
    lines.append("stage       wall time   steps")
    for stage in STAGES:
        r = results.get(stage)
        if r is None:
            continue
        steps = ""
        if isinstance(r.info.get("steps"), dict):
            own = {k: v for k, v in r.info["steps"].items() if k in _STAGE_STEPS.get(stage, ())}
            steps = ", ".join(f"{k}={v:,}" for k, v in own.items())
        elif stage == "record" and r.info:
            steps = f"{r.info['episodes']} episodes, {r.info['steps']:,} steps"
        note = " (up to date)" if r.skipped else ""
        lines.append(f"{stage:<10} {r.wall_seconds:8.0f}s   {steps}{note}")
    return "\n".join(lines)


def write_report(run_dir: Path, pipeline: Pipeline, results: dict[str, StageResult]) -> Path:
    """report.md with the summary table and PNG plots, beside the checkpoints."""
    from .metrics import read_metrics
    from .plots import plot_learning_curve

    images = []
    ppo_metrics = run_dir / "ppo_metrics.jsonl"
    if ppo_metrics.exists():
        records = read_metrics(ppo_metrics)
        series = {
            label: [(r["step"], r[key]) for r in records if r.get(key) is not None]
            for label, key in (("training episodes (sampled actions)", "charts/episodic_return"),
                               ("greedy evaluation", "eval/greedy_return"))
        }
        if any(series.values()):
            plot_learning_curve(series, run_dir / "ppo_curve.png")
            images.append(("PPO learning curve", "ppo_curve.png"))
    for title, name in (("BC train/validation curves", "bc_curves.png"),
                        ("Calibration: predicted value vs return", "calibration_scatter.png")):
        if (run_dir / name).exists():
            images.append((title, name))
    body = [f"# {pipeline.name}: {pipeline.env.env_id}", "", "```", summary_table(results),
            "```", ""]
    for title, name in images:
        body += [f"## {title}", "", f"![{title}]({name})", ""]
    path = run_dir / "report.md"
    atomic_write_text(path, "\n".join(body))
    return path
