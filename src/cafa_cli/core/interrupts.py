"""Ctrl-C and SIGTERM end a run, but never in the middle of an adaptation step: a state
saved on the way out (`cafa adapt --state`) is then the state after a whole batch. A
second signal while one waits ends the run at once (a step that never ends stays
interruptible)."""

from __future__ import annotations

import signal
from contextlib import contextmanager

_waiting: list[int] = []  # signals received during a step, raised when it ends
_depth = [0]  # steps under way (nested `whole()` blocks)


def interrupt(signum: int) -> None:
    """The signal handler's part: raise now, or once the step under way is whole."""
    if _depth[0] and not _waiting:
        _waiting.append(signum)
        return
    _waiting.clear()
    raise KeyboardInterrupt(signal.Signals(signum).name)


@contextmanager
def whole():
    """A block (an adaptation step) that a signal does not cut in two."""
    _depth[0] += 1
    try:
        yield
    finally:
        _depth[0] -= 1
        if not _depth[0] and _waiting:
            interrupt(_waiting.pop())
