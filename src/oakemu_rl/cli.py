"""The `oakemu` command. It parses options and calls the stages; nothing more."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from . import __version__
from .errors import OakEmuError
from .options import FiniteFloatRange as _FiniteFloatRange
from .options import config_from, config_options, place_options, seed_option


class _Group(click.Group):
    """A click group that turns a user error into one line and a non-zero exit."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except OakEmuError as error:
            root = ctx.find_root()
            if root.params.get("debug"):
                raise
            raise click.ClickException(str(error)) from None


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="oakemu")
@click.option("--debug", is_flag=True, help="Show full tracebacks for errors.")
def cli(debug: bool) -> None:
    """OakEmu-RL: recorded play of an emulated game in, a PPO agent out.

    \b
    record ──► demos.h5 ──► bootstrap bc ──► bootstrap calibrate ──► finetune ppo
                                          test (greedy) · export onnx · info
    """


# -- info -------------------------------------------------------------------------------


@cli.command()
@click.argument("checkpoint", type=click.Path(dir_okay=True, path_type=str))
@click.option("--json", "as_json", is_flag=True, help="Print the metadata as JSON.")
def info(checkpoint: str, as_json: bool) -> None:
    """Print a checkpoint's metadata: stage, steps, env, model size."""
    from .checkpoint import describe, load_checkpoint

    meta = describe(load_checkpoint(checkpoint))
    if as_json:
        click.echo(json.dumps(meta, indent=2, sort_keys=True))
        return
    steps = ", ".join(f"{k}={v:,}" for k, v in meta["steps"].items()) or "none"
    conv = " ".join("{}x{}/{}".format(*layer) for layer in meta["model_config"]["conv_layers"])
    fc = "-".join(str(w) for w in meta["model_config"]["fc_hidden"])
    rows = [
        ("checkpoint", checkpoint),
        ("stage", meta["stage"]),
        ("steps", steps),
        ("env", meta["env"]),
        ("observation", "x".join(str(v) for v in meta["observation_shape"]) + " uint8"),
        ("actions", f"{meta['actions']} ({len(meta['allowed_actions'])} allowed: "
                    f"{', '.join(meta['allowed_actions'])})"),
        ("model", f"conv {conv}, fc {fc}, {meta['model_config']['activation']}"),
        ("parameters", f"{meta['parameters']:,} ({meta['parameter_megabytes']} MiB)"),
        ("created", f"{meta['created_at']} by oakemu-rl {meta['package_version']} "
                    f"(schema {meta['schema_version']})"),
    ]
    for number, link in enumerate(meta["lineage"], 1):
        steps = ", ".join(f"{k}={v:,}" for k, v in link["steps"].items()) or "no steps"
        inputs = ", ".join(f"{item['path']} (sha256 {item['sha256'][:12]})"
                           for item in link["inputs"]) or "no input files recorded"
        rows.append(("lineage" if number == 1 else "",
                     f"{number}. {link['stage']}: {steps}; from {inputs}"))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        click.echo(f"{key:<{width}}  {value}")


# -- envs -------------------------------------------------------------------------------


@cli.command()
@click.option("--rom", "rom_path", type=click.Path(path_type=str), default=None,
              help="Check this Game Boy ROM and keep a copy in the ROM store first.")
def envs(rom_path: str | None) -> None:
    """List the games: the Atari ROMs that ship with ale-py, and the Game Boy games with a
    shipped config (with whether their ROM is here)."""
    from .envs import available_games
    from .envs.roms import add_rom, store_dir

    if rom_path is not None:
        digest, title = add_rom(rom_path)
        click.echo(f"ROM {title!r} (sha256 {digest[:12]}…) is in {store_dir()}")
    games = available_games()
    width = max(len(game) for game, _ in games)
    for game, where in games:
        click.echo(f"{game:<{width}}  {where}")


# -- groups later stages fill ------------------------------------------------------------


