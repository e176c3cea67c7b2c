"""Games played in several processes (`EvalConfig.workers`): the same scores as in one,
errors raised as they were raised there, and no process left behind."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from builders import write_checkpoint
from click.testing import CliRunner
from test_tester import _varied_model
from travelling import DiesOnSeed, Signing

from oakemu_rl.agents import PolicyAgent, greedy_agent
from oakemu_rl.agents.base import RandomAgent
from oakemu_rl.agents.play import (
    AgentActionError,
    EvalConfig,
    GamesProcessError,
    play_games,
)
from oakemu_rl.agents.recording import RecordConfig, record
from oakemu_rl.agents.scripted import make_demonstrator
from oakemu_rl.cli import cli
from oakemu_rl.demos import DemoFile
from oakemu_rl.envs import EnvSpec, action_mask


def _signatures(log: Path) -> dict[int, int]:
    """seed -> the pid of the process that played it (each seed signed once)."""
    lines = [line.split() for line in log.read_text().splitlines()]
    seeds = [int(seed) for _, seed in lines]
    assert len(seeds) == len(set(seeds)), "a game was played twice"
    return {int(seed): int(pid) for pid, seed in lines}


def _agents(spec: EnvSpec) -> dict[str, object]:
    model = _varied_model(spec)
    mask = action_mask(spec)
    return {
        "onnx greedy": greedy_agent(model, mask, device="cpu", engine="onnx"),
        "torch greedy": PolicyAgent(model, mask, greedy=True),
        "onnx sampled": greedy_agent(model, mask, device="cpu", engine="onnx", sample=True),
        "torch sampled": PolicyAgent(model, mask, greedy=False),
        "random": RandomAgent(mask),
    }


def test_games_in_processes_score_as_in_this_one(tmp_path: Path) -> None:
    """Each kind of portable agent plays its Breakout games in two other processes (the
    greedy onnx agent in three too, dealt 2, 1 and 1 games) with exactly the scores and
    lengths of the same games played here, in the order of their seeds: every game is its
    own env and seed wherever it is played."""
    spec = EnvSpec(game="breakout")
    config = EvalConfig(episodes=4, max_steps=200, seed=4)
    runs = [(name, agent, 2) for name, agent in _agents(spec).items()]
    runs.append(("onnx greedy", runs[0][1], 3))
    for name, agent, workers in runs:
        assert agent.portable, name
        log = tmp_path / f"{name}-{workers}.log"
        here = play_games(agent, spec, config, progress=False)
        there = play_games(Signing(agent, log), spec,
                           dataclasses.replace(config, workers=workers), progress=False)
        assert (there.scores, there.lengths) == (here.scores, here.lengths), name
        assert len(set(here.lengths)) > 1 or len(set(here.scores)) > 1, name  # games differ
        played = _signatures(log)
        assert sorted(played) == list(config.seeds)
        assert len(set(played.values())) == workers and os.getpid() not in played.values()


def test_the_scripted_demonstrator_plays_in_processes_as_here(tmp_path: Path) -> None:
    """The human-style Pong player keeps what it saw between steps; every game resets it,
    so its copies in two processes play each game as one player would."""
    spec = EnvSpec(game="pong")
    demonstrator = make_demonstrator(spec, seed=0, style="human")
    assert demonstrator.portable
    here = play_games(demonstrator, spec, EvalConfig(episodes=4, max_steps=500, seed=9),
                      progress=False)
    log = tmp_path / "games.log"
    there = play_games(Signing(demonstrator, log), spec,
                       EvalConfig(episodes=4, max_steps=500, seed=9, workers=2),
                       progress=False)
    assert (there.scores, there.lengths) == (here.scores, here.lengths)
    assert any(score != 0 for score in here.scores)  # points were won or lost
    assert len(set(_signatures(log).values())) == 2


def test_a_bad_action_in_a_process_is_raised_here() -> None:
    """An agent in another process that picks a forbidden action stops the games with the
    same `AgentActionError` it would raise here."""
    spec = EnvSpec(game="pong", forbidden_actions=("FIRE",))
    agent = RandomAgent(np.ones(6, dtype=bool))  # ignores the mask: FIRE comes up
    config = EvalConfig(episodes=4, max_steps=200, seed=0)
    with pytest.raises(AgentActionError, match="forbidden action FIRE") as here:
        play_games(agent, spec, config, progress=False)
    with pytest.raises(AgentActionError, match="forbidden action FIRE") as there:
        play_games(agent, spec, EvalConfig(episodes=4, max_steps=200, seed=0, workers=2),
                   progress=False)
    assert str(there.value) == str(here.value)


def test_a_process_that_dies_ends_the_games_in_one_line_and_takes_the_others(
    tmp_path: Path
) -> None:
    """A process that ends mid-game without a word (killed, out of memory) is named with
    its exit code, and the other processes do not outlive the call."""
    spec = EnvSpec(game="pong")
    log = tmp_path / "games.log"
    agent = DiesOnSeed(RandomAgent(action_mask(spec)), log, seed=13)
    with pytest.raises(GamesProcessError, match=r"ended before finishing them \(exit code 3"):
        play_games(agent, spec, EvalConfig(episodes=6, seed=10, workers=2), progress=False)
    pids = set(_signatures(log).values())
    assert len(pids) == 2
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_oakemu_test_workers_give_the_scores_of_one_process(tmp_path: Path) -> None:
    """`oakemu test --workers 2` prints the table of `--workers 1`, for the checkpoint and
    the scripted demonstrator alike."""
    spec = EnvSpec(game="breakout")
    torch.manual_seed(0)
    path = write_checkpoint(tmp_path / "bc.pt", spec, model=_varied_model(spec))

    def scores(workers: int) -> dict[str, list[float]]:
        result = CliRunner().invoke(cli, [
            "test", str(path), "--demonstrator", "scripted", "--style", "human",
            "--episodes", "4", "--max-steps", "200", "--seed", "3", "--workers",
            str(workers), "--json"])
        assert result.exit_code == 0, result.output
        return {k: v["scores"] for k, v in json.loads(result.output).items()}

    one = scores(1)
    assert set(one) == {"checkpoint", "scripted"}
    assert scores(2) == one


def _episodes(path: Path) -> list[tuple]:
    """Every episode of a demo file, in order: its info and each of its arrays."""
    with DemoFile(path) as demos:
        return [(dataclasses.astuple(info),
                 *(demos.read(info.index, key).tolist() for key in
                   ("actions", "rewards", "terminations", "truncations")),
                 demos.read(info.index, "frames").tobytes())
                for info in demos.episodes]


def test_recording_in_processes_writes_the_file_of_one_process(tmp_path: Path) -> None:
    """`record` with two processes writes the demo file one process writes, game for game
    in seed order: the human-style player recording, and a policy playing while that
    player labels (a relabelling round). Other processes played the games."""
    spec = EnvSpec(game="pong")
    driver = greedy_agent(_varied_model(spec), action_mask(spec), device="cpu",
                          engine="onnx")
    for name, with_driver in (("recorded", False), ("relabelled", True)):
        log = tmp_path / f"{name}.log"
        files = {}
        for workers in (1, 2):
            player = make_demonstrator(spec, seed=0, style="human")
            signed = Signing(driver if with_driver else player, log)
            agents = (player, signed) if with_driver else (signed, None)
            files[workers] = tmp_path / f"{name}-{workers}.h5"
            result = record(RecordConfig(out=files[workers], spec=spec, episodes=4, seed=20,
                                         max_steps=300, progress=False, workers=workers),
                            *agents)
            assert [e["seed"] for e in result.episodes] == [20, 21, 22, 23]
        one, two = _episodes(files[1]), _episodes(files[2])
        assert one == two, name
        assert [info[5] for info, *_ in one] == [20, 21, 22, 23]
        assert len({actions and tuple(actions) for _, actions, *_ in one}) == 4  # games differ
        pids = [pid for seed, pid in sorted(_signatures_of_all(log))]
        assert pids[:4] == [os.getpid()] * 4  # one process: here
        assert len(set(pids[4:])) == 2 and os.getpid() not in pids[4:], name


def _signatures_of_all(log: Path) -> list[tuple[int, int]]:
    """(order signed, pid) of every game in the log, a seed played more than once kept."""
    return [(n, int(line.split()[0])) for n, line in enumerate(log.read_text().splitlines())]


def test_a_recording_process_that_dies_keeps_the_games_before_it(tmp_path: Path) -> None:
    """A process that dies mid-game ends the recording in one line; the file keeps the
    games committed before, in seed order from the first, and still opens."""
    spec = EnvSpec(game="pong")
    out = tmp_path / "demos.h5"
    agent = DiesOnSeed(RandomAgent(action_mask(spec)), tmp_path / "games.log", seed=13)
    with pytest.raises(GamesProcessError, match=r"ended before finishing them \(exit code 3"):
        record(RecordConfig(out=out, spec=spec, episodes=6, seed=10, max_steps=100,
                            progress=False, workers=2), agent)
    with DemoFile(out) as demos:
        seeds = [info.seed for info in demos.episodes]
    assert seeds == [10, 11, 12][:len(seeds)]  # a prefix: game 3 (seed 13) never came


def test_oakemu_record_workers_write_the_file_of_one_process(tmp_path: Path) -> None:
    """`oakemu record --workers 2` writes the file `--workers 1` writes."""
    files = {}
    for workers in (1, 2):
        files[workers] = tmp_path / f"demos-{workers}.h5"
        result = CliRunner().invoke(cli, [
            "record", "--game", "pong", "--demonstrator", "scripted", "--style", "human",
            "--episodes", "3", "--max-steps", "120", "--seed", "5", "--workers",
            str(workers), "--out", str(files[workers])])
        assert result.exit_code == 0, result.output
        assert "wrote 3 episode(s)" in result.output
    assert _episodes(files[2]) == _episodes(files[1])
    assert [info[5] for info, *_ in _episodes(files[1])] == [5, 6, 7]


def _cgroup(root: Path, folder: str, files: dict[str, str]) -> None:
    (root / folder).mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (root / folder / name).write_text(text + "\n")


def test_a_containers_cpu_quota_caps_the_game_processes(tmp_path: Path) -> None:
    """The default number of game processes follows a container's CPU quota (cgroup v2
    `cpu.max`, v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`), read from folders laid out
    as the kernel lays them out."""
    from oakemu_rl.runtime import cgroup_cpu_quota, usable_cpus

    membership = tmp_path / "cgroup"
    # v2: the process's own group sets 1.5 CPUs, the root none
    v2 = tmp_path / "v2"
    membership.write_text("0::/user.slice/job\n")
    _cgroup(v2, "", {"cpu.max": "max 100000"})
    _cgroup(v2, "user.slice/job", {"cpu.max": "150000 100000"})
    assert cgroup_cpu_quota(v2, membership) == 1.5
    # the smallest of the quotas set wins
    _cgroup(v2, "", {"cpu.max": "100000 100000"})
    assert cgroup_cpu_quota(v2, membership) == 1.0
    # no quota anywhere
    _cgroup(v2, "", {"cpu.max": "max 100000"})
    _cgroup(v2, "user.slice/job", {"cpu.max": "max 100000"})
    assert cgroup_cpu_quota(v2, membership) is None
    # a quota on a group above the process's binds it too
    _cgroup(v2, "user.slice", {"cpu.max": "250000 100000"})
    assert cgroup_cpu_quota(v2, membership) == 2.5
    _cgroup(v2, "user.slice", {"cpu.max": "max 100000"})
    # v1 inside a container: /proc names the host's path, the mount is the group itself
    v1 = tmp_path / "v1"
    membership.write_text("12:pids:/docker/abc\n4:cpu,cpuacct:/docker/abc\n1:name=systemd:/\n")
    _cgroup(v1, "cpu,cpuacct", {"cpu.cfs_quota_us": "200000", "cpu.cfs_period_us": "100000"})
    assert cgroup_cpu_quota(v1, membership) == 2.0
    _cgroup(v1, "cpu,cpuacct", {"cpu.cfs_quota_us": "-1", "cpu.cfs_period_us": "100000"})
    assert cgroup_cpu_quota(v1, membership) is None
    # v1 on a host: the group's parent in the controller's mount sets the quota
    membership.write_text("4:cpu,cpuacct:/kubepods/pod1/abc\n")
    _cgroup(v1, "cpu,cpuacct/kubepods/pod1", {"cpu.cfs_quota_us": "50000",
                                              "cpu.cfs_period_us": "100000"})
    assert cgroup_cpu_quota(v1, membership) == 0.5
    membership.write_text("12:pids:/docker/abc\n4:cpu,cpuacct:/docker/abc\n1:name=systemd:/\n")
    # unreadable or foreign text is no quota, never an error
    _cgroup(v1, "cpu,cpuacct", {"cpu.cfs_quota_us": "lots", "cpu.cfs_period_us": "100000"})
    assert cgroup_cpu_quota(v1, membership) is None
    assert cgroup_cpu_quota(tmp_path / "absent", tmp_path / "absent-cgroup") is None
    # on this machine: never more than the affinity allows, never fewer than one
    assert 1 <= usable_cpus() <= len(os.sched_getaffinity(0))
