"""SIGKILL the real `oakemu` stages at seeded random moments; check that nothing is lost.

Each stage runs as a real subprocess of the real CLI (`python -m oakemu_rl ...`, small
budgets, `--architecture tiny`), and is killed with SIGKILL at a random moment (seeded)
after its progress bar appears:

    record      `record --demonstrator scripted` appending to one demo file, run after run:
                the number of committed episodes never decreases, and a last run without
                a kill appends exactly its episodes.
    bc          `bootstrap bc`: once bc.pt exists it always loads.
    calibrate   `bootstrap calibrate`: bc.pt is never touched, calibrated.pt always loads.
    ppo         `finetune ppo`, then `--resume` after every kill: the global step saved in
                ppo_last.pt never goes back, the resumed runs reach the end, and the
                metrics hold every update exactly once.
    pipeline    `pipeline run` on a tiny TOML: a re-run never redoes a finished stage, the
                set of finished stages never shrinks, and the last re-run completes.
    record_gb   `record --game catch --demonstrator scripted` on the Game Boy (PyBoy),
                checked as record is.

After every kill every output file in the stage's folder is opened: checkpoints with
`load_checkpoint`, demo files with `validate_demo_file`, JSON, JSONL (every complete
line), PNG and text. Temporary files `.NAME.tmp-*` (what a kill mid-write leaves) are
counted, never opened as outputs. Prints one row per stage.

    .venv/bin/python benchmarks/kill_harness.py --kills 5 --seed 0

tests/test_kills.py runs the same harness with one kill per stage and smaller budgets.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

TEMP = re.compile(r"^\..+\.tmp-")
STAGES = ("record", "bc", "calibrate", "ppo", "pipeline", "record_gb")
PIPELINE_STAGES = ("record", "bc", "calibrate", "ppo", "test")


@dataclass(frozen=True)
class Budget:
    """How much work each run has: enough that a kill lands mid-run most of the time."""

    record_episodes: int = 6
    record_max_steps: int = 40
    gameboy_max_steps: int = 600
    """Game Boy steps are ~10x cheaper than Atari's: longer episodes keep a kill mid-run."""
    bc_epochs: int = 30
    calibrate_iterations: int = 30
    ppo_total_steps: int = 4096
    pipeline_ppo_steps: int = 1024
    window: float = 4.0
    """Kills land uniformly in [0, window] seconds after the stage's progress bar appears
    (the window shrinks when a run finishes first)."""
    timeout: float = 300.0
    """A run that takes longer is killed and reported as a hang."""
    pipeline_marker: str = "[record] running"
    """Pipeline kills land this long after this line: from the first stage on."""
    mid_write_first: bool = False
    """Start the alternation with a mid-write kill on every other stage (record,
    calibrate, pipeline), so that one kill per stage still covers both kinds."""
    finish_runs: bool = True
    """After the kills, also run bc and calibrate to the end (record, ppo and the pipeline
    always are: their checks need it)."""


QUICK = Budget(record_episodes=3, record_max_steps=30, gameboy_max_steps=450, bc_epochs=12,
               calibrate_iterations=12, ppo_total_steps=2048, pipeline_ppo_steps=256,
               window=1.5, timeout=120.0, pipeline_marker="[bc] running",
               mid_write_first=True, finish_runs=False)


@dataclass
class StageReport:
    stage: str
    command: str
    kills: int = 0
    finished_first: int = 0
    """Runs that ended before their kill moment (they are checked too)."""
    files_checked: int = 0
    temp_paths: set[str] = field(default_factory=set)
    """Temporary files found after kills: each one is a kill that landed mid-write."""
    completions: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def temp_files(self) -> int:
        return len(self.temp_paths)
    notes: list[str] = field(default_factory=list)


# -- checking what is on disk ---------------------------------------------------------------