def _spec_options(func):
    """Options that build an EnvSpec; shared by every command that starts an emulator."""
    options = [
        click.option("--game", default="pong", show_default=True,
                     help="Game: an Atari ROM id or full id, or a Game Boy game "
                          "(`oakemu envs` lists them)."),
        click.option("--game-config", "game_config", type=click.Path(path_type=str),
                     default="", help="Game Boy: your game config TOML (buttons, RAM rewards, "
                                      "episode ends, start) instead of the shipped one."),
        click.option("--rom", "rom_path", type=click.Path(path_type=str), default=None,
                     help="Game Boy: your ROM file (checked, and kept in the ROM store so "
                          "later commands find it)."),
        click.option("--sticky", "repeat_action_probability", type=_FiniteFloatRange(0, 0.99),
                     default=0.25, show_default=True, help="Sticky-action probability."),
        click.option("--noop-max", type=click.IntRange(0, 1000), default=30, show_default=True,
                     help="Most NOOP steps at an episode start."),
        click.option("--full-action-space", is_flag=True, help="Use all 18 joystick actions."),
        click.option("--fire-reset", is_flag=True,
                     help="Atari games that wait for FIRE to serve (Breakout): press FIRE "
                          "as the first action of each game and after each lost life."),
        click.option("--forbid", "forbidden_actions", multiple=True, metavar="ACTION",
                     help="An action meaning the agent may never take (repeatable), e.g. FIRE."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _say(text: str) -> None:
    """Print a stage's closing line once: on rank 0 when torchrun started several ranks."""
    from .distributed import world_from_env

    if world_from_env().is_main:
        click.echo(text)


def _spec(game: str, repeat_action_probability: float, noop_max: int,
          full_action_space: bool, forbidden_actions: tuple[str, ...], fire_reset: bool = False,
          game_config: str = "", rom_path: str | None = None):
    from .envs import EnvSpec, action_mask
    from .envs.roms import add_rom

    rom_sha256 = add_rom(rom_path)[0] if rom_path else ""
    spec = EnvSpec(game=game, repeat_action_probability=repeat_action_probability,
                   noop_max=noop_max, full_action_space=full_action_space,
                   forbidden_actions=tuple(forbidden_actions), fire_reset=fire_reset,
                   game_config=game_config, rom_sha256=rom_sha256)
    action_mask(spec)  # a bad --forbid is an error before anything starts
    return spec


def _given_spec_options(ctx: click.Context) -> list[str]:
    """The env options the user typed (not left at their defaults)."""
    names = ("game", "repeat_action_probability", "noop_max", "full_action_space",
             "forbidden_actions", "fire_reset", "game_config", "rom_path")
    return [name for name in names
            if ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE]


@cli.command()
@_spec_options
@click.option("--out", type=click.Path(dir_okay=False, path_type=str),
              default="data/demos/{game}.h5", show_default=True,
              help="Demo file to create or append to.")
@click.option("--episodes", type=click.IntRange(1), default=5, show_default=True)
@click.option("--demonstrator", type=click.Choice(["keyboard", "scripted"]), default="keyboard",
              show_default=True, help="Who plays: you at the keyboard, or a built-in script.")
@click.option("--policy", "policy_path", type=click.Path(path_type=str), default=None,
              help="Record a trained agent from this checkpoint instead (its env spec is used).")
@click.option("--noise", type=_FiniteFloatRange(0, 1), default=0.0, show_default=True,
              help="Scripted demonstrator: chance per step of a random allowed action (with "
                   "--relabel: of the checkpoint's play, never of the labels).")
@click.option("--style", default="planner", show_default=True,
              help="Scripted demonstrator: planner (plays best) or, on Pong, follow (holds "
                   "keys towards the ball, which behaviour cloning copies well).")
@click.option("--relabel", "relabel_path", type=click.Path(path_type=str), default=None,
              help="Scripted demonstrator: this checkpoint's greedy policy plays and the "
                   "script labels each frame with what it would do (a DAgger round: BC on "
                   "these and the first demos fixes the clone's drift). Uses its env spec.")
@click.option("--fps", type=_FiniteFloatRange(1, 1000), default=None,
              help="Keyboard: agent steps per second (default: the game's real speed, 60 "
                   "frames a second; 15 steps at Atari's frame skip 4).")
@click.option("--max-steps", type=click.IntRange(1), default=None,
              help="Cut each episode after this many agent steps.")
@click.option("--workers", type=click.IntRange(1), default=1, show_default=True,
              help="Processes that play the games side by side, one thread each (scripted "
                   "players, and policies on the CPU); the file is the same as with one.")
@seed_option()
@click.option("--device", default="auto", show_default=True, help="--policy: auto, cpu or cuda.")
def record(out: str, episodes: int, demonstrator: str, policy_path: str | None, noise: float,
           style: str, relabel_path: str | None, fps: float | None, max_steps: int | None,
           workers: int, seed: int, device: str, **spec_options) -> None:
    """Record demonstrations into an HDF5 file (one committed episode at a time)."""
    from pathlib import Path

    from .agents.recording import RecordConfig, recording_agents
    from .agents.recording import record as run_record

    spec = _spec(**spec_options) if policy_path is None and relabel_path is None else None
    agent, driver, spec = recording_agents(
        spec, demonstrator=demonstrator, policy=policy_path, relabel=relabel_path, style=style,
        noise=noise, fps=fps, seed=seed, device=device)
    keyboard = demonstrator == "keyboard" and policy_path is None and relabel_path is None
    if keyboard:
        from .agents.keyboard import key_map_text

        click.echo(key_map_text(spec))
    path = Path(out.format(game=spec.game))
    config = RecordConfig(out=path, spec=spec, episodes=episodes, seed=seed,
                          max_steps=max_steps, progress=not keyboard, workers=workers)
    try:
        result = run_record(config, agent, driver)
    except KeyboardInterrupt:
        raise OakEmuError(f"stopped; every finished episode is kept in {path}") from None
    finally:
        close = getattr(agent, "close", None)
        if close is not None:
            close()
    returns = [e["return"] for e in result.episodes]
    mean = f", mean return {sum(returns) / len(returns):+.1f}" if returns else ""
    note = " (stopped early)" if result.stopped else ""
    click.echo(f"wrote {len(result.episodes)} episode(s) to {path}{mean}{note}")


@cli.group(cls=_Group)
def demos() -> None:
    """Inspect, validate and merge demonstration files."""


@demos.command("info")
@click.argument("file", type=click.Path(path_type=str))
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def demos_info(file: str, as_json: bool) -> None:
    """Episodes, steps, returns, action histogram and env spec of a demo file."""
    from .demos import DemoFile

    with DemoFile(file) as demo:
        summary = demo.summary()
    if as_json:
        click.echo(json.dumps(summary, indent=2))
        return
    r = summary["returns"]
    spec = summary["env_spec"]
    click.echo(f"file        {summary['path']} (schema {summary['schema_version']}, "
               f"{summary['bytes']:,} bytes, {summary['bytes_per_frame']} bytes/frame)")
    click.echo(f"env         {spec['env_id']}  frame skip {spec['frame_skip']}, "
               f"{spec['screen_size']}x{spec['screen_size']}, stack {spec['frame_stack']}, "
               f"sticky {spec['repeat_action_probability']}, noop max {spec['noop_max']}")
    click.echo(f"episodes    {summary['episodes']} ({', '.join(summary['recorders']) or '-'})")
    click.echo(f"steps       {summary['steps']:,}")
    if summary["episodes"]:
        click.echo(f"returns     mean {r['mean']:+.2f}  std {r['std']:.2f}  "
                   f"min {r['min']:+.0f}  max {r['max']:+.0f}")
    total = max(summary["steps"], 1)
    click.echo("actions")
    for meaning, count in summary["action_histogram"].items():
        allowed = "" if summary["action_mask"][meaning] else "  (forbidden)"
        click.echo(f"  {meaning:<14}{count:>9,}  {100 * count / total:5.1f}%{allowed}")


@demos.command("validate")
@click.argument("file", type=click.Path(path_type=str))
def demos_validate(file: str) -> None:
    """Check a demo file completely, reading every stored frame."""
    from .demos import validate_demo_file

    with validate_demo_file(file) as demo:
        click.echo(f"{file}: valid, {len(demo.episodes)} episodes, {demo.num_steps:,} steps")


@demos.command("merge")
@click.argument("out", type=click.Path(dir_okay=False, path_type=str))
@click.argument("inputs", nargs=-1, required=True, type=click.Path(path_type=str))
def demos_merge(out: str, inputs: tuple[str, ...]) -> None:
    """Merge demo files recorded with the same env spec into OUT (created or appended)."""
    from .demos import merge_demo_files

    copied = merge_demo_files(out, list(inputs))
    click.echo(f"merged {copied} episode(s) from {len(inputs)} file(s) into {out}")


@demos.command("export-minari")
@click.argument("file", type=click.Path(path_type=str))
@click.option("--dataset-id", required=True,
              help="NAMESPACE/NAME-v0; written under MINARI_DATASETS_PATH (~/.minari/datasets).")
def demos_export_minari(file: str, dataset_id: str) -> None:
    """Write the demo file FILE as a local Minari dataset."""
    from .demos.minari_io import export_minari

    path = export_minari(file, dataset_id)
    click.echo(f"wrote Minari dataset {dataset_id} to {path}")


@demos.command("import-minari")
@click.argument("dataset_id")
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=str))
@click.option("--frame-skip", type=click.IntRange(1, 64), default=None,
              help="Raw frame-skip-1 datasets: emulator frames per step (default 4).")
