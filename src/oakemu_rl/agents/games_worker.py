"""One process of `play.run_in_processes`: `python -m oakemu_rl.agents.games_worker`.

It reads one pickled job on stdin (the parent's import path, the "module:function" to run,
its pickled arguments and this process's share of the games), runs the function on one
thread, and writes pickled messages on stdout: ("game", worker, ...) for each report the
function makes (a game's score and length when `play_games` deals the games, a recorded
game's steps when `record` does), then ("done", worker), or ("error", worker, exception)
for what stopped it. Anything else the process prints goes to stderr, so it cannot corrupt
the messages. The parent keeps stdin open while it listens: its end of file, however the
parent ended, ends this process.
"""

from __future__ import annotations

import importlib
import os
import pickle
import signal
import sys
import threading
from typing import Any


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent ends its processes
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stray prints (emulator banners) go to stderr, not into the messages
    worker = -1

    def send(message: tuple[Any, ...]) -> None:
        pickle.dump(message, out)
        out.flush()

    try:
        path, target, blob, share = pickle.load(sys.stdin.buffer)
        threading.Thread(target=_end_with_parent, daemon=True).start()
        sys.path[:] = path  # where the parent found the agent's classes
        worker = share.start

        import cv2
        import torch

        # One thread each, set before the agents are rebuilt (an engine takes torch's
        # count); the frame resizing's own pool ignores OMP_NUM_THREADS.
        torch.set_num_threads(1)
        cv2.setNumThreads(1)
        module, name = target.split(":")
        function = getattr(importlib.import_module(module), name)
        function(*pickle.loads(blob), share, lambda *message: send(("game", worker, *message)))
        send(("done", worker))
    except BaseException as error:  # every error goes to the parent
        send(("error", worker, _sendable(error)))


def _end_with_parent() -> None:
    """Wait for the end of stdin (the parent closed it or is gone), then end at once. It
    reads the file descriptor itself: a thread blocked inside sys.stdin's buffer would
    hold its lock while the interpreter shuts down."""
    while os.read(0, 65536):
        pass
    os._exit(1)


def _sendable(error: BaseException) -> BaseException:
    """`error` itself when it survives pickling, else an `OakEmuError` saying what it was."""
    from ..errors import OakEmuError

    try:
        pickle.loads(pickle.dumps(error))
    except Exception:  # whatever fails, it cannot travel as it is
        return OakEmuError(f"{type(error).__name__}: {error}")
    return error


if __name__ == "__main__":
    main()