def check_file(path: Path) -> str | None:
    """None when the output file at `path` is whole, else what is wrong with it."""
    from oakemu_rl.checkpoint import load_checkpoint
    from oakemu_rl.demos import validate_demo_file
    from oakemu_rl.errors import OakEmuError

    try:
        if path.suffix == ".pt":
            load_checkpoint(path)
        elif path.suffix == ".h5":
            validate_demo_file(path).close()
        elif path.suffix == ".json":
            json.loads(path.read_text())
        elif path.suffix == ".jsonl":
            lines = path.read_text().split("\n")  # the last piece is "" or a cut line
            for line in lines[:-1]:
                json.loads(line)
        elif path.suffix == ".png":
            from PIL import Image

            with Image.open(path) as image:
                image.verify()
        elif path.suffix in (".md", ".toml", ".log") or path.name == ".last-run":
            path.read_text()
        else:
            return None
    except (OakEmuError, ValueError, OSError) as error:
        return f"{path}: {str(error).splitlines()[0][:200]}"
    return None


def check_tree(folder: Path, report: StageReport) -> None:
    for path in sorted(folder.rglob("*")):
        if not path.is_file() or "tb" in path.relative_to(folder).parts[:-1]:
            continue  # TensorBoard's event files are its own append-only format
        if TEMP.match(path.name):
            report.temp_paths.add(str(path))
            continue
        problem = check_file(path)
        report.files_checked += 1
        if problem:
            report.problems.append(f"damaged output after a kill: {problem}")


def _temps(folder: Path) -> set[str]:
    """The temporary files `.NAME.tmp-*` in `folder`'s tree: writes in progress, or ones
    a kill cut."""
    found, stack = set(), [folder]
    while stack:
        with os.scandir(stack.pop()) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(Path(entry.path))
                elif TEMP.match(entry.name):
                    found.add(entry.path)
    return found


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# -- running and killing ------------------------------------------------------------------


