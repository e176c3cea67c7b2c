"""Minari datasets in and out of our demo format.

`export_minari` writes a demo file as a local Minari dataset: one observation per step (the
preprocessed frame, never stacked) plus a final observation, the actions, rewards,
terminations and truncations of every episode, our env spec, action meanings and recorder
kinds in the dataset metadata (under `oakemu_rl`), and a gymnasium env spec (the ALE game at
frame skip 1 under gymnasium's `AtariPreprocessing`) from which
`MinariDataset.recover_environment()` builds the same game with the same preprocessing.
Frames are stored losslessly (no JPEG). Our files do not hold the observation after an
episode's last action, so the final observation repeats the last frame.

`import_minari` converts a local Minari dataset of an ALE game into a demo file. It reads
the game, the emulator settings and the preprocessing from the dataset's env spec, and
takes the frames in one of two ways:

* preprocessed frames (the env had `AtariPreprocessing` with grayscale, unscaled output,
  whole games, optionally `FrameStackObservation` after it): each step's newest frame is
  taken as it is, and the spec's frame skip, screen size and NOOP maximum are the wrapper's;
* raw frames of a frame-skip-1 emulator (RGB or the emulator's grayscale): every emulator
  frame is there, so they are preprocessed exactly as our recorder does: the emulator's
  grayscale (its palette luminance, rebuilt from RGB), the max of the last two frames of
  each step and an area resize. A step is `frame_skip` emulator frames with one action;
  an episode whose action changes inside a step is refused (import it with frame skip 1).
  An episode cut short inside a step keeps that step, marked as the end of the episode.

Raw frames of an emulator that skipped frames itself hold only the last frame of each
step, so the max-pool cannot be rebuilt: they are refused. So are continuous or other
non-discrete actions, observations that are not image frames, an env that is not an ALE
game, JPEG-encoded frames (lossy; `allow_jpeg` imports them anyway) and frames of a shape
no preprocessing above makes. Actions are mapped by meaning (UPFIRE stays UPFIRE) from the
dataset's action set to ours: the game's minimal set when every action used has a meaning
there, else the full set.

Each refusal is one sentence (`DemoFileError`); nothing is written unless the whole
conversion succeeds: the demo file and the dataset are built under temporary names and
renamed into place.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from .. import __version__
from ..envs import EnvSpec, action_meanings
from ..envs.ale import fire_action
from ..errors import ConfigError, DemoFileError, EnvError, OakEmuError
from .reader import DemoFile
from .schema import RECORDERS
from .writer import DemoWriter, EpisodeBuffer

MINARI_PREFIX = "minari:"
"""`bootstrap bc minari:NAMESPACE/NAME-v0` names a Minari dataset instead of a file."""

METADATA_KEY = "oakemu_rl"
"""Key of our own block in a dataset's metadata: env spec, meanings, recorder kinds."""

SOURCE_ATTR = "minari_source"
"""File attribute of an imported demo file: the dataset id and a fingerprint of its files."""

DEFAULT_RECORDER = "policy"
"""Recorder kind given to imported episodes whose dataset does not name one."""

_ALE_ENTRY_POINTS = ("ale_py.env:AtariEnv", "ale_py.env.gym:AtariEnv", "ale_py:AtariEnv")
_PREPROCESSING = "gymnasium.wrappers.atari_preprocessing:AtariPreprocessing"
_FRAME_STACK = "gymnasium.wrappers.stateful_observation:FrameStackObservation"
_FIRE_RESET = "oakemu_rl.envs.ale:FireReset"
_HARMLESS_WRAPPERS = ("RecordEpisodeStatistics",)
_BATCH_FRAMES = 20_000


# -- minari access ----------------------------------------------------------------------


def _minari() -> Any:
    try:
        import minari
    except ImportError:
        raise OakEmuError("the minari package is not installed; pip install minari") from None
    return minari


def _datasets_root() -> Path:
    from minari.storage.datasets_root_dir import get_dataset_path

    return Path(get_dataset_path())


def _check_id(dataset_id: str) -> str:
    from minari.dataset.minari_dataset import parse_dataset_id

    try:
        parse_dataset_id(dataset_id)
    except (ValueError, TypeError):
        raise ConfigError(
            f"{dataset_id!r} is not a Minari dataset id; ids look like NAMESPACE/NAME-v0"
        ) from None
    return dataset_id


def _dataset_dir(dataset_id: str) -> Path:
    return _datasets_root() / dataset_id


