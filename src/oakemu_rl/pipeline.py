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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import runs
from .agents.play import EvalConfig, score_text
from .bootstrap.bc import BCConfig, train_bc
from .bootstrap.calibrate import CalibrateConfig, calibrate
from .checkpoint import load_checkpoint, policy_differences
from .configs import check_options, coerce, from_table
from .envs import EnvSpec
from .errors import ConfigError, OakEmuError
from .finetune.ppo import PPOConfig, finetune_ppo, selection_summary
from .fsutil import atomic_write_text
from .options import config_args
from .runtime import SEED_MAX, usable_cpus

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
    workers: int = 0
    """Processes that play the recorded games, one thread each (0: one per usable core, as
    the pipeline runs one stage at a time); the file does not depend on it."""

    def __post_init__(self) -> None:
        check_options(self, [
            ("episodes", self.episodes >= 1, "≥ 1"),
            ("noise", 0 <= self.noise <= 1, "in [0, 1]"),
            ("max_steps", self.max_steps is None or self.max_steps >= 1, "≥ 1"),
            ("seed", 0 <= self.seed <= SEED_MAX, f"from 0 to {SEED_MAX}"),
            ("workers", self.workers >= 0, "≥ 0"),
        ], section="demos")


# Relabelling is a setting of the bc stage now; an old file says where it went.
MOVED_DEMOS_KEYS = {key: f"set it as {key} under [bc]" for key in
                    ("relabel_episodes", "relabel_rounds", "relabel_epochs")}


@dataclass(frozen=True)
class FinalTestConfig(EvalConfig):
    """The pipeline's final greedy test: `EvalConfig`'s games on seeds of their own, which
    neither PPO's training envs nor its selection games (ppo.eval_seed) play."""

    episodes: int = 10
    """Greedy episodes per scored agent (each mean is quoted ± its standard error)."""
    seed: int = 1000
    """Seed of the first test episode (seeds seed to seed + episodes - 1)."""
    demonstrator: bool = True
    """Also score the scripted demonstrator (when the game has one)."""
    workers: int = 0
    """Processes that play the games, one thread each (0: one per usable core, as the
    pipeline runs one stage at a time); the scores do not depend on it."""

    def __post_init__(self) -> None:
        check_options(self, self.checks(), section="evaluate")

    def checks(self) -> list[tuple[str, bool, str]]:
        return [*(check for check in super().checks() if check[0] != "workers"),
                ("workers", self.workers >= 0, "≥ 0")]


@dataclass(frozen=True)
class DistributedSettings:
    """How many processes the training stages (bc, ppo) run on; the others run in one."""

    nproc_per_node: int = 1
    """Processes on this machine, started through torchrun (1: no torchrun)."""

    def __post_init__(self) -> None:
        check_options(self, [("nproc_per_node", 1 <= self.nproc_per_node <= 256,
                              "from 1 to 256")], section="distributed")


@dataclass(frozen=True)
class Pipeline:
    name: str
    env: EnvSpec
    demos: DemoSource
    bc: BCConfig = field(default_factory=BCConfig)
    calibrate: CalibrateConfig = field(default_factory=CalibrateConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    evaluate: FinalTestConfig = field(default_factory=FinalTestConfig)
    distributed: DistributedSettings = field(default_factory=DistributedSettings)
    device: str = "auto"


# -- loading and validation ----------------------------------------------------------------

SECTIONS = {"env": EnvSpec, "demos": DemoSource, "bc": BCConfig, "calibrate": CalibrateConfig,
            "ppo": PPOConfig, "evaluate": FinalTestConfig, "distributed": DistributedSettings}


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"pipeline file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read pipeline file {path}: {error}") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"pipeline file {path} is not valid TOML: {error}") from None


def _beside(path: Path, value: str) -> Path:
    """A path named in pipeline file `path`: absolute as given, else relative to that file."""
    file = Path(value).expanduser()
    return file if file.is_absolute() else path.parent / file


