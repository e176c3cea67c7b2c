"""Where and how a stage computes: the device, the arithmetic precision, the seed range,
the usable CPUs.

The lowest layer beside `errors`: every stage resolves `--device` and `--precision` here,
so the rules are written once.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

import torch

from .errors import ConfigError

SEED_MAX = 2**30 - 1
"""Largest seed an option takes: the emulators add episode, env and update numbers to it,
and ALE seeds are 32-bit."""


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity where the system tells it, capped by
    a container's CPU quota (cgroup `cpu.max` or `cpu.cfs_quota_us`), so a container given
    2 CPUs on a large host starts 2 game processes, not one per host CPU."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    return max(1, min(cpus, math.ceil(quota))) if quota else cpus


def cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup"),
                     membership: Path = Path("/proc/self/cgroup")) -> float | None:
    """The CPUs' worth of time this process's cgroup may use (quota / period; the smallest
    where several folders set one), or None where no quota is set or the system does not
    say. Reads cgroup v2 (`cpu.max` in the process's group, each group above it, and the
    root) and v1 (`cpu.cfs_quota_us` and `cpu.cfs_period_us` in the `cpu` controller's
    group, each group above it, and its root): a quota set on a parent group (a slice
    holding the container) binds the groups inside it too."""
    try:
        groups = membership.read_text().splitlines()
    except OSError:
        groups = []
    places: list[tuple[Path, bool]] = []  # (folder, v2)
    for line in groups:
        if line.count(":") < 2:
            continue
        _, controllers, path = line.split(":", 2)
        parts = PurePosixPath("/" + path.lstrip("/")).parts[1:]
        chain = [Path(*parts[:k]) for k in range(len(parts), 0, -1)]  # the group, then up
        if controllers == "":
            places += [(root / rel, True) for rel in chain]
        elif "cpu" in controllers.split(","):
            mount = root / controllers
            places += [(base / rel, False) for rel in chain for base in (mount, root / "cpu")]
    places += [(root, True), (root / "cpu", False), (root / "cpu,cpuacct", False)]
    quotas = [q for folder, v2 in places if (q := _read_quota(folder, v2))]
    return min(quotas) if quotas else None


def _read_quota(folder: Path, v2: bool) -> float | None:
    """quota / period from one cgroup folder; None where it holds no such file or sets no
    quota ("max" in v2, -1 in v1)."""
    try:
        if v2:
            quota, _, period = (folder / "cpu.max").read_text().strip().partition(" ")
        else:
            quota = (folder / "cpu.cfs_quota_us").read_text().strip()
            period = (folder / "cpu.cfs_period_us").read_text().strip()
        quota_us, period_us = float(quota), float(period or 100_000)
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def resolve_device(name: str = "auto") -> torch.device:
    """`auto` picks CUDA when present, else CPU; otherwise cpu, cuda or cuda:N."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ConfigError(f"unknown --device {name!r}; use auto, cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but no CUDA GPU is available")
    if device.type == "cuda" and device.index is not None \
            and device.index >= torch.cuda.device_count():
        raise ConfigError(f"--device {name} names a GPU this machine does not have "
                          f"({torch.cuda.device_count()} found)")
    return device


PRECISIONS = ("auto", "fp32", "bf16")


def autocast_dtype(precision: str, device: torch.device, *,
                   native_cpu: bool = False) -> torch.dtype | None:
    """The autocast dtype for `--precision` (None: plain fp32). `bf16` insists on it.
    `auto` takes bf16 on a CUDA GPU that supports it, and on the CPU only where the caller
    asks for it (`native_cpu`) and the CPU does bf16 arithmetic itself (`cpu_has_bf16`):
    PPO does, as its bf16 trunk trained more steps per second to scores within the fp32
    runs' (docs/results.md, "bf16 trunk in PPO"); BC does not, as bf16 autocast bought it more
    samples per second but no lower validation loss per minute ("bf16 autocast")."""
    if precision not in PRECISIONS:
        raise ConfigError(f"unknown --precision {precision!r}; use one of {', '.join(PRECISIONS)}")
    if precision == "fp32":
        return None
    gpu_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    if precision == "auto":
        cpu_bf16 = device.type == "cpu" and native_cpu and cpu_has_bf16()
        return torch.bfloat16 if gpu_bf16 or cpu_bf16 else None
    if device.type == "cuda" and not gpu_bf16:
        raise ConfigError("--precision bf16 was asked for but this GPU has no bfloat16 support")
    return torch.bfloat16


def precision_used(dtype: torch.dtype | None) -> str:
    """The name a checkpoint and a stage's output give `autocast_dtype`'s answer."""
    return "fp32" if dtype is None else "bf16"


def cpu_has_bf16(cpuinfo: str | None = None) -> bool:
    """Whether the CPU has bf16 arithmetic instructions (AVX512-BF16 or AMX-BF16), from the
    flags in /proc/cpuinfo (or `cpuinfo`, its text); False where the system does not say.
    Elsewhere bf16 autocast is emulated, and slower than fp32."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    flags = {word for line in cpuinfo.splitlines() if line.startswith("flags")
             for word in line.partition(":")[2].split()}
    return bool(flags & {"avx512_bf16", "amx_bf16"})


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """Run the block with `threads` torch CPU threads (0: leave torch's default), and
    restore the caller's count after it."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