class Harness:
    def __init__(self, workdir: Path, seed: int, budget: Budget = Budget(),
                 say: Callable[[str], None] = print) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.rng = random.Random(seed)
        self.budget = budget
        self.say = say
        self.env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
                        OAKEMU_RUNS=str(self.workdir / "runs_root"), SDL_VIDEODRIVER="dummy",
                        SDL_AUDIODRIVER="dummy", PYTHONUNBUFFERED="1")
        self.env.pop("PYTEST_CURRENT_TEST", None)
        self.env.setdefault("OAKEMU_ROM_DIR", str(self.workdir / "roms"))  # never the user's
        self.runs = 0
        self.mid_write = False
        """When set, the next kill waits for a temporary file instead of a random delay."""

    def run(self, args: list[str], cwd: Path, *, marker: str | None = None,
            window: float = 0.0, ready: Callable[[int], bool] | None = None
            ) -> tuple[str, int | None, str]:
        """Run `oakemu ARGS`. With `marker`, SIGKILL it a random moment in [0, window]
        seconds after `marker` appears in its output (and `ready(start_ns)` holds) or,
        with `self.mid_write`, the moment a temporary file `.NAME.tmp-*` shows up in `cwd`
        (a write in progress). Returns (how it ended: "killed", "finished" or "hung", its
        exit code, its output)."""
        self.runs += 1
        log = cwd / f"run{self.runs:03d}.log"
        start_ns = time.time_ns()
        stale = _temps(cwd)  # left by earlier kills: not a write of this run
        with open(log, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "oakemu_rl", *args], cwd=cwd,
                                    stdout=out, stderr=subprocess.STDOUT, env=self.env)
        started = time.monotonic()
        how = "finished"
        try:
            if marker is not None:
                while marker.encode() not in log.read_bytes() or not (
                        ready is None or ready(start_ns)):
                    if proc.poll() is not None:
                        break
                    if time.monotonic() - started > self.budget.timeout:
                        raise TimeoutError
                    time.sleep(0.02)
                if self.mid_write:
                    while proc.poll() is None and not _temps(cwd) - stale:
                        if time.monotonic() - started > self.budget.timeout:
                            raise TimeoutError
                else:
                    deadline = time.monotonic() + self.rng.uniform(0.0, window)
                    while proc.poll() is None and time.monotonic() < deadline:
                        time.sleep(0.005)
                if proc.poll() is None:
                    os.kill(proc.pid, signal.SIGKILL)
                    how = "killed"
            proc.wait(timeout=max(1.0, self.budget.timeout - (time.monotonic() - started)))
        except (TimeoutError, subprocess.TimeoutExpired):
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            how = "hung"
        return how, proc.returncode, log.read_text(errors="replace")

    def _folder(self, name: str) -> Path:
        folder = self.workdir / name
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        return folder

    def _kill_loop(self, report: StageReport, kills: int, attempt: Callable[[float], str]
                   ) -> None:
        """Call attempt(window) until `kills` runs were killed (at most 4 × kills runs); a
        run that finishes first shrinks the window. Every other kill aims at a write in
        progress instead of a random moment."""
        window = self.budget.window
        for _ in range(4 * kills):
            if report.kills >= kills:
                break
            shift = self.budget.mid_write_first and STAGES.index(report.stage) % 2 == 0
            self.mid_write = (report.kills + shift) % 2 == 1
            how = attempt(window)
            self.mid_write = False
            if how == "killed":
                report.kills += 1
            elif how == "finished":
                report.finished_first += 1
                window *= 0.6
            else:
                report.problems.append("a run hung")
                break
        if report.kills < kills:
            report.problems.append(f"only {report.kills} of {kills} runs could be killed")

    # -- the stages ---------------------------------------------------------------------------

    def record(self, kills: int, game: str = "pong", stage: str = "record") -> StageReport:
        from oakemu_rl.demos import DemoFile

        b = self.budget
        folder = self._folder(stage)
        out = folder / "demos.h5"
        what = "" if game == "pong" else f" --game {game}"
        report = StageReport(stage, f"oakemu record{what} --demonstrator scripted (append)")
        max_steps = b.record_max_steps if game == "pong" else b.gameboy_max_steps
        counts = [0]

        def episodes() -> int:
            if not out.exists():
                return 0
            with DemoFile(out) as demo:
                return len(demo.episodes)

        def args(seed: int) -> list[str]:
            return ["record", "--demonstrator", "scripted", "--game", game, "--episodes",
                    str(b.record_episodes), "--max-steps", str(max_steps),
                    "--noise", "0.1", "--seed", str(seed), "--out", str(out)]

        def attempt(window: float) -> str:
            how, code, output = self.run(args(100 * self.runs), folder,
                                         marker=f"recording {game}", window=window)
            check_tree(folder, report)
            now = episodes()
            if now < counts[-1]:
                report.problems.append(f"committed episodes fell from {counts[-1]} to {now}")
            if how == "finished" and code != 0:
                report.problems.append(f"an unkilled run failed: {output[-300:]}")
            counts.append(now)
            return how

        self._kill_loop(report, kills, attempt)
        before = episodes()
        _, code, output = self.run(args(999), folder)
        check_tree(folder, report)
        if code != 0 or episodes() != before + b.record_episodes:
            report.problems.append(f"the last run did not append {b.record_episodes} episodes "
                                   f"to the {before} kept: {output[-300:]}")
        else:
            report.completions += 1
        counts.append(episodes())
        report.notes.append("episodes on disk after each run: "
                            + " → ".join(str(c) for c in counts))
        return report

    def record_gb(self, kills: int) -> StageReport:
        """record on the Game Boy: CATCH, the project's own ROM, played from RAM."""
        return self.record(kills, game="catch", stage="record_gb")

    def _demos(self) -> Path:
        """The record stage's demo file, or a fresh one."""
        demos = self.workdir / "record" / "demos.h5"
        if not demos.exists():
            folder = self._folder("record")
            self.run(["record", "--demonstrator", "scripted", "--episodes", "3",
                      "--max-steps", "40", "--out", str(demos)], folder)
        return demos

    def bc(self, kills: int) -> StageReport:
        b = self.budget
        folder = self._folder("bc")
        demos = folder / "demos.h5"
        shutil.copyfile(self._demos(), demos)
        run_dir = folder / "run"
        report = StageReport("bc", "oakemu bootstrap bc --architecture tiny")

        def args(epochs: int) -> list[str]:
            return ["bootstrap", "bc", str(demos), "--architecture", "tiny", "--epochs",
                    str(epochs), "--patience", "0", "--batch-size", "32", "--device", "cpu",
                    "--run-dir", str(run_dir), "--seed", str(self.runs)]

        def attempt(window: float) -> str:
            had = (run_dir / "bc.pt").exists()
            how, code, output = self.run(args(b.bc_epochs), folder, marker="bc epoch",
                                         window=window)
            check_tree(folder, report)
            if had and not (run_dir / "bc.pt").exists():
                report.problems.append("bc.pt disappeared after a kill")
            if how == "finished" and code != 0:
                report.problems.append(f"an unkilled run failed: {output[-300:]}")
            return how

        self._kill_loop(report, kills, attempt)
        if b.finish_runs:
            _, code, output = self.run(args(2), folder)
            check_tree(folder, report)
            if code != 0 or not (run_dir / "bc.pt").exists():
                report.problems.append(f"the last bc run failed: {output[-300:]}")
            else:
                report.completions += 1
        return report

    def _bc_run(self) -> Path:
        """The bc stage's bc.pt, or (when that stage did not run or was killed before its
        first save) a fresh tiny one written here."""
        source = self.workdir / "bc" / "run" / "bc.pt"
        return source if source.exists() else _tiny_checkpoint(
            self.workdir / "prerequisites" / "bc.pt", "bc")

    def calibrate(self, kills: int) -> StageReport:
        b = self.budget
        folder = self._folder("calibrate")
        run_dir = folder / "run"
        run_dir.mkdir()
        shutil.copyfile(self._bc_run(), run_dir / "bc.pt")
        bc_digest = sha256(run_dir / "bc.pt")
        report = StageReport("calibrate", "oakemu bootstrap calibrate")

        def args(iterations: int) -> list[str]:
            return ["bootstrap", "calibrate", "--run-dir", str(run_dir), "--num-envs", "2",
                    "--holdout-envs", "1", "--num-steps", "32", "--iterations",
                    str(iterations), "--target-explained-variance", "1", "--device", "cpu",
                    "--seed", str(self.runs)]

        def attempt(window: float) -> str:
            how, code, output = self.run(args(b.calibrate_iterations), folder,
                                         marker="calibrate:", window=window)
            check_tree(folder, report)
            if sha256(run_dir / "bc.pt") != bc_digest:
                report.problems.append("calibrate changed bc.pt")
            if how == "finished" and code != 0:
                report.problems.append(f"an unkilled run failed: {output[-300:]}")
            return how

        self._kill_loop(report, kills, attempt)
        if b.finish_runs:
            _, code, output = self.run(args(2), folder)
            check_tree(folder, report)
            if code != 0 or not (run_dir / "calibrated.pt").exists():
                report.problems.append(f"the last calibrate run failed: {output[-300:]}")
            else:
                report.completions += 1
        return report

    def _calibrated(self) -> Path:
        source = self.workdir / "calibrate" / "run" / "calibrated.pt"
        return source if source.exists() else _tiny_checkpoint(
            self.workdir / "prerequisites" / "calibrated.pt", "calibrate")

    def ppo(self, kills: int) -> StageReport:
        from oakemu_rl.checkpoint import load_checkpoint
        from oakemu_rl.metrics import read_metrics

        b = self.budget
        folder = self._folder("ppo")
        run_dir = folder / "run"
        run_dir.mkdir()
        shutil.copyfile(self._calibrated(), run_dir / "calibrated.pt")
        last, final = run_dir / "ppo_last.pt", run_dir / "ppo.pt"
        batch = 2 * 32
        report = StageReport("ppo", "oakemu finetune ppo (+ --resume)")
        saved = [0]
        resumes: list[str] = []

        def step(path: Path) -> int:
            return int(load_checkpoint(path).steps["ppo/global_step"]) if path.exists() else 0

        def args(resume: bool) -> list[str]:
            return ["finetune", "ppo", "--run-dir", str(run_dir), "--total-steps",
                    str(b.ppo_total_steps), "--num-envs", "2", "--num-steps", "32",
                    "--num-minibatches", "2", "--update-epochs", "2", "--warmup-updates", "2",
                    "--warmup-ramp-updates", "2", "--eval-episodes", "0",
                    "--checkpoint-every", "1", "--device", "cpu",
                    *(["--resume"] if resume else [])]

        def check_complete(output: str) -> None:
            steps = [r["step"] for r in read_metrics(run_dir / "ppo_metrics.jsonl")
                     if "charts/update" in r]
            expected = list(range(batch, b.ppo_total_steps + 1, batch))
            if step(final) != b.ppo_total_steps:
                report.problems.append(f"ppo.pt ends at step {step(final)}, not "
                                       f"{b.ppo_total_steps}: {output[-300:]}")
            elif steps != expected:
                report.problems.append(f"the metrics do not hold each update once: {steps}")
            else:
                report.completions += 1

        def saved_since(start_ns: int) -> bool:  # a kill always leaves progress to resume
            return last.exists() and last.stat().st_mtime_ns >= start_ns

        def attempt(window: float) -> str:
            resume = last.exists()
            how, code, output = self.run(args(resume), folder, marker="ppo:", window=window,
                                         ready=saved_since)
            check_tree(folder, report)
            now = step(last)
            if now < saved[-1]:
                report.problems.append(f"ppo_last.pt went back from step {saved[-1]} to {now}")
            if resume:
                resumes.append(f"{saved[-1]}→{now}")
            saved.append(now)
            if how == "finished":
                if code != 0:
                    report.problems.append(f"an unkilled run failed: {output[-300:]}")
                else:  # the chain reached the end before the kills ran out: start another
                    check_complete(output)
                    for path in (last, final):
                        path.unlink(missing_ok=True)
                    saved.append(0)
            return how

        self._kill_loop(report, kills, attempt)
        resume = last.exists()
        _, code, output = self.run(args(resume), folder)
        check_tree(folder, report)
        if code != 0:
            report.problems.append(f"the last ppo run failed: {output[-300:]}")
        else:
            if resume:
                resumes.append(f"{saved[-1]}→{b.ppo_total_steps}")
            check_complete(output)
        report.notes.append("resumed from step → reached: " + (", ".join(resumes) or "-"))
        return report

    def pipeline(self, kills: int) -> StageReport:
        from oakemu_rl.checkpoint import load_checkpoint
        from oakemu_rl.metrics import read_metrics

        b = self.budget
        folder = self._folder("pipeline")
        config = folder / "tiny.toml"
        config.write_text(PIPELINE_TOML.format(ppo_steps=b.pipeline_ppo_steps))
        report = StageReport("pipeline", "oakemu pipeline run tiny.toml (re-run)")
        state = {"dir": folder / "run1", "done": set()}
        progress: list[str] = []

        def finished_stages() -> set[str]:
            try:
                data = json.loads((state["dir"] / "pipeline_state.json").read_text())
            except (OSError, ValueError):
                return set()
            return {s for s in PIPELINE_STAGES
                    if s in data and Path(data[s]["output"]).exists()}

        def check_rerun(output: str) -> None:
            redone = {s for s in PIPELINE_STAGES if f"[{s}] running" in output} & state["done"]
            if redone:
                report.problems.append(f"a re-run redid finished stages {sorted(redone)}")

        def check_complete(output: str) -> None:
            run_dir = state["dir"]
            steps = [r["step"] for r in read_metrics(run_dir / "ppo_metrics.jsonl")
                     if "charts/update" in r]
            expected = list(range(32, b.pipeline_ppo_steps + 1, 32))
            ppo_step = load_checkpoint(run_dir / "ppo.pt").steps["ppo/global_step"]
            if not (run_dir / "test.json").exists() or ppo_step != b.pipeline_ppo_steps:
                report.problems.append(f"the pipeline did not complete: {output[-300:]}")
            elif steps != expected:
                report.problems.append(f"the ppo metrics do not hold each update once: {steps}")
            else:
                report.completions += 1

        def args() -> list[str]:
            return ["pipeline", "run", str(config), "--run-dir", str(state["dir"])]

        def attempt(window: float) -> str:
            how, code, output = self.run(args(), folder, marker=b.pipeline_marker,
                                         window=window)
            check_rerun(output)
            check_tree(folder, report)
            done = finished_stages()
            if not done >= state["done"]:
                report.problems.append(f"finished stages were lost: {sorted(state['done'])} "
                                       f"→ {sorted(done)}")
            progress.append("+".join(s for s in PIPELINE_STAGES if s in done) or "none")
            state["done"] = done
            if how == "finished":
                if code != 0:
                    report.problems.append(f"an unkilled run failed: {output[-300:]}")
                else:  # completed before the kills ran out: another run directory
                    check_complete(output)
                    state["dir"] = folder / f"run{report.completions + 1}"
                    state["done"] = set()
            return how

        self._kill_loop(report, kills, attempt)
        before = set(state["done"])
        _, code, output = self.run(args(), folder)
        check_rerun(output)
        check_tree(folder, report)
        missing = [s for s in before if f"[{s}] up to date" not in output]
        if code != 0:
            report.problems.append(f"the last re-run failed: {output[-300:]}")
        elif missing:
            report.problems.append(f"the last re-run did not skip {missing}")
        else:
            check_complete(output)
        report.notes.append("finished stages after each kill: " + ", ".join(progress))
        return report

    def run_all(self, kills: int, stages: tuple[str, ...] = STAGES) -> list[StageReport]:
        reports = []
        for stage in stages:
            started = time.perf_counter()
            report = getattr(self, stage)(kills)
            report.notes.append(f"{time.perf_counter() - started:.0f}s")
            self.say(format_row(report))
            reports.append(report)
        return reports