def _read_layers(path: Path, chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A pipeline file's tables over those of its `base` file (and that file's base, ...):
    a table this file gives replaces the base's keys one by one, so a preset that differs in
    one stage names only that stage's changes. Paths in [env] are made absolute first, as
    each file means them relative to itself."""
    if path.resolve() in chain:
        loop = " -> ".join(str(p) for p in (*chain, path.resolve()))
        raise ConfigError(f"pipeline base files form a loop: {loop}")
    data = _read_toml(path)
    env = data.get("env")
    if isinstance(env, dict):
        data["env"] = env = dict(env)
        for key in ("rom", "game_config"):
            value = env.get(key)
            if isinstance(value, str) and value.strip() and not value.strip().startswith("{"):
                env[key] = str(_beside(path, value))
    if "base" not in data:
        return data
    base = data.pop("base")
    if not isinstance(base, str) or not base.strip():
        raise ConfigError(f"{path}: base must be the path of another pipeline file, "
                          f"not {base!r}")
    base_path = _beside(path, base)
    try:
        merged = _read_layers(base_path, (*chain, path.resolve()))
    except ConfigError as error:
        raise ConfigError(f"{path}: base {base}: {error}") from None
    merged.pop("name", None)  # a file's name is its own (default: its file name)
    for key, value in data.items():
        below = merged.get(key)
        merged[key] = {**below, **value} if isinstance(value, dict) and \
            isinstance(below, dict) else value
    return merged


def load_pipeline(path: str | Path) -> Pipeline:
    """Read and check a pipeline file: every section is built by its config class, so a bad
    value fails here, before any work starts, in one line naming the key. A file may name a
    `base` file whose tables it changes key by key."""
    path = Path(path)
    data = _read_layers(path)
    known = {"name", "device", *SECTIONS}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{path}: unknown key {unknown[0]} (known: {', '.join(sorted(known))})")
    try:
        data["env"] = _env_table(data.get("env", {}))
        sections = {name: from_table(cls, data.get(name, {}), name,
                                     MOVED_DEMOS_KEYS if name == "demos" else None)
                    for name, cls in SECTIONS.items()}
        _check_scripted(sections["env"], sections["demos"], sections["bc"])
        _check_test_seeds(sections["evaluate"], sections["ppo"], sections["distributed"])
        sections["calibrate"] = _critic_for_ppo(sections["calibrate"], sections["ppo"],
                                                data.get("calibrate", {}))
        name = coerce("name", str, data.get("name", path.stem))
        device = coerce("device", str, data.get("device", "auto"))
    except OakEmuError as error:
        raise ConfigError(f"{path}: {error}") from None
    return Pipeline(name=name, device=device, **sections)


def _env_table(table: Any) -> Any:
    """[env] as EnvSpec takes it: a Game Boy `rom = "PATH"` (made absolute by
    `_read_layers`) is checked and kept in the ROM store (the spec holds its sha256)."""
    if not isinstance(table, dict) or "rom" not in table:
        return table
    from .envs.roms import add_rom

    table = dict(table)
    table["rom_sha256"], _title = add_rom(Path(coerce("env.rom", str, table.pop("rom"))))
    return table


def _critic_for_ppo(calibrate: CalibrateConfig, ppo: PPOConfig, table: dict[str, Any]
                    ) -> CalibrateConfig:
    """Calibration fits the critic to the returns PPO will train it on: [calibrate] takes
    [ppo]'s reward clipping, episodic life and discount, and may not set them otherwise."""
    from .finetune.ppo import CRITIC_RETURNS

    for key in CRITIC_RETURNS:
        if key in table and table[key] != getattr(ppo, key):
            raise ConfigError(f"calibrate.{key}={table[key]!r} differs from ppo.{key}="
                              f"{getattr(ppo, key)!r}: the critic must be calibrated for the "
                              f"returns PPO trains it on; set {key} under [ppo] only")
    return dataclasses.replace(calibrate, **{k: getattr(ppo, k) for k in CRITIC_RETURNS})