@click.option("--full-action-space/--minimal-action-space", default=None,
              help="Our action set (default: minimal when it has every action used).")
@click.option("--allow-jpeg", is_flag=True, help="Import JPEG-encoded (lossy) frames anyway.")
def demos_import_minari(dataset_id: str, out: str, frame_skip: int | None,
                        full_action_space: bool | None, allow_jpeg: bool) -> None:
    """Convert the local Minari dataset DATASET_ID of an ALE game into a demo file."""
    from .demos.minari_io import import_minari

    click.echo(import_minari(dataset_id, out, frame_skip=frame_skip, allow_jpeg=allow_jpeg,
                             full_action_space=full_action_space).summary())


@cli.group(cls=_Group)
def bootstrap() -> None:
    """Stage one and two: behaviour cloning, then critic calibration."""


def _bc_config():
    from .bootstrap.bc import BCConfig

    return BCConfig


def _calibrate_config():
    from .bootstrap.calibrate import CalibrateConfig

    return CalibrateConfig


def _ppo_config():
    from .finetune.ppo import PPOConfig

    return PPOConfig


@bootstrap.command("bc")
@click.argument("demo_files", nargs=-1, required=True, type=click.Path(path_type=str))
@config_options(_bc_config())
@place_options(run_dir="Where bc.pt and metrics go (default data/runs/GAME).",
               checkpoint="Start from this checkpoint's weights instead of a fresh model "
                          "(same env spec).")
