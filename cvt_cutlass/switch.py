"""A process-wide on / off setting that code sets, or an environment variable decides; a
per-thread value that a block sets."""

from __future__ import annotations

import contextlib
import os
import threading


class Switch:
    """``switch()`` is the value given to ``switch.set(value)``; after ``set(None)`` (the start) it
    is the environment variable ``env``: unset or empty, ``default``; off for "0", "false" or
    "False"; on otherwise."""

    def __init__(self, env: str, default: bool = True):
        self.env, self.default = env, default
        self.value: bool | None = None

    def set(self, value: bool | None) -> None:
        self.value = value

    def __call__(self) -> bool:
        if self.value is not None:
            return self.value
        raw = os.environ.get(self.env, "")
        return self.default if raw == "" else raw not in ("0", "false", "False")

    @contextlib.contextmanager
    def using(self, value: bool | None):
        """``set(value)`` inside the block, the setting before it restored after."""
        was = self.value
        self.value = value
        try:
            yield
        finally:
            self.value = was


class ThreadValue:
    """``get()`` is the value of the innermost ``using(value)`` block open in this thread, or
    ``default`` outside any."""

    def __init__(self, default=None):
        self.default = default
        self._local = threading.local()

    def get(self):
        return getattr(self._local, "value", self.default)

    @contextlib.contextmanager
    def using(self, value):
        """``value`` inside the block (yielded), the thread's value before it restored after."""
        was = self.get()
        self._local.value = value
        try:
            yield value
        finally:
            self._local.value = was