def _check_test_seeds(test: FinalTestConfig, ppo: PPOConfig,
                      distributed: DistributedSettings) -> None:
    """The final test plays games that neither picked the shipped policy nor trained it."""
    from .finetune.ppo import describe_seeds, seeds_overlap

    others = (("ppo.eval_seed", ppo.selection_seeds, "PPO's selection games"),
              ("ppo.seed", ppo.training_seeds(distributed.nproc_per_node),
               "PPO's training envs"))
    for key, seeds, what in others:
        if seeds_overlap(test.seeds, seeds):
            raise ConfigError(
                f"evaluate.seed={test.seed} (test seeds {describe_seeds(test.seeds)}) overlaps "
                f"{key}={getattr(ppo, key.split('.')[1])} ({what}, seeds "
                f"{describe_seeds(seeds)}): the final test must play other games; move one")


def _check_scripted(env: EnvSpec, demos: DemoSource, bc: BCConfig) -> None:
    """The scripted player that records or relabels must exist in the style asked for."""
    if demos.path is not None and not bc.relabel_episodes:
        return
    from .agents.scripted import SCRIPTED_STYLES

    styles = SCRIPTED_STYLES.get(env.game)
    if styles is None and demos.path is not None:
        raise ConfigError(f"bc.relabel_episodes needs a scripted {env.game} player to label "
                          "the frames, and there is none: set it to 0")
    if styles is None:
        raise ConfigError(f"no scripted demonstrator for {env.game}: set demos.path to a "
                          "recorded demo file")
    for where, style in (("demos.style", demos.style), ("bc.relabel_style", bc.relabel_style)):
        if where == "bc.relabel_style" and not bc.relabel_episodes:
            continue
        if style not in styles:
            raise ConfigError(f"{where}={style!r} is not a style of the scripted {env.game} "
                              f"player (styles: {', '.join(styles)})")


# -- state ------------------------------------------------------------------------------------


LATER_OPTIONS = frozenset({"label_rollouts", "relabel_noise", "fire_reset", "sharpen",
                           "anneal_ent", "PPOConfig.precision"})
"""Stage options added after run directories were made with this version's stages: a
stage's fingerprint leaves each out while it holds its default, so that adding an option
does not make every earlier run's stages stale (and rerun them). A name alone covers that
option in every stage; `Config.name` covers it in one config class only (bc has always had
a `precision`). A test pins each stage's default fingerprint, so an option added without a
place here fails it."""


SPEED_OPTIONS = frozenset({"workers", "relabel_workers"})
"""Stage options that change how fast a stage runs and never what it makes (the test
stage's scores and the recorded games are the same on any number of processes): no
fingerprint covers them, so changing one reruns nothing."""


