"""bc and ppo on several processes: real torchrun launches on the CPU (gloo backend).

Each launch costs a few seconds of process start-up, so the runs are tiny: a small model,
a few updates. What they check is the contract of issue "beyond one machine": identical
weights on every rank, the same training as one process with all the envs, one checkpoint
from two "nodes", and a clear, bounded end when a rank dies or the set-up is wrong.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from builders import record_scripted, write_checkpoint

from oakemu_rl.checkpoint import load_checkpoint

pytestmark = pytest.mark.slow

PPO_TINY = ["--num-steps", "16", "--num-minibatches", "1", "--update-epochs", "2",
            "--eval-episodes", "0", "--warmup-updates", "1", "--warmup-ramp-updates", "1",
            "--checkpoint-every", "1", "--device", "cpu", "--no-progress", "--lr", "1e-3"]


def _port() -> int:
    with socket.socket() as handle:
        handle.bind(("127.0.0.1", 0))
        return handle.getsockname()[1]


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", OAKEMU_DIST_TIMEOUT="60")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1] / "src"),
                                         env.get("PYTHONPATH", "")])
    return env


def torchrun(nproc: int, *command: str, nnodes: int = 1, port: int | None = None,
             timeout: float = 180, wait: bool = True):
    """`torchrun -m oakemu_rl COMMAND` on this machine; the finished process, or the
    running one with `wait=False`."""
    args = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
            f"--nnodes={nnodes}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port or _port()}", "-m", "oakemu_rl", *command]
    if not wait:
        return subprocess.Popen(args, env=_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    return subprocess.run(args, env=_env(), capture_output=True, text=True, timeout=timeout)


def oakemu(*command: str, env: dict[str, str] | None = None, timeout: float = 120):
    return subprocess.run([sys.executable, "-m", "oakemu_rl", *command], env=env or _env(),
                          capture_output=True, text=True, timeout=timeout)


def digest(state: dict[str, torch.Tensor]) -> str:
    """sha256 over the sorted tensors' names and bytes, as the stages record it per rank."""
    h = hashlib.sha256()
    for name, tensor in sorted(state.items()):
        h.update(name.encode())
        h.update(tensor.contiguous().numpy().tobytes())
    return h.hexdigest()


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("Error:")]


@pytest.fixture(scope="module")
def demos(tmp_path_factory) -> Path:
    return record_scripted(tmp_path_factory.mktemp("demos") / "demos.h5", episodes=3,
                           max_steps=100, style="follow")


@pytest.fixture(scope="module")
def start(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("start") / "start.pt", stage="calibrate",
                            seed=3)


def test_two_ranks_train_one_model_with_identical_weights_on_every_rank(
        demos: Path, start: Path, tmp_path: Path) -> None:
    bc = torchrun(2, "bootstrap", "bc", str(demos), "--run-dir", str(tmp_path / "bc"),
                  "--epochs", "2", "--architecture", "tiny", "--batch-size", "32",
                  "--val-fraction", "0.34", "--device", "cpu", "--no-progress")
    assert bc.returncode == 0, bc.stdout + bc.stderr
    cloned = load_checkpoint(tmp_path / "bc" / "bc.pt")
    ranks = cloned.extra["rank_weight_sha256"]
    assert cloned.extra["world_size"] == 2 and len(ranks) == 2
    assert ranks[0] == ranks[1] == digest(cloned.state_dict)

    ppo = torchrun(2, "finetune", "ppo", "--checkpoint", str(start), "--run-dir",
                   str(tmp_path / "ppo"), "--num-envs", "2", "--total-steps", "192", *PPO_TINY)
    assert ppo.returncode == 0, ppo.stdout + ppo.stderr
    for name in ("ppo.pt", "ppo_last.pt"):
        final = load_checkpoint(tmp_path / "ppo" / name)
        ranks = final.extra["rank_weight_sha256"]
        assert len(ranks) == 2 and ranks[0] == ranks[1] == digest(final.state_dict), name
    # global batch: 2 ranks x 2 envs x 16 steps = 64 steps an update
    assert final.steps["ppo/updates"] == 3 and final.steps["ppo/global_step"] == 192
    assert ppo.stdout.count("wrote ") == 1  # rank 0 alone reports (and writes)


def test_two_ranks_of_e_envs_train_as_one_process_of_2e_envs(start: Path,
                                                             tmp_path: Path) -> None:
    """Tolerance: 1e-5 on every parameter, and 1e-4 relative (or 1e-6 absolute) on each
    update's losses, over 3 updates: the same sums in another order differ by about 1e-7.
    In fp32: a bf16 trunk rounds at about 1e-3, differently for other batch sizes."""
    fp32 = ["--precision", "fp32"]
    two = torchrun(2, "finetune", "ppo", "--checkpoint", str(start), "--run-dir",
                   str(tmp_path / "two"), "--num-envs", "2", "--total-steps", "192", *PPO_TINY,
                   *fp32)
    assert two.returncode == 0, two.stdout + two.stderr
    one = oakemu("finetune", "ppo", "--checkpoint", str(start), "--run-dir",
                 str(tmp_path / "one"), "--num-envs", "4", "--total-steps", "192", *PPO_TINY,
                 *fp32)
    assert one.returncode == 0, one.stdout + one.stderr
    a = load_checkpoint(tmp_path / "one" / "ppo.pt").state_dict
    b = load_checkpoint(tmp_path / "two" / "ppo.pt").state_dict
    start_state = load_checkpoint(start).state_dict
    assert any(not torch.equal(a[k], start_state[k]) for k in a)  # it did train
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=0)

    def losses(run: str) -> list[tuple[float, float]]:
        records = [json.loads(line) for line in (tmp_path / run / "ppo_metrics.jsonl").open()]
        return [(r["losses/value_loss"], r["losses/entropy"]) for r in records
                if "losses/value_loss" in r]

    assert len(losses("one")) == 3
    for x, y in zip(losses("one"), losses("two"), strict=True):
        assert x == pytest.approx(y, rel=1e-4, abs=1e-6)