def _load(dataset_id: str) -> Any:
    minari = _minari()
    _check_id(dataset_id)
    data = _dataset_dir(dataset_id) / "data"
    if not data.is_dir():
        raise DemoFileError(
            f"there is no local Minari dataset {dataset_id} under {_datasets_root()} "
            "(MINARI_DATASETS_PATH); create or download it first"
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return minari.load_dataset(dataset_id)
    except Exception as error:  # minari reports a bad dataset as anything
        raise DemoFileError(f"Minari dataset {dataset_id} cannot be read: {_short(error)}") \
            from None


def _short(error: BaseException) -> str:
    text = str(error).strip()
    return (text.splitlines()[0] if text else type(error).__name__)[:200]


def _ale_version() -> str:
    try:
        from importlib.metadata import version

        return version("ale-py")
    except Exception:
        return "unknown"


# -- export -----------------------------------------------------------------------------


def gym_env_spec(spec: EnvSpec) -> Any:
    """A gymnasium env spec that `gym.make` turns into `spec`'s game with its preprocessing:
    the ALE env at frame skip 1 under `AtariPreprocessing` (one 84x84 frame per step), and
    our FIRE serving when the spec has `fire_reset` (so gym.make needs this package then).
    The frame stack, action mask and training-only switches live in our metadata."""
    from gymnasium.envs.registration import EnvSpec as GymEnvSpec
    from gymnasium.envs.registration import WrapperSpec

    kwargs = {
        "game": spec.game,
        "obs_type": "rgb",
        "frameskip": 1,
        "repeat_action_probability": spec.repeat_action_probability,
        "full_action_space": spec.full_action_space,
        "max_num_frames_per_episode": spec.max_episode_frames,
    }
    preprocessing = WrapperSpec(
        name="AtariPreprocessing",
        entry_point=_PREPROCESSING,
        kwargs={
            "noop_max": spec.noop_max,
            "frame_skip": spec.frame_skip,
            "screen_size": spec.screen_size,
            "terminal_on_life_loss": False,
            "grayscale_obs": True,
            "grayscale_newaxis": False,
            "scale_obs": False,
        },
    )
    wrappers = (preprocessing,)
    if spec.fire_reset:  # the serving changes what a player's actions do, so the env carries it
        wrappers += (WrapperSpec(name="FireReset", entry_point=_FIRE_RESET,
                                 kwargs={"fire": fire_action(spec)}),)
    return GymEnvSpec(id=spec.env_id, entry_point=_ALE_ENTRY_POINTS[0], kwargs=kwargs,
                      additional_wrappers=wrappers)


def _export_target(dataset_id: str) -> Path:
    """Return the directory of the new dataset `dataset_id`, refusing one that exists."""
    _check_id(dataset_id)
    target = _dataset_dir(dataset_id)
    if target.exists():
        raise DemoFileError(
            f"a Minari dataset {dataset_id} already exists at {target}; pick another "
            "--dataset-id or delete it first"
        )
    return target


def _staging_dir() -> Path:
    """Return a new temporary directory under the datasets root to build a dataset in."""
    root = _datasets_root()
    try:
        return Path(tempfile.mkdtemp(prefix=".oakemu-export-", dir=root))
    except OSError as error:
        raise DemoFileError(f"cannot write under {root}: {error.strerror}") from None


def _export_metadata(demo: DemoFile, dataset_id: str, description: str | None) -> dict[str, Any]:
    """Return the dataset metadata of the export of `demo`, our own block included."""
    spec = demo.spec
    recorders = [e.recorder for e in demo.episodes]
    return {
        "dataset_id": dataset_id,
        "algorithm_name": f"oakemu-rl demos ({', '.join(sorted(set(recorders)))})",
        "description": description or (
            f"{spec.game} demonstrations converted from {demo.path.name}: one "
            f"{spec.screen_size}x{spec.screen_size} grayscale frame per step "
            f"(frame skip {spec.frame_skip}, max-pooled); the final observation of "
            "each episode repeats its last frame"),
        "minari_version": _minari().__version__,
        "requirements": [f"ale-py=={_ale_version()}"] if _ale_version() != "unknown"
        else [],
        METADATA_KEY: {
            "format": "oakemu-rl-demos",
            "package_version": __version__,
            "env_spec": spec.to_dict(),
            "action_meanings": list(demo.action_meanings),
            "action_mask": demo.action_mask.tolist(),
            "recorders": recorders,
            "seeds": [e.seed for e in demo.episodes],
            "ale_py_version": str(demo.attrs.get("ale_py_version", "unknown")),
            "final_observation": "repeats the last frame",
        },
    }


def _write_dataset(staging: Path, demo: DemoFile, dataset_id: str,
                   description: str | None) -> None:
    """Write the dataset of every episode of `demo` under `staging` (returns nothing)."""
    import gymnasium as gym
    from minari.data_collector.episode_buffer import EpisodeBuffer as MinariEpisode
    from minari.dataset.minari_storage import MinariStorage

    spec = demo.spec
    storage = MinariStorage.new(
        staging / "data",
        observation_space=gym.spaces.Box(0, 255, spec.frame_shape, np.uint8),
        action_space=gym.spaces.Discrete(len(demo.action_meanings)),
        # A Game Boy game has no gymnasium registration to name: its env spec travels in
        # the dataset's metadata only (docs/minari.md).
        env_spec=gym_env_spec(spec) if spec.backend == "ale" else None,
        data_format="hdf5",
        jpeg_encoding=False,
    )
    storage.update_metadata(_export_metadata(demo, dataset_id, description))
    for i, info in enumerate(demo.episodes):
        frames = demo.read(i, "frames")
        storage.update_episodes([MinariEpisode(
            seed=int(info.seed),
            observations=np.concatenate([frames, frames[-1:]]),
            actions=demo.read(i, "actions"),
            rewards=demo.read(i, "rewards"),
            terminations=demo.read(i, "terminations"),
            truncations=demo.read(i, "truncations"),
        )])
    storage.update_episode_metadata(
        [{"recorder": e.recorder, "return": e.episode_return} for e in demo.episodes]
    )


def _add_namespace(dataset_id: str) -> None:
    """Create the local namespace of `dataset_id` if it has none yet (returns nothing)."""
    from minari.dataset.minari_dataset import parse_dataset_id
    from minari.namespace import create_namespace, list_local_namespaces

    namespace = parse_dataset_id(dataset_id)[0]
    if namespace is not None and namespace not in list_local_namespaces():
        with contextlib.suppress(ValueError, OSError):
            create_namespace(namespace)


def export_minari(demo_path: str | os.PathLike[str], dataset_id: str, *,
                  description: str | None = None) -> Path:
    """Write every episode of `demo_path` as the local Minari dataset `dataset_id` (under
    MINARI_DATASETS_PATH, default ~/.minari/datasets); returns the dataset's directory."""
    _minari()
    target = _export_target(dataset_id)
    with DemoFile(demo_path) as demo:
        if not demo.episodes:
            raise DemoFileError(f"demo file {demo.path} holds no episodes to export")
        staging = _staging_dir()
        try:
            _write_dataset(staging, demo, dataset_id, description)
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.exists():
                raise DemoFileError(f"a Minari dataset {dataset_id} appeared at {target} "
                                    "while exporting; pick another --dataset-id")
            os.rename(staging, target)
        except BaseException as error:
            shutil.rmtree(staging, ignore_errors=True)
            if isinstance(error, OSError):
                raise DemoFileError(f"cannot write the Minari dataset {dataset_id}: "
                                    f"{error.strerror or error}") from None
            raise
    _add_namespace(dataset_id)
    return target


# -- import: deciding how to read a dataset ---------------------------------------------


@dataclass(frozen=True)
class _Plan:
    dataset_id: str
    spec: EnvSpec
    mode: str
    """"preprocessed", "raw_rgb" or "raw_gray"."""
    stacked: bool
    """Preprocessed observations are stacks; the newest frame is the last."""
    newaxis: bool
    """Preprocessed observations carry a trailing channel axis of 1."""
    action_start: int
    source_meanings: tuple[str, ...]
    recorders: list[str] | None
    seeds: list[int] | None


def _refuse(dataset_id: str, why: str) -> DemoFileError:
    return DemoFileError(f"cannot import Minari dataset {dataset_id}: {why}")


def _wrapper_entry(wrapper: Any) -> str:
    entry = getattr(wrapper, "entry_point", "")
    return entry if isinstance(entry, str) else getattr(entry, "__name__", str(entry))


def _ale_env(dataset: Any, dataset_id: str) -> tuple[Any, dict[str, Any], str]:
    """Return the env spec, its kwargs and its game, refusing an env that is no ALE game."""
    refuse = functools.partial(_refuse, dataset_id)
    env_spec = dataset.spec.env_spec
    if env_spec is None:
        raise refuse("it records no env spec, so its game is unknown")
    entry = env_spec.entry_point if isinstance(env_spec.entry_point, str) else ""
    kwargs = dict(env_spec.kwargs or {})
    if entry not in _ALE_ENTRY_POINTS:
        raise refuse(f"its env {env_spec.id} ({entry or 'no entry point'}) is not an ALE game")
    try:
        game = EnvSpec(game=str(kwargs.get("game") or env_spec.id)).game
    except EnvError:
        raise refuse(f"its env {env_spec.id} names a game this ale-py does not have") from None
    return env_spec, kwargs, game


def _checked_spaces(dataset: Any, dataset_id: str, kwargs: dict[str, Any],
                    allow_jpeg: bool) -> tuple[Any, tuple[int, ...], Any]:
    """Return the action space, the frame shape and the emulator's frame skip, checking them."""
    import gymnasium as gym

    refuse = functools.partial(_refuse, dataset_id)
    action_space = dataset.action_space
    if not isinstance(action_space, gym.spaces.Discrete):
        raise refuse(f"its actions are {action_space}, not discrete actions")
    observation_space = dataset.observation_space
    if (not isinstance(observation_space, gym.spaces.Box) or observation_space.dtype != np.uint8
            or len(observation_space.shape) not in (2, 3, 4)
            or kwargs.get("obs_type", "rgb") == "ram"):
        raise refuse(f"its observations are {observation_space}, not image frames")
    shape = tuple(observation_space.shape)
    raw_skip = kwargs.get("frameskip", 4)
    if isinstance(raw_skip, bool) or not isinstance(raw_skip, int):
        raise refuse(f"its emulator skipped a random number of frames ({raw_skip}), so its "
                     "steps fit no fixed frame skip")
    if bool(getattr(dataset.storage, "jpeg_encoding", False)) and not allow_jpeg:
        from minari.dataset.minari_storage import is_image_space

        if is_image_space(observation_space):
            raise refuse("its frames are JPEG-encoded (lossy), so they cannot be "
                         "preprocessed exactly; pass --allow-jpeg to import them anyway")
    return action_space, shape, raw_skip


def _frame_wrappers(env_spec: Any, dataset_id: str) -> tuple[Any, Any]:
    """Return the env's AtariPreprocessing and FrameStackObservation wrappers (or None)."""
    refuse = functools.partial(_refuse, dataset_id)
    wrappers = list(env_spec.additional_wrappers or ())
    names = [w.name for w in wrappers]
    known = (_PREPROCESSING, _FRAME_STACK, _FIRE_RESET)
    unknown = [w.name for w in wrappers if _wrapper_entry(w) not in known
               and w.name not in _HARMLESS_WRAPPERS]
    if unknown:
        raise refuse(f"its env has the wrapper {unknown[0]}, whose effect on frames this "
                     "import does not know")
    preprocessing = next((w for w in wrappers if _wrapper_entry(w) == _PREPROCESSING), None)
    stack = next((w for w in wrappers if _wrapper_entry(w) == _FRAME_STACK), None)
    if stack is not None and (preprocessing is None or
                              names.index(stack.name) < names.index(preprocessing.name)):
        raise refuse("its frames are stacked raw frames, which fit no preprocessing")
    return preprocessing, stack


def _fire_reset(env_spec: Any, values: dict[str, Any], dataset_id: str) -> bool:
    """Whether the env serves with FIRE (our FireReset wrapper), refusing one that presses
    another action."""
    wrapper = next((w for w in env_spec.additional_wrappers or ()
                    if _wrapper_entry(w) == _FIRE_RESET), None)
    if wrapper is None:
        return False
    meanings = action_meanings(values["game"], values["full_action_space"])
    fire = (wrapper.kwargs or {}).get("fire")
    if "FIRE" not in meanings or fire != meanings.index("FIRE"):
        raise _refuse(dataset_id, f"its env serves with action {fire!r}, which is not FIRE "
                      f"in {values['game']}'s action set")
    return True


def _base_values(kwargs: dict[str, Any], game: str) -> dict[str, Any]:
    """Return the EnvSpec fields read from the ALE env's kwargs."""
    values: dict[str, Any] = {
        "game": game,
        "repeat_action_probability": float(kwargs.get("repeat_action_probability", 0.25)),
        "full_action_space": bool(kwargs.get("full_action_space", False)),
    }
    max_frames = kwargs.get("max_num_frames_per_episode")
    if isinstance(max_frames, int) and not isinstance(max_frames, bool) and max_frames > 0:
        values["max_episode_frames"] = max_frames
    return values


def _preprocessed_values(preprocessing: Any, stack: Any, shape: tuple[int, ...],
                         dataset_id: str, frame_skip: int | None,
                         screen_size: int | None) -> tuple[dict[str, Any], bool, bool]:
    """Return the EnvSpec fields of preprocessed frames and whether they are stacked / newaxis."""
    refuse = functools.partial(_refuse, dataset_id)
    options = dict(preprocessing.kwargs or {})
    size = options.get("screen_size", 84)
    if isinstance(size, (list, tuple)):
        if len(size) != 2 or size[0] != size[1]:
            raise refuse(f"its frames are resized to {tuple(size)}, not a square our "
                         "preprocessing makes")
        size = size[0]
    if not options.get("grayscale_obs", True):
        raise refuse("its preprocessed frames are in colour; ours are grayscale")
    if options.get("scale_obs", False):
        raise refuse("its preprocessed frames are scaled to floats; ours are bytes")
    if options.get("terminal_on_life_loss", False):
        raise refuse("its episodes end at every lost life (terminal_on_life_loss); "
                     "demo files hold whole games")
    skip = int(options.get("frame_skip", 4))
    if frame_skip is not None and frame_skip != skip:
        raise refuse(f"its frames were preprocessed with frame skip {skip}; they cannot "
                     f"be made into frame skip {frame_skip}")
    if screen_size is not None and screen_size != size:
        raise refuse(f"its frames are {size}x{size}; they cannot be made "
                     f"{screen_size}x{screen_size}")
    newaxis = bool(options.get("grayscale_newaxis", False))
    stacked = stack is not None
    expected = (size, size) + ((1,) if newaxis else ())
    if stacked:
        expected = (int((stack.kwargs or {}).get("stack_size", 1)), *expected)
    if shape != expected:
        raise refuse(f"its frames of shape {shape} fit no preprocessing (its "
                     f"AtariPreprocessing makes {expected})")
    values = {"frame_skip": skip, "screen_size": int(size),
              "noop_max": int(options.get("noop_max", 30))}
    return values, stacked, newaxis


def _raw_values(kwargs: dict[str, Any], shape: tuple[int, ...], raw_skip: Any,
                dataset_id: str, frame_skip: int | None,
                screen_size: int | None) -> tuple[dict[str, Any], str]:
    """Return the EnvSpec fields of raw frames and the mode ("raw_rgb" or "raw_gray")."""
    refuse = functools.partial(_refuse, dataset_id)
    obs_type = kwargs.get("obs_type", "rgb")
    raw_rgb = obs_type == "rgb" and len(shape) == 3 and shape[2] == 3
    raw_gray = obs_type == "grayscale" and len(shape) == 2
    if not (raw_rgb or raw_gray):
        raise refuse(f"its frames of shape {shape} fit no preprocessing")
    if raw_skip != 1:
        raise refuse(f"its raw frames were recorded with frame skip {raw_skip}, which keeps "
                     "only the last frame of each step, so the max-pool of our "
                     "preprocessing cannot be rebuilt; record at frame skip 1")
    values = {"frame_skip": 4 if frame_skip is None else frame_skip,
              "screen_size": 84 if screen_size is None else screen_size}
    return values, "raw_rgb" if raw_rgb else "raw_gray"


def _derived_spec(values: dict[str, Any], action_space: Any,
                  dataset_id: str) -> tuple[EnvSpec, list[str]]:
    """Return the EnvSpec built from `values` and its action meanings, checking the action count."""
    refuse = functools.partial(_refuse, dataset_id)
    try:
        derived = EnvSpec(**values)
    except EnvError as error:
        raise refuse(str(error)) from None
    game = values["game"]
    source_meanings = action_meanings(game, derived.full_action_space)
    if int(action_space.n) != len(source_meanings):
        raise refuse(f"its {int(action_space.n)} actions do not match {game}'s "
                     f"{len(source_meanings)}-action set")
    return derived, source_meanings


def _adopted_spec(dataset: Any, derived: EnvSpec, mode: str) -> tuple[EnvSpec, Any, Any]:
    """Return our exported spec, recorders and seeds when they fit `derived`, else `derived`."""
    ours = _our_metadata(dataset)
    spec, recorders, seeds = derived, None, None
    if ours is not None:
        try:
            theirs = EnvSpec.from_dict(ours.get("env_spec"))
        except (EnvError, TypeError):
            theirs = None
        frames_same = theirs is not None and all(
            getattr(theirs, name) == getattr(derived, name)
            for name in ("game", "frame_skip", "screen_size", "noop_max",
                         "repeat_action_probability", "full_action_space",
                         "max_episode_frames", "fire_reset"))
        if frames_same and mode == "preprocessed":
            spec = theirs
            recorders = ours.get("recorders")
            seeds = ours.get("seeds")
    return spec, recorders, seeds


def _plan(dataset: Any, dataset_id: str, *, frame_skip: int | None, screen_size: int | None,
          full_action_space: bool | None, allow_jpeg: bool) -> _Plan:
    env_spec, kwargs, game = _ale_env(dataset, dataset_id)
    action_space, shape, raw_skip = _checked_spaces(dataset, dataset_id, kwargs, allow_jpeg)
    preprocessing, stack = _frame_wrappers(env_spec, dataset_id)
    values = _base_values(kwargs, game)
    values["fire_reset"] = _fire_reset(env_spec, values, dataset_id)
    stacked = newaxis = False
    if preprocessing is not None:
        more, stacked, newaxis = _preprocessed_values(preprocessing, stack, shape, dataset_id,
                                                      frame_skip, screen_size)
        mode = "preprocessed"
    else:
        more, mode = _raw_values(kwargs, shape, raw_skip, dataset_id, frame_skip, screen_size)
    values.update(more)
    derived, source_meanings = _derived_spec(values, action_space, dataset_id)
    start = int(action_space.start)
    spec, recorders, seeds = _adopted_spec(dataset, derived, mode)
    if full_action_space is not None and full_action_space != spec.full_action_space:
        spec = replace(spec, full_action_space=full_action_space, forbidden_actions=())
    return _Plan(dataset_id=dataset_id, spec=spec, mode=mode, stacked=stacked,
                 newaxis=newaxis, action_start=start, source_meanings=tuple(source_meanings),
                 recorders=recorders if isinstance(recorders, list) else None,
                 seeds=seeds if isinstance(seeds, list) else None)


def _our_metadata(dataset: Any) -> dict[str, Any] | None:
    try:
        block = dataset.storage.metadata.get(METADATA_KEY)
    except Exception:
        return None
    return block if isinstance(block, dict) else None


def _action_map(source: Sequence[str], target: Sequence[str]) -> np.ndarray:
    """Source action index -> target index of the same meaning (-1 where there is none)."""
    index = {meaning: i for i, meaning in enumerate(target)}
    return np.array([index.get(meaning, -1) for meaning in source], dtype=np.int64)


# -- import: frames ---------------------------------------------------------------------


def ale_grayscale(rgb: np.ndarray) -> np.ndarray:
    """The emulator's grayscale of RGB frames (..., H, W, 3): the luminance its palette
    stores for each colour, round(0.2989 R + 0.5870 G + 0.1140 B) in double precision."""
    rgb = np.asarray(rgb)
    lum = (rgb[..., 0].astype(np.float64) * 0.2989 + rgb[..., 1].astype(np.float64) * 0.5870
           + rgb[..., 2].astype(np.float64) * 0.1140)
    return np.floor(lum + 0.5).astype(np.uint8)


def _resize(frame: np.ndarray, size: int) -> np.ndarray:
    import cv2

    return np.asarray(cv2.resize(frame, (size, size), interpolation=cv2.INTER_AREA),
                      dtype=np.uint8)


def _episode_steps(plan: _Plan, episode: Any, number: int,
                   action_map: np.ndarray) -> EpisodeBuffer | None:
    """One Minari episode as our steps (None for an empty episode)."""
    actions = np.asarray(episode.actions).reshape(-1).astype(np.int64) - plan.action_start
    rewards = np.asarray(episode.rewards, dtype=np.float64).reshape(-1)
    terminations = np.asarray(episode.terminations, dtype=bool).reshape(-1)
    truncations = np.asarray(episode.truncations, dtype=bool).reshape(-1)
    observations = np.asarray(episode.observations)
    length = len(actions)
    if length == 0:
        return None
    if not (len(rewards) == len(terminations) == len(truncations) == length
            and len(observations) >= length):
        raise _refuse(plan.dataset_id, f"episode {number} has data of different lengths")
    if actions.min() < 0 or actions.max() >= len(action_map):
        raise _refuse(plan.dataset_id, f"episode {number} has actions outside its action space")
    mapped = action_map[actions]
    if (mapped < 0).any():
        bad = plan.source_meanings[int(actions[np.flatnonzero(mapped < 0)[0]])]
        kind = "full" if plan.spec.full_action_space else "minimal"
        raise _refuse(plan.dataset_id, f"action {bad} in episode {number} has no counterpart in "
                      f"{plan.spec.game}'s {kind} action set")
    buffer = EpisodeBuffer()
    if plan.mode == "preprocessed":
        frames = observations[:length]
        if plan.stacked:
            frames = frames[:, -1]
        if plan.newaxis:
            frames = frames[..., 0]
        for t in range(length):
            buffer.add(frames[t], int(mapped[t]), float(rewards[t]), bool(terminations[t]),
                       bool(truncations[t]))
    else:
        k = plan.spec.frame_skip
        size = plan.spec.screen_size

        def gray(i: int) -> np.ndarray:
            frame = observations[i]
            return ale_grayscale(frame) if plan.mode == "raw_rgb" else np.asarray(frame, np.uint8)

        for step, lo in enumerate(range(0, length, k)):
            hi = min(lo + k, length)
            if (actions[lo:hi] != actions[lo]).any():
                raise _refuse(plan.dataset_id, (
                    f"episode {number} changes action inside step {step} (emulator frames "
                    f"{lo}..{hi - 1}), so its actions fit no frame skip {k}; import it with "
                    "--frame-skip 1"))
            # The observation after a step is the max of its last two frames; the first
            # one (after reset) has nothing to pool with.
            frame = gray(lo) if lo == 0 or k == 1 else np.maximum(gray(lo - 1), gray(lo))
            last = hi - 1
            buffer.add(_resize(frame, size), int(mapped[lo]), float(rewards[lo:hi].sum()),
                       bool(terminations[last]), bool(truncations[last]))
    if not (buffer.terminations[-1] or buffer.truncations[-1]):
        buffer.truncations[-1] = True  # the episode stops here: it was cut
    return buffer


# -- import -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ImportResult:
    path: Path
    dataset_id: str
    episodes: int
    steps: int
    spec: EnvSpec
    source: str
    """How the frames were read: "preprocessed", "raw_rgb" or "raw_gray"."""

    def summary(self) -> str:
        how = {"preprocessed": "preprocessed frames taken as they are",
               "raw_rgb": "raw RGB frames preprocessed",
               "raw_gray": "raw grayscale frames preprocessed"}[self.source]
        return (f"imported {self.episodes} episode(s), {self.steps:,} steps of "
                f"{self.spec.game} from Minari dataset {self.dataset_id} into {self.path} "
                f"({how}; frame skip {self.spec.frame_skip}, "
                f"{'full' if self.spec.full_action_space else 'minimal'} action set)")


def _fingerprint(dataset_id: str) -> str:
    """Changes whenever a file of the dataset does (content of the metadata, size and time
    of the rest)."""
    directory = _dataset_dir(dataset_id)
    digest = hashlib.sha256(dataset_id.encode())
    for path in sorted(directory.rglob("*")):
        if not path.is_file():
            continue
        stat = path.stat()
        digest.update(f"{path.relative_to(directory)}:{stat.st_size}:{stat.st_mtime_ns}\n"
                      .encode())
        if path.name == "metadata.json":
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _episodes(dataset: Any) -> Iterator[Any]:
    try:
        yield from dataset.iterate_episodes()
    except OakEmuError:
        raise
    except Exception as error:
        raise DemoFileError(f"Minari dataset {dataset.spec.dataset_id} cannot be read: "
                            f"{_short(error)}") from None


def _checked_out(out: str | os.PathLike[str], recorder: str, overwrite: bool) -> Path:
    """Return `out` as a path, checking the recorder kind and that `out` may be written."""
    if recorder not in RECORDERS:
        raise ConfigError(f"the recorder kind must be one of {', '.join(RECORDERS)}, "
                          f"got {recorder!r}")
    out_path = Path(out)
    if out_path.is_dir():
        raise DemoFileError(f"{out_path} is a directory; --out needs a file name")
    if out_path.exists() and not overwrite:
        raise DemoFileError(f"{out_path} already exists; choose another --out file")
    return out_path


def _minimal_if_enough(plan: _Plan, dataset: Any, full_action_space: bool | None) -> _Plan:
    """Return `plan` on the minimal action set when nothing asked otherwise and it suffices."""
    spec = plan.spec
    if full_action_space is None and spec.full_action_space and not _has_our_spec(plan):
        minimal = action_meanings(spec.game, False)
        used = [a - plan.action_start for a in _used_actions(dataset)]
        if all(plan.source_meanings[a] in minimal for a in used
               if 0 <= a < len(plan.source_meanings)):
            spec = replace(spec, full_action_space=False, forbidden_actions=())
            plan = replace(plan, spec=spec)
    return plan


def _temp_path(out_path: Path) -> Path:
    """Return a free temporary file name next to `out_path` (the file itself is removed)."""
    try:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{out_path.name}.minari-", suffix=".h5",
                                    dir=out_path.parent)
    except OSError as error:
        raise DemoFileError(f"cannot write {out_path}: {error.strerror}") from None
    os.close(fd)
    tmp = Path(name)
    tmp.unlink()  # the writer creates the file itself
    return tmp