def _settings(config: Any, settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a stage's fingerprint covers of its config (of `settings`, its dict form, when
    given: the env spec's is `EnvSpec.to_dict()`)."""
    settings = dataclasses.asdict(config) if settings is None else dict(settings)
    for item in dataclasses.fields(config):
        later = {item.name, f"{type(config).__name__}.{item.name}"} & LATER_OPTIONS
        if item.name in SPEED_OPTIONS or (later and settings[item.name] == item.default):
            del settings[item.name]
    return settings


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
        """record → bc → calibrate → ppo → test, each skipped when up to date."""
        p, run_dir = self.pipeline, str(self.run_dir)
        places = {"device": p.device, "progress": self.progress}
        demo_path = self._record()
        self._stage("bc", _settings(p.bc), ["record"], self.run_dir / "bc.pt",
                    lambda: self._checkpoint_info(self._train_bc(demo_path)))
        self._stage("calibrate", _settings(p.calibrate), ["bc"],
                    self.run_dir / "calibrated.pt",
                    lambda: self._checkpoint_info(calibrate(p.calibrate, run_dir=run_dir,
                                                            **places)))
        ppo_settings = _settings(p.ppo)
        started = _fingerprint("ppo", ppo_settings, [self.results["calibrate"].fingerprint])
        resume = (self.run_dir / "ppo_last.pt").exists() and "ppo" not in self.force \
            and self.results["calibrate"].skipped and self.state.get("ppo_started") == started

        def run_ppo() -> dict[str, Any]:
            self.state["ppo_started"] = started
            atomic_write_text(self.run_dir / STATE_FILE, json.dumps(self.state, indent=2))
            return self._checkpoint_info(self._finetune_ppo(resume))

        self._stage("ppo", ppo_settings, ["calibrate"], self.run_dir / "ppo.pt", run_ppo)
        self._stage("test", _settings(p.evaluate), ["ppo"],
                    self.run_dir / "test.json", self._test)
        return self.results

    def _train_bc(self, demo_path: Path) -> Path:
        p, nproc = self.pipeline, self.pipeline.distributed.nproc_per_node
        if nproc == 1:
            return train_bc(p.bc, (str(demo_path),), run_dir=str(self.run_dir), device=p.device,
                            progress=self.progress)
        launch_ranks("bc", nproc, ["bootstrap", "bc", str(demo_path), *config_args(p.bc),
                                   *self._place_args()])
        return self.run_dir / "bc.pt"

    def _finetune_ppo(self, resume: bool) -> Path:
        p, nproc = self.pipeline, self.pipeline.distributed.nproc_per_node
        if nproc == 1:
            return finetune_ppo(p.ppo, run_dir=str(self.run_dir), resume=resume,
                                device=p.device, progress=self.progress)
        launch_ranks("ppo", nproc, ["finetune", "ppo", *config_args(p.ppo), *self._place_args(),
                                    *(["--resume"] if resume else [])])
        return self.run_dir / "ppo.pt"

    def _place_args(self) -> list[str]:
        return ["--run-dir", str(self.run_dir), "--device", self.pipeline.device,
                "--progress" if self.progress else "--no-progress"]

    def _record(self) -> Path:
        """The demo file: the one the pipeline names, or a scripted recording."""
        p = self.pipeline
        if p.demos.path:
            demo_path = Path(p.demos.path)
            if not demo_path.exists():
                raise ConfigError(f"demos.path {demo_path} does not exist")
            stat = demo_path.stat()
            settings: Any = {"path": str(demo_path.resolve()), "size": stat.st_size,
                             "mtime": stat.st_mtime_ns}
            self._stage("record", settings, [], demo_path, lambda: None)
            return demo_path
        demo_path = self.run_dir / "demos.h5"
        spec = p.env.for_evaluation()

        def record_demos() -> dict[str, Any]:
            from .agents.recording import RecordConfig, record
            from .agents.scripted import make_demonstrator

            if demo_path.exists():  # a stale or partial recording of a changed config
                demo_path.unlink()
            agent = make_demonstrator(spec, seed=p.demos.seed, noise=p.demos.noise,
                                      style=p.demos.style)
            result = record(RecordConfig(out=demo_path, spec=spec, episodes=p.demos.episodes,
                                         seed=p.demos.seed, max_steps=p.demos.max_steps,
                                         progress=self.progress,
                                         workers=p.demos.workers or usable_cpus()), agent)
            returns = [e["return"] for e in result.episodes]
            return {"episodes": len(returns), "steps": sum(e["length"] for e in result.episodes),
                    "mean_return": sum(returns) / len(returns)}

        self._stage("record", [_settings(p.demos), _settings(spec, spec.to_dict())], [],
                    demo_path, record_demos)
        return demo_path

    @staticmethod
    def _checkpoint_info(path: Path) -> dict[str, Any]:
        """What the summary shows of a stage's checkpoint: its steps, and calibration's
        explained variance."""
        checkpoint = load_checkpoint(path)
        info: dict[str, Any] = {"steps": checkpoint.steps}
        calibration = checkpoint.extra.get("calibration")
        if calibration:
            info["explained_variance"] = calibration.get("explained_variance")
            info["initial_explained_variance"] = calibration.get("initial_explained_variance")
            info["linear_ceiling"] = calibration.get("linear_ceiling_explained_variance")
        if "selection" in checkpoint.extra:
            info["selection"] = checkpoint.extra["selection"]
        return info

    def _test(self) -> dict[str, Any]:
        from .agents import load_policy_agent
        from .agents.play import play_games

        p = self.pipeline
        games = EvalConfig(episodes=p.evaluate.episodes, seed=p.evaluate.seed,
                           max_steps=p.evaluate.max_steps,
                           workers=p.evaluate.workers or usable_cpus())
        scores: dict[str, Any] = {}
        for stage, name in (("bc", "bc.pt"), ("calibrate", "calibrated.pt"), ("ppo", "ppo.pt")):
            if stage == "calibrate" and _same_policy(self.run_dir / "bc.pt",
                                                     self.run_dir / name):
                # Calibration leaves the policy bit-identical, and greedy games on the same
                # seeds replay exactly: BC's games are the calibrated policy's games.
                scores[stage] = {**scores["bc"], "same_policy_as": "bc"}
                continue
            agent, spec = load_policy_agent(self.run_dir / name, device=p.device)
            scores[stage] = play_games(agent, spec, games, progress=self.progress).to_dict()
        if p.evaluate.demonstrator:
            from .agents.scripted import SCRIPTED_GAMES, make_demonstrator

            spec = p.env.for_evaluation()
            if spec.game in SCRIPTED_GAMES:
                agent = make_demonstrator(spec, seed=p.evaluate.seed, style=p.demos.style)
                scores["demonstrator"] = play_games(agent, spec, games,
                                                    progress=self.progress).to_dict()
        for name, score in scores.items():
            self._say(f"[test] {name}: {score_text(score['mean'], score['sem'], score['episodes'])}"
                      f" on seeds {games.seeds.start}-{games.seeds.stop - 1}")
        atomic_write_text(self.run_dir / "test.json", json.dumps(scores, indent=2))
        return {"scores": {k: {"mean": v["mean"], "sem": v["sem"], "episodes": v["episodes"]}
                           for k, v in scores.items()},
                "seeds": [games.seeds.start, games.seeds.stop - 1]}


def launch_ranks(stage: str, nproc: int, command: list[str]) -> None:
    """Run `oakemu COMMAND` on `nproc` processes of this machine through torchrun, showing
    their output as it comes; a failure ends in one line with the ranks' own error."""
    import subprocess
    import sys
    from collections import deque

    args = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}",
            "-m", "oakemu_rl", *command]
    tail: deque[str] = deque(maxlen=200)
    with subprocess.Popen(args, stderr=subprocess.PIPE, text=True, errors="replace") as process:
        for line in process.stderr:
            sys.stderr.write(line)
            tail.append(line.strip())
    if process.returncode != 0:
        errors = [line for line in tail if line.startswith("Error:")]
        why = errors[0][len("Error:"):].strip() if errors else f"exit status {process.returncode}"
        raise OakEmuError(f"the {stage} stage failed on {nproc} processes: {why}")