def test_two_nodes_on_one_machine_write_one_checkpoint(start: Path, tmp_path: Path) -> None:
    port = _port()
    run_dir = tmp_path / "run"
    nodes = [torchrun(1, "finetune", "ppo", "--checkpoint", str(start), "--run-dir",
                      str(run_dir), "--num-envs", "2", "--total-steps", "128", *PPO_TINY,
                      nnodes=2, port=port, wait=False) for _ in range(2)]
    outputs = [node.communicate(timeout=180)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    assert sorted(p.name for p in run_dir.glob("ppo*.pt")) == ["ppo.pt", "ppo_last.pt"]
    final = load_checkpoint(run_dir / "ppo.pt")
    assert final.extra["world_size"] == 2
    assert len(set(final.extra["rank_weight_sha256"])) == 1
    assert sum(output.count("wrote ") for output in outputs) == 1


def _rank_pids(launcher: int) -> dict[int, int]:
    """rank → pid of the workers a torchrun process started."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            parent = int((entry / "stat").read_text().split(") ")[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if parent != launcher:
            continue
        for item in environ:
            if item.startswith(b"RANK="):
                found[int(item[5:])] = int(entry.name)
    return found


def test_a_killed_rank_ends_the_run_in_bounded_time_and_resume_continues(
        start: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    common = ["finetune", "ppo", "--checkpoint", str(start), "--run-dir", str(run_dir),
              "--num-envs", "2", "--total-steps", str(64 * 200), *PPO_TINY]
    launcher = torchrun(2, *common, wait=False)
    last = run_dir / "ppo_last.pt"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (
            last.exists() and load_checkpoint(last).steps["ppo/updates"] >= 2):
        time.sleep(0.2)
    pids = _rank_pids(launcher.pid)
    assert 1 in pids, "rank 1 was not found"
    os.kill(pids[1], signal.SIGKILL)
    killed = time.monotonic()
    output = launcher.communicate(timeout=120)[0]
    assert time.monotonic() - killed < 90
    assert launcher.returncode != 0
    # rank 0 says why it stopped, in one line (torchrun stopped it, or it lost its peer)
    said = error_lines(output)
    assert len(said) == 1 and said[0].startswith("Error: rank 0 of 2 "), output
    saved = load_checkpoint(last)  # the last checkpoint is whole
    done = saved.steps["ppo/updates"]
    assert 2 <= done < 200, output

    resumed = torchrun(2, *common, "--resume")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    final = load_checkpoint(run_dir / "ppo.pt")
    assert final.steps["ppo/updates"] == 200 and final.steps["ppo/global_step"] == 64 * 200
    records = [json.loads(line) for line in (run_dir / "ppo_metrics.jsonl").open()]
    updates = [r["charts/update"] for r in records if "charts/update" in r]
    assert updates == sorted(updates) and updates[-1] == 200


def test_bad_set_ups_end_in_one_line(demos: Path, start: Path, tmp_path: Path) -> None:
    odd = torchrun(2, "bootstrap", "bc", str(demos), "--run-dir", str(tmp_path / "bc"),
                   "--epochs", "1", "--architecture", "tiny", "--batch-size", "33",
                   "--device", "cpu", "--no-progress", timeout=120)
    assert odd.returncode != 0
    lines = error_lines(odd.stdout + odd.stderr)
    assert lines and "batch_size=33 does not divide evenly over 2 ranks" in lines[0]

    env = _env() | {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}
    env.pop("MASTER_ADDR", None)
    alone = oakemu("finetune", "ppo", "--checkpoint", str(start), "--run-dir",
                   str(tmp_path / "alone"), "--num-envs", "2", "--total-steps", "64",
                   *PPO_TINY, env=env, timeout=60)
    assert alone.returncode != 0
    assert error_lines(alone.stderr) == [
        "Error: WORLD_SIZE=2 is set but MASTER_ADDR is not: start the stage with torchrun "
        "(it sets the rendezvous address)"]

    # A run written by 1 process is not resumed by 2: the ranks set the batch.
    first = oakemu("finetune", "ppo", "--checkpoint", str(start), "--run-dir",
                   str(tmp_path / "one"), "--num-envs", "2", "--total-steps", "128", *PPO_TINY)
    assert first.returncode == 0, first.stderr
    again = torchrun(2, "finetune", "ppo", "--checkpoint", str(start), "--run-dir",
                     str(tmp_path / "one"), "--num-envs", "2", "--total-steps", "128",
                     *PPO_TINY, "--resume", timeout=120)
    assert again.returncode != 0
    lines = error_lines(again.stdout + again.stderr)
    assert lines and "written by a run on 1 rank(s), and this one has 2" in lines[0]