def _write_demo(tmp: Path, plan: _Plan, dataset: Any, mapping: np.ndarray,
                recorder: str) -> tuple[int, int]:
    """Return the episodes and steps written from `dataset` into the demo file `tmp`."""
    episodes = steps = 0
    writer = DemoWriter(tmp, plan.spec)
    batch: list[tuple[EpisodeBuffer, str, int]] = []
    frames_in_batch = 0
    metadata = list(_episode_metadata(dataset))
    for number, episode in enumerate(_episodes(dataset)):
        buffer = _episode_steps(plan, episode, number, mapping)
        if buffer is None:
            continue
        kind, seed = _recorder_and_seed(plan, metadata, number, recorder)
        batch.append((buffer, kind, seed))
        episodes += 1
        steps += len(buffer)
        frames_in_batch += len(buffer)
        if frames_in_batch >= _BATCH_FRAMES:
            writer.write_episodes(batch)
            batch, frames_in_batch = [], 0
    if batch:
        writer.write_episodes(batch)
    if episodes == 0:
        raise _refuse(plan.dataset_id, "it holds no steps")
    return episodes, steps


def _finish_demo(tmp: Path, out_path: Path, source: dict[str, Any]) -> None:
    """Stamp `tmp` with `source`, check it reads back and move it to `out_path` (no return)."""
    with h5py.File(tmp, "a") as handle:
        handle.attrs[SOURCE_ATTR] = np.bytes_(json.dumps(source).encode())
    DemoFile(tmp).close()  # the result must read back as a valid demo file
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, out_path)


