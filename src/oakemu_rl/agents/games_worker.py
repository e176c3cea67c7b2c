"""One process of `play_games` with several workers: `python -m oakemu_rl.agents.games_worker`.

It reads one pickled job on stdin (the parent's import path, the pickled agent, the spec,
the config, its games and the parent's pid), plays its games with the agent on one thread,
and writes pickled messages on stdout: ("game", worker, episode, score, length) as each
game ends, then ("done", worker), or ("error", worker, exception) for what stopped it.
Anything else the process prints goes to stderr, so it cannot corrupt the messages.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
from typing import Any


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent ends its processes
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stray prints (emulator banners) go to stderr, not into the messages
    path, blob, spec, config, episodes, parent = pickle.load(sys.stdin.buffer)
    sys.path[:] = path  # where the parent found the agent's classes
    worker = episodes.start

    def send(message: tuple[Any, ...]) -> None:
        if os.getppid() != parent:  # the parent is gone: nobody reads the scores
            os._exit(1)
        pickle.dump(message, out)
        out.flush()

    try:
        import torch

        from .play import _play_here

        torch.set_num_threads(1)  # before the agent is rebuilt: its engine takes this count
        _play_here(pickle.loads(blob), spec, config, episodes,
                   lambda episode, score, length: send(("game", worker, episode, score,
                                                        length)))
        send(("done", worker))
    except BaseException as error:  # every error goes to the parent
        send(("error", worker, _sendable(error)))


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
