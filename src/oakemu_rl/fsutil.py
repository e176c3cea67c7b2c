"""Writing files so that a crash or a kill never leaves one half-written.

Every artifact (checkpoints, demo files, videos, reports) is written to a temporary file
beside its target, fsynced, and renamed over the target: a reader sees the old file or
the new one, never a mix.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from .errors import OakEmuError


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):  # some filesystems cannot fsync a directory
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _cannot_write(target: Path, error: OSError) -> OakEmuError:
    return OakEmuError(f"cannot write {target}: {error.strerror or error}")


def temp_beside(target: str | os.PathLike[str], suffix: str = "") -> Path:
    """An empty temporary file `.NAME.tmp-*SUFFIX` in `target`'s folder (created if needed),
    with the permissions a plain `open()` would give (mkstemp's are private)."""
    target = Path(target)
    directory = target.parent if str(target.parent) else Path(".")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{target.name}.tmp-", suffix=suffix, dir=directory)
    except OSError as error:
        raise _cannot_write(target, error) from None
    umask = os.umask(0)
    os.umask(umask)
    with contextlib.suppress(OSError):
        os.fchmod(fd, 0o666 & ~umask)
    os.close(fd)
    return Path(name)


def commit(tmp: Path, target: str | os.PathLike[str]) -> None:
    """fsync `tmp` and rename it over `target`; on failure remove `tmp` and raise."""
    target = Path(target)
    try:
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except OSError as error:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise _cannot_write(target, error) from None
    _fsync_dir(target.parent if str(target.parent) else Path("."))


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str], mode: str = "wb") -> Iterator[IO]:
    """Open a temporary file beside `path`; when the body succeeds, commit it over `path`.

    If the body raises, `path` keeps its previous content and the temporary file is
    removed; after a kill it is left as an ignorable `.NAME.tmp-*` file.
    """
    target = Path(path)
    tmp = temp_beside(target)
    try:
        with open(tmp, mode) as handle:
            yield handle
    except BaseException as error:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(error, OSError):
            raise _cannot_write(target, error) from None
        raise
    commit(tmp, target)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    with atomic_write(path, "w") as handle:
        handle.write(text)


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB blocks."""
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