def import_minari(dataset_id: str, out: str | os.PathLike[str], *,
                  frame_skip: int | None = None, screen_size: int | None = None,
                  full_action_space: bool | None = None, allow_jpeg: bool = False,
                  recorder: str = DEFAULT_RECORDER, overwrite: bool = False) -> ImportResult:
    """Convert the local Minari dataset `dataset_id` of an ALE game into the demo file `out`.

    `frame_skip` and `screen_size` apply to raw frame-skip-1 datasets (default 4 and 84);
    preprocessed frames keep theirs. `full_action_space` picks our action set (default: the
    minimal set when it has every meaning used). `recorder` is the kind given to episodes
    whose dataset does not name one. Refusals raise `DemoFileError`; `out` is written only
    when everything converted, and replaced only with `overwrite`.
    """
    out_path = _checked_out(out, recorder, overwrite)
    dataset = _load(dataset_id)
    fingerprint = _fingerprint(dataset_id)
    plan = _plan(dataset, dataset_id, frame_skip=frame_skip, screen_size=screen_size,
                 full_action_space=full_action_space, allow_jpeg=allow_jpeg)
    plan = _minimal_if_enough(plan, dataset, full_action_space)
    spec = plan.spec
    target_meanings = action_meanings(spec)
    mapping = _action_map(plan.source_meanings, target_meanings)
    tmp = _temp_path(out_path)
    try:
        episodes, steps = _write_demo(tmp, plan, dataset, mapping, recorder)
        _finish_demo(tmp, out_path, {
            "dataset_id": dataset_id, "fingerprint": fingerprint,
            "options": _options(frame_skip, screen_size, full_action_space, allow_jpeg,
                                recorder)})
    except BaseException as error:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(error, OSError) and not isinstance(error, OakEmuError):
            raise DemoFileError(f"cannot write {out_path}: {error.strerror or error}") from None
        raise
    return ImportResult(path=out_path, dataset_id=dataset_id, episodes=episodes, steps=steps,
                        spec=spec, source=plan.mode)