def _tiny_checkpoint(path: Path, stage: str) -> Path:
    """A fresh tiny Pong checkpoint, standing in for a stage's output."""
    import torch

    from oakemu_rl.checkpoint import Checkpoint, save_checkpoint
    from oakemu_rl.envs import EnvSpec, action_mask, action_meanings
    from oakemu_rl.model import ARCHITECTURES, PPOModel

    spec = EnvSpec(game="pong")
    meanings = list(action_meanings(spec.game, spec.full_action_space))
    torch.manual_seed(0)
    model = PPOModel(spec.observation_shape, len(meanings), ARCHITECTURES["tiny"])
    return save_checkpoint(path, Checkpoint.from_model(
        model, stage=stage, action_meanings=meanings,
        action_mask=[bool(v) for v in action_mask(spec)], env_spec=spec.to_dict(),
        steps={"epochs": 1}))


PIPELINE_TOML = """
name = "tiny"

[env]
game = "pong"

[demos]
episodes = 3
max_steps = 40

[bc]
epochs = 3
batch_size = 32
architecture = "tiny"

[calibrate]
num_envs = 2
holdout_envs = 1
num_steps = 16
iterations = 3

[ppo]
total_steps = {ppo_steps}
num_envs = 2
num_steps = 16
warmup_updates = 1
warmup_ramp_updates = 1
eval_episodes = 0
checkpoint_every = 1

[evaluate]
episodes = 1
max_steps = 30
"""