def _free_port() -> int:
    import socket

    with socket.socket() as handle:
        handle.bind(("127.0.0.1", 0))
        return handle.getsockname()[1]


def _same_policy(first: Path, second: Path) -> bool:
    """Whether two checkpoints hold equal tensors everywhere outside the value head."""
    return not policy_differences(load_checkpoint(first).state_dict,
                                  load_checkpoint(second).state_dict)


# -- report ----------------------------------------------------------------------------------


_STAGE_STEPS = {
    "bc": ("bc/epochs", "bc/samples"),
    "calibrate": ("calibrate/iterations", "calibrate/env_steps"),
    "ppo": ("ppo/updates", "ppo/global_step"),
}


def summary_table(results: dict[str, StageResult]) -> str:
    """Scores, calibration and per-stage steps and wall time, as aligned text."""
    test = results["test"].info if "test" in results else {}
    scores = test.get("scores", {})
    seeds = test.get("seeds")
    lines = ["agent          greedy score ± standard error"
             + (f" (test seeds {seeds[0]}-{seeds[-1]})" if seeds else "")]
    for name in ("demonstrator", "bc", "calibrate", "ppo"):
        if name in scores:
            label = {"calibrate": "calibrated"}.get(name, name)
            lines.append(f"{label:<14} {_score(scores[name])}")
    ppo = results.get("ppo")
    if ppo and ppo.info.get("selection"):
        lines.append(f"ppo.pt is {selection_summary(ppo.info['selection'])}")
    cal = results.get("calibrate")
    if cal and cal.info.get("explained_variance") is not None:
        lines.append("")
        lines.append(f"calibration explained variance {cal.info['initial_explained_variance']:.3f}"
                     f" -> {cal.info['explained_variance']:.3f} (on fresh games after the fit)")
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