def _has_our_spec(plan: _Plan) -> bool:
    return plan.recorders is not None


def _used_actions(dataset: Any) -> set[int]:
    used: set[int] = set()
    for episode in _episodes(dataset):
        used.update(np.unique(np.asarray(episode.actions).reshape(-1)).tolist())
    return used


def _episode_metadata(dataset: Any) -> Iterator[dict[str, Any]]:
    try:
        yield from dataset.storage.get_episode_metadata(dataset.episode_indices)
    except Exception:
        return


def _recorder_and_seed(plan: _Plan, metadata: list[dict[str, Any]], number: int,
                       default: str) -> tuple[str, int]:
    meta = metadata[number] if number < len(metadata) else {}
    kind = meta.get("recorder")
    if isinstance(kind, bytes):
        kind = kind.decode("utf-8", "replace")
    if kind not in RECORDERS and plan.recorders is not None and number < len(plan.recorders):
        kind = plan.recorders[number]
    if kind not in RECORDERS:
        kind = default
    seed = meta.get("seed")
    if seed is None and plan.seeds is not None and number < len(plan.seeds):
        seed = plan.seeds[number]
    try:
        seed = int(seed) if seed is not None else -1
    except (TypeError, ValueError):
        seed = -1
    return str(kind), seed


def _options(frame_skip: int | None, screen_size: int | None, full_action_space: bool | None,
             allow_jpeg: bool, recorder: str) -> dict[str, Any]:
    return {"frame_skip": frame_skip, "screen_size": screen_size,
            "full_action_space": full_action_space, "allow_jpeg": allow_jpeg,
            "recorder": recorder}


# -- bootstrap bc minari:ID -------------------------------------------------------------


def import_path(dataset_id: str, run_dir: str | os.PathLike[str]) -> Path:
    """Where `resolve_demo_paths` keeps the import of `dataset_id` inside `run_dir`."""
    return Path(run_dir) / f"minari-{dataset_id.replace('/', '__')}.h5"


def _up_to_date(path: Path, dataset_id: str, options: dict[str, Any]) -> bool:
    if not path.is_file():
        return False
    try:
        with h5py.File(path, "r") as handle:
            raw = handle.attrs.get(SOURCE_ATTR)
        source = json.loads(raw.decode() if isinstance(raw, bytes) else str(raw))
    except (OSError, ValueError, TypeError, AttributeError):
        return False
    return (isinstance(source, dict) and source.get("dataset_id") == dataset_id
            and source.get("fingerprint") == _fingerprint(dataset_id)
            and source.get("options") == options)


def resolve_demo_paths(paths: Sequence[str], run_dir: Path) -> tuple[str, ...]:
    """Demo file paths for `paths`, importing each `minari:ID` into `run_dir/minari-<ID>.h5`
    (reused while the dataset is unchanged); other entries are returned as they are."""
    resolved = []
    for entry in paths:
        if not str(entry).startswith(MINARI_PREFIX):
            resolved.append(str(entry))
            continue
        dataset_id = str(entry)[len(MINARI_PREFIX):].strip()
        _minari()
        _check_id(dataset_id)
        target = import_path(dataset_id, run_dir)
        if not _up_to_date(target, dataset_id, _options(None, None, None, False,
                                                        DEFAULT_RECORDER)):
            _load(dataset_id)  # a clear error for a missing dataset before anything else
            import_minari(dataset_id, target, overwrite=True)
        resolved.append(str(target))
    return tuple(resolved)


def minari_game(dataset_id: str) -> str:
    """The game of the local Minari dataset `dataset_id` (refused as `import_minari` would)."""
    dataset = _load(dataset_id)
    return _plan(dataset, dataset_id, frame_skip=None, screen_size=None,
                 full_action_space=None, allow_jpeg=True).spec.game