HEADER = (f"{'command':<48}{'kills':>6}{'early':>6}{'file checks':>15}{'tmp left':>9}"
          f"{'completed':>10}  outcome")


def format_row(report: StageReport) -> str:
    outcome = "ok" if not report.problems else f"{len(report.problems)} PROBLEM(S)"
    return (f"{report.command:<48}{report.kills:>6}{report.finished_first:>6}"
            f"{report.files_checked:>15}{report.temp_files:>9}{report.completions:>10}  "
            f"{outcome}")


def format_report(reports: list[StageReport]) -> str:
    lines = [HEADER, *(format_row(r) for r in reports), ""]
    for report in reports:
        lines += [f"{report.stage}: {note}" for note in report.notes]
        lines += [f"{report.stage}: PROBLEM {problem}" for problem in report.problems]
    total = sum(r.kills for r in reports)
    files = sum(r.files_checked for r in reports)
    bad = sum(len(r.problems) for r in reports)
    lines.append(f"\n{total} kills, {files} output-file checks after them, "
                 f"{sum(r.temp_files for r in reports)} temporary files left by kills "
                 f"mid-write, {bad} problems")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=5, help="SIGKILLs per stage")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stages", default=",".join(STAGES),
                        help=f"comma-separated, from {', '.join(STAGES)}")
    parser.add_argument("--quick", action="store_true", help="the test suite's budgets")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where the runs go (default: a new temporary folder, kept)")
    args = parser.parse_args()
    stages = tuple(s for s in args.stages.split(",") if s)
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        parser.error(f"unknown stages {unknown}")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="oakemu-kills-"))
    print(f"{args.kills} kills per stage, seed {args.seed}, in {workdir}\n\n{HEADER}",
          flush=True)
    harness = Harness(workdir, args.seed, QUICK if args.quick else Budget(),
                      say=lambda row: print(row, flush=True))
    reports = harness.run_all(args.kills, stages)
    print("\n" + format_report(reports))
    return 0 if not any(r.problems for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