def _score(score: Any) -> str:
    """A test score as the summary quotes it; a state file from before scores kept their
    standard error holds a bare mean."""
    if isinstance(score, dict):
        return score_text(score["mean"], score.get("sem"), score["episodes"])
    return f"{score:+.2f} (games and SE not recorded)"


def ppo_progress(records: list[dict[str, Any]]) -> list[str]:
    """A markdown table of a PPO run, one row per greedy evaluation: its selection games
    beside the sampled training games and the policy's mean entropy since the evaluation
    before. PPO learns from sampled play, and a policy whose entropy grows plays its sampled
    games far below its greedy ones, which the curves alone do not show (docs/results.md,
    "A smaller entropy bonus")."""
    rows, sampled, entropy = [], [], []
    for record in records:
        if record.get("charts/episodic_return") is not None:
            sampled.append(record["charts/episodic_return"])
        if record.get("losses/entropy") is not None:
            entropy.append(record["losses/entropy"])
        if record.get("eval/greedy_return") is None:
            continue
        greedy = _score({"mean": record["eval/greedy_return"],
                         "sem": record.get("eval/greedy_return_sem"),
                         "episodes": record["eval/episodes"]}
                        if "eval/episodes" in record else record["eval/greedy_return"])
        if sampled:
            sem = float(np.std(sampled, ddof=1) / np.sqrt(len(sampled))) \
                if len(sampled) > 1 else None
            played = score_text(float(np.mean(sampled)), sem, len(sampled))
        else:
            played = "no game ended"
        ent = f"{np.mean(entropy):.2f}" if entropy else "-"
        update = record.get("charts/update", "")
        rows.append(f"| {record['step']:,} | {update} | {greedy} | {played} | {ent} |")
        sampled, entropy = [], []
    if not rows:
        return []
    return ["| step | update | greedy (selection games) | sampled training games since the "
            "evaluation before | mean policy entropy (nats) |",
            "| --- | --- | --- | --- | --- |", *rows]


def write_report(run_dir: Path, pipeline: Pipeline, results: dict[str, StageResult]) -> Path:
    """report.md with the summary table and PNG plots, beside the checkpoints."""
    from .metrics import read_metrics
    from .plots import plot_learning_curve

    images, progress = [], []
    ppo_metrics = run_dir / "ppo_metrics.jsonl"
    if ppo_metrics.exists():
        records = read_metrics(ppo_metrics)
        progress = ppo_progress(records)
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
    if progress:
        body += ["## PPO by evaluation", "", *progress, ""]
    for title, name in images:
        body += [f"## {title}", "", f"![{title}]({name})", ""]
    path = run_dir / "report.md"
    atomic_write_text(path, "\n".join(body))
    return path
