"""Training on several processes, GPUs or machines: torchrun and torch.distributed.

A stage started by `torchrun` (which sets RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous
address) joins the process group here: gloo on the CPU, NCCL with one GPU per local rank.
Every rank then computes gradients on its own share of the data, and `average_gradients`
all-reduces them before each optimizer step, the averaging DDP does. It is written out
because the stages freeze and unfreeze parameters between updates (PPO's critic-first
warm-up) and call several model methods per step, which DDP's forward hooks do not follow;
a single flattened all-reduce per step costs what DDP's bucketed one does on a model this
size. Rank 0 alone writes files and shows progress.

Without torchrun (no WORLD_SIZE, or 1) everything here is a no-op, and the stages run as
one process.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .errors import ConfigError, OakEmuError

TIMEOUT_ENV = "OAKEMU_DIST_TIMEOUT"
"""Seconds a collective waits for the other ranks before the stage stops (default 300):
long enough for rank 0's evaluation games, short enough that a dead rank ends the run."""


@dataclass(frozen=True)
class World:
    """This process's place among the ranks of one training run."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


SINGLE = World()


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"the environment variable {name}={value!r} is not an integer "
                          "(torchrun sets it; unset it to train in one process)") from None


def world_from_env() -> World:
    """The world torchrun describes in the environment, or a single process."""
    size = _env_int("WORLD_SIZE")
    if size is None or size <= 1:
        return SINGLE
    rank, local = _env_int("RANK"), _env_int("LOCAL_RANK")
    if rank is None or not 0 <= rank < size:
        raise ConfigError(f"WORLD_SIZE={size} is set but RANK is {rank!r}; start the stage "
                          "with torchrun, which sets both")
    return World(rank=rank, world_size=size, local_rank=local or 0)


def init(device: torch.device) -> tuple[World, torch.device]:
    """Join the process group torchrun set up (once per process) and pick this rank's
    device: on CUDA, the GPU of its local rank. Refuses, in one line, a set-up that cannot
    form a group: no rendezvous address, or a rank that does not answer in time."""
    world = world_from_env()
    if not world.enabled:
        return world, device
    if device.type == "cuda":
        if world.local_rank >= torch.cuda.device_count():
            raise ConfigError(f"local rank {world.local_rank} has no GPU of its own "
                              f"({torch.cuda.device_count()} found); start at most that many "
                              "processes per node")
        device = torch.device("cuda", world.local_rank)
        torch.cuda.set_device(device)
    if dist.is_initialized():
        return world, device
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if name not in os.environ:
            raise ConfigError(f"WORLD_SIZE={world.world_size} is set but {name} is not: start "
                              "the stage with torchrun (it sets the rendezvous address)")
    _stop_cleanly_on_sigterm(world)
    backend = "nccl" if device.type == "cuda" else "gloo"
    try:
        dist.init_process_group(backend, rank=world.rank, world_size=world.world_size,
                                timeout=datetime.timedelta(seconds=timeout_seconds()))
    except (RuntimeError, ValueError, dist.DistError) as error:
        raise OakEmuError(f"rank {world.rank} of {world.world_size} could not join the other "
                          f"ranks at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}: "
                          f"{_first_line(error)}") from None
    return world, device


class Stopped(OakEmuError):
    """This rank was told to stop (SIGTERM): torchrun stops every rank once one fails, and a
    cluster's scheduler does the same to a cancelled or preempted job."""


def _stop_cleanly_on_sigterm(world: World) -> None:
    """Turn torchrun's SIGTERM into one line and a non-zero exit instead of a silent death,
    so a rank that outlives a dead one says why it stopped. Only ranks of a multi-process
    run (started by torchrun, in their own processes) install it."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return

    def stop(_signum: int, _frame: Any) -> None:
        raise Stopped(f"rank {world.rank} of {world.world_size} was stopped (SIGTERM: another "
                      "rank failed, or the job was cancelled); continue from the last "
                      "checkpoint with the same command and --resume")

    signal.signal(signal.SIGTERM, stop)


def timeout_seconds() -> float:
    value = os.environ.get(TIMEOUT_ENV, "300")
    try:
        seconds = float(value)
    except ValueError:
        raise ConfigError(f"{TIMEOUT_ENV}={value!r} is not a number of seconds") from None
    if not seconds > 0:
        raise ConfigError(f"{TIMEOUT_ENV}={value!r} must be a positive number of seconds")
    return seconds


def _first_line(error: BaseException) -> str:
    """The gist of a backend's error: its first sentence of the first line."""
    text = str(error).strip()
    if not text:
        return type(error).__name__
    line = text.splitlines()[0]
    return line.split(". This is typically")[0][:300]


def lost_peer(world: World, error: BaseException, kept: str) -> OakEmuError:
    """The one line a rank ends with when a collective fails: another rank died or hung."""
    return OakEmuError(f"rank {world.rank} of {world.world_size} lost contact with the other "
                       f"ranks (one died or stopped answering: {_first_line(error)}); {kept}")


def collective_failures() -> tuple[type[BaseException], ...]:
    """The exceptions a collective raises when a peer is gone."""
    return (RuntimeError, dist.DistError)


def average_gradients(world: World, parameters: list[torch.nn.Parameter]) -> None:
    """Replace each gradient by its mean over the ranks (one flattened all-reduce). Every
    rank passes the same parameters in the same order, those with a gradient this step."""
    if not world.enabled:
        return
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world.world_size
    offset = 0
    for grad in grads:
        count = grad.numel()
        grad.copy_(flat[offset:offset + count].view_as(grad))
        offset += count


def sum_over_ranks(world: World, values: torch.Tensor) -> torch.Tensor:
    """Element-wise sum of a (small) tensor over the ranks; the tensor itself without them."""
    if not world.enabled:
        return values
    total = values.clone()
    dist.all_reduce(total)
    return total


def broadcast_model(world: World, module: torch.nn.Module) -> None:
    """Give every rank rank 0's parameters and buffers (they start identical)."""
    if not world.enabled:
        return
    for tensor in [*module.parameters(), *module.buffers()]:
        dist.broadcast(tensor.data, src=0)


def gather_objects(world: World, value: Any) -> list[Any]:
    """Every rank's `value`, in rank order (small picklable values only)."""
    if not world.enabled:
        return [value]
    out: list[Any] = [None] * world.world_size
    dist.all_gather_object(out, value)
    return out


def weight_digests(world: World, module: torch.nn.Module) -> list[str]:
    """Each rank's sha256 of its weights, in rank order: checkpoints carry them, so a file
    shows that every rank held the same model when it was written."""
    import hashlib

    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return gather_objects(world, digest.hexdigest())


def barrier(world: World) -> None:
    if world.enabled:
        dist.barrier()


def close(world: World) -> None:
    """Leave the process group (a no-op alone)."""
    if world.enabled and dist.is_initialized():
        dist.destroy_process_group()
