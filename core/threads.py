"""OS-level thread names, so that `top -H`, `ps -L` and /proc/*/task/*/comm tell the server's threads apart."""

from __future__ import annotations

import ctypes


def name_this_thread(name: str) -> None:
    """Best effort: the OS-level name of the calling thread (at most 15 bytes are kept)."""
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass
