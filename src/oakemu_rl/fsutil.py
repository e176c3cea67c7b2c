"""Writing files so that a crash or a kill never leaves one half-written."""

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


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str], mode: str = "wb") -> Iterator[IO]:
    """Open a temporary file beside `path`; on success fsync it and rename it over `path`.

    If the body raises (or the process dies), `path` keeps its previous content and the
    temporary file is removed (or, after a kill, left as an ignorable `.tmp-*` file).
    """
    target = Path(path)
    directory = target.parent if str(target.parent) else Path(".")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.tmp-", dir=directory)
    except OSError as error:
        raise OakEmuError(f"cannot write {target}: {error.strerror or error}") from None
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, mode) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException as error:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(error, OSError):
            raise OakEmuError(f"cannot write {target}: {error.strerror or error}") from None
        raise
    _fsync_dir(directory)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    with atomic_write(path, "w") as handle:
        handle.write(text)