def bc(demo_files: tuple[str, ...], **options) -> None:
    """Behaviour cloning: train the trunk and policy head on DEMO_FILES' actions.

    A DEMO_FILE may also be a local Minari dataset, `minari:NAMESPACE/NAME-v0`: it is
    imported into the run directory first (docs/minari.md).

    Writes bc.pt (the best epoch by validation loss), bc_metrics.jsonl and bc_curves.png
    into the run directory (default data/runs/GAME). With --relabel-episodes N, the clone
    then plays N games that the scripted demonstrator labels, and a fresh BC trains on the
    demos and those frames (--relabel-rounds times).
    """
    from .bootstrap.bc import BCConfig, train_bc

    config = config_from(BCConfig, options)
    path = train_bc(config, demo_files, run_dir=options["run_dir"],
                    init_from=options["checkpoint"], device=options["device"],
                    progress=options["progress"])
    _say(f"wrote {path}; next: oakemu bootstrap calibrate --run-dir {path.parent}")


@bootstrap.command("calibrate")
@config_options(_calibrate_config())
@click.option("--demos", multiple=True, type=click.Path(path_type=str),
              help="Demo files whose own discounted returns are added as calibration data.")
@place_options(run_dir="Run directory holding bc.pt; calibrated.pt is written there "
                       "(default: the last run).",
               checkpoint="Calibrate this checkpoint instead of the run's bc.pt.")
def calibrate(**options) -> None:
    """Fit the value head alone on the BC policy's returns in the emulator.

    Reads bc.pt from the run directory (default: the last run) and writes calibrated.pt,
    with the trunk and policy head bit-identical to bc.pt. Runs in one process.
    """
    from .bootstrap.calibrate import CalibrateConfig
    from .bootstrap.calibrate import calibrate as run_calibrate

    config = config_from(CalibrateConfig, options)
    path = run_calibrate(config, run_dir=options["run_dir"], checkpoint=options["checkpoint"],
                         demos=tuple(options["demos"]), device=options["device"],
                         progress=options["progress"])
    click.echo(f"wrote {path}")


@cli.group(cls=_Group)
def finetune() -> None:
    """Stage three: reinforcement learning from the warm start."""


@finetune.command("ppo")
@config_options(_ppo_config())
@click.option("--bc-demos", multiple=True, type=click.Path(path_type=str),
              help="Demo files for the BC loss (default: the demos the starting policy was "
                   "cloned from, found in its lineage).")
@click.option("--stop-after-steps", type=click.IntRange(min=1), default=None,
              help="Pause at the first update that reaches this many agent steps: write "
                   "ppo_last.pt and no ppo.pt. The schedules stay those of --total-steps; "
                   "the same options with --resume go on.")
@place_options(run_dir="Run directory holding calibrated.pt; ppo.pt is written there "
                       "(default: the last run).",
               checkpoint="Start from this checkpoint (any stage) instead of the run's "
                          "calibrated.pt.", resume=True)
def ppo(**options) -> None:
    """Full PPO from the run's calibrated.pt (or --checkpoint), with warm-start guards.

    Writes ppo_last.pt every --checkpoint-every updates (what --resume continues from),
    ppo.pt at the end (the evaluated policy that scored best on the --eval-seed games),
    and ppo_metrics.jsonl plus TensorBoard events in the run directory.
    """
    from .checkpoint import load_checkpoint
    from .finetune.ppo import LAST, PPOConfig, finetune_ppo, selection_summary

    config = config_from(PPOConfig, options)
    try:
        path = finetune_ppo(config, run_dir=options["run_dir"], checkpoint=options["checkpoint"],
                            resume=options["resume"], bc_demos=tuple(options["bc_demos"]),
                            device=options["device"], progress=options["progress"],
                            stop_after_steps=options["stop_after_steps"])
    except KeyboardInterrupt:
        raise OakEmuError("stopped; continue from the last checkpoint with the same options "
                          "and --resume") from None
    if path.name == LAST:
        steps = load_checkpoint(path).steps
        _say(f"paused at update {steps['ppo/updates']} ({steps['ppo/global_step']:,} agent "
             f"steps): wrote {path}; the same options with --resume go on")
        return
    selection = load_checkpoint(path).extra.get("selection", {})
    _say(f"wrote {path}: {selection_summary(selection)}")


@cli.command()
@click.argument("checkpoint", required=False, type=click.Path(path_type=str))
@click.option("--demonstrator", type=click.Choice(["scripted"]), default=None,
              help="Also (or, without CHECKPOINT, only) score the scripted demonstrator.")
@click.option("--style", default="planner", show_default=True,
              help="--demonstrator scripted: which style plays (as for `oakemu record`).")
@_spec_options
@click.option("--episodes", type=click.IntRange(1), default=10, show_default=True,
              help="Games per agent (each mean is quoted ± its standard error).")
@click.option("--max-steps", type=click.IntRange(1), default=None,
              help="Cut each episode after this many agent steps.")
@seed_option()
@click.option("--video", type=click.Path(dir_okay=False, path_type=str), default=None,
              help="Save the first episode as .mp4 or .gif.")
@click.option("--onnx", "onnx_path", type=click.Path(path_type=str), default=None,
              help="Also (or instead) play an exported .onnx policy through onnxruntime.")
@click.option("--sample", is_flag=True,
              help="Draw each action from the policy instead of taking its argmax, as PPO's "
                   "training games do (seeded by each game's seed, so reruns repeat).")
@click.option("--workers", type=click.IntRange(1), default=1, show_default=True,
              help="Processes that play the games, one thread each (the scores are the "
                   "same); up to one per core is faster. With --video, and for a player "
                   "that cannot move to another process (a model on a GPU, a Game Boy "
                   "script), they play here.")
@click.option("--device", default="auto", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the scores as JSON.")
@click.pass_context
def test(ctx: click.Context, checkpoint: str | None, demonstrator: str | None, style: str,
         onnx_path: str | None, episodes: int, max_steps: int | None, seed: int,
         video: str | None, sample: bool, workers: int, device: str, as_json: bool,
         **spec_options) -> None:
    """Score a checkpoint by greedy play (argmax of the masked logits), or with --sample by
    the policy's own draws.

    A checkpoint (or --onnx export) plays its own env spec: the env options (--game,
    --sticky, --noop-max, --full-action-space, --forbid) only choose the game of
    --demonstrator scripted played alone, and are refused beside a checkpoint. With
    --demonstrator scripted beside a checkpoint, the script plays the checkpoint's game,
    so both land in one table.
    """
    from .agents.play import EvalConfig
    from .tester import format_table, score_agents

    given = [name for name in _given_spec_options(ctx) if name != "rom_path"]
    if spec_options["rom_path"] and (checkpoint is not None or onnx_path is not None):
        from .envs.roms import add_rom

        add_rom(spec_options["rom_path"])  # the checkpoint's game finds it by its sha256
    if given and (checkpoint is not None or onnx_path is not None):
        option = next(p for p in ctx.command.params if p.name == given[0])
        raise OakEmuError(
            f"{option.opts[0]} does not apply to a checkpoint, which plays the "
            "env spec it was trained on; drop the env options (they are for --demonstrator "
            "scripted alone)")
    config = EvalConfig(episodes=episodes, seed=seed, max_steps=max_steps, workers=workers)
    spec, results = score_agents(
        config, checkpoint=checkpoint, onnx=onnx_path,
        scripted_style=style if demonstrator == "scripted" else None,
        spec=_spec(**spec_options) if checkpoint is None and onnx_path is None else None,
        video=video, device=device, progress=not as_json, sample=sample)
    if as_json:
        click.echo(json.dumps({k: v.to_dict() for k, v in results.items()}, indent=2))
    else:
        click.echo(f"{spec.env_id}, {'sampled' if sample else 'greedy'}, {episodes} "
                   f"episode(s), seed {seed}")
        click.echo(format_table(results))
    if video:
        click.echo(f"video of the first episode: {video}")


@cli.group(cls=_Group)
def export() -> None:
    """Ship a policy."""


@export.command("onnx")
@click.argument("checkpoint", type=click.Path(path_type=str))
@click.option("--out", type=click.Path(dir_okay=False, path_type=str), required=True,
              help="The .onnx file to write.")
@click.option("--opset", type=int, default=None, help="ONNX opset (default 17).")
@click.option("--verify-frames", type=click.IntRange(1), default=64, show_default=True,
              help="Real emulator frames on which onnxruntime is checked against torch.")
@click.option("--tolerance", type=_FiniteFloatRange(0), default=1e-4, show_default=True,
              help="Largest allowed |logit difference| between onnxruntime and torch.")
def onnx(checkpoint: str, out: str, opset: int | None, verify_frames: int,
         tolerance: float) -> None:
    """Export the policy's logits (uint8 frames in, dynamic batch) to one ONNX file.

    The file carries the action meanings, mask and env spec in its metadata, and is only
    written once onnxruntime agrees with torch on real emulator frames.
    """
    from .export import export_onnx

    report = export_onnx(checkpoint, out, opset=opset, verify_frames=verify_frames,
                         tolerance=tolerance)
    click.echo(report.summary())
    click.echo(f"wrote {report.path} ({report.bytes / 2**20:.1f} MiB, opset {report.opset})")


@cli.group(cls=_Group)
def pipeline() -> None:
    """Run a pipelines/*.toml end to end."""


@pipeline.command("run")
@click.argument("file", type=click.Path(dir_okay=False, path_type=str),
                default="pipelines/pong.toml")
@click.option("--run-dir", default=None, help="Run directory (default data/runs/NAME).")
@click.option("--force", multiple=True, metavar="STAGE",
              help="Redo this stage and the ones after it: record, bc, calibrate, ppo, test.")
@click.option("--progress/--no-progress", default=True, show_default=True)
@click.option("--nproc-per-node", type=click.IntRange(1, 256), default=None,
              help="Run bc and ppo on this many processes through torchrun (default: the "
                   "file's [distributed] nproc_per_node, or 1).")
def run(file: str, run_dir: str | None, force: tuple[str, ...], progress: bool,
        nproc_per_node: int | None) -> None:
    """Run record → bc → calibrate → ppo → test from a pipeline FILE in one run directory.

    Stages whose output exists and was made from the same settings are skipped, so a
    re-run after a crash or Ctrl-C continues where it stopped.
    """
    import dataclasses
    import time
    from pathlib import Path

    from .pipeline import PipelineRun, load_pipeline, summary_table, write_report
    from .runs import runs_root

    pipeline_def = load_pipeline(file)
    if nproc_per_node is not None:
        from .pipeline import DistributedSettings

        pipeline_def = dataclasses.replace(
            pipeline_def, distributed=DistributedSettings(nproc_per_node=nproc_per_node))
    target = Path(run_dir) if run_dir else runs_root() / pipeline_def.name
    started = time.perf_counter()
    runner = PipelineRun(pipeline_def, target, force=force, progress=progress)
    results = runner.run()
    report = write_report(runner.run_dir, pipeline_def, results)
    click.echo(summary_table(results))
    minutes = (time.perf_counter() - started) / 60
    click.echo(f"\nreport: {report}  ({minutes:.1f} min this run)")


def main() -> None:
    cli(prog_name="oakemu")


if __name__ == "__main__":
    sys.exit(main())
