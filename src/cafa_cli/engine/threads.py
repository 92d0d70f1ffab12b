"""One call at a time into an object that one stream changes (the Adapter): a second thread
gets a one-line error instead of reading weights, optimiser and method state half-changed."""

from __future__ import annotations

import threading
from contextlib import contextmanager

from cafa_cli.core.errors import UsageError


class OneThreadAtATime:
    """A mixin: `with self._one_thread():` around each public call that reads or changes the
    state (every one but those that read shapes only); the class's __init__ calls
    `self._one_thread_only()` first. The thread in a call may call in again (a method's own
    update calls the Adapter's apply() inside its step); another thread may not."""

    def _one_thread_only(self) -> None:
        self._in_use = threading.RLock()

    def __getstate__(self) -> dict:  # copy.deepcopy: a lock cannot be copied, and a copy is free anyway
        return {key: value for key, value in vars(self).items() if key != "_in_use"}

    def __setstate__(self, state: dict) -> None:
        vars(self).update(state)
        self._one_thread_only()

    @contextmanager
    def _one_thread(self):
        """One call at a time: a step changes the weights, the optimiser and the method's
        state, which a second thread's step, features() or reset() would read or change
        half-way (a reset during a step's backward pass broke the step, and left weights
        that were neither the source's nor the step's)."""
        if not self._in_use.acquire(blocking=False):
            raise UsageError(
                "this Adapter is already in a call from another thread; an Adapter adapts one stream: give each "
                "thread its own Adapter (each with its own copy of the model), or serialise the calls with a lock"
            )
        try:
            yield
        finally:
            self._in_use.release()
