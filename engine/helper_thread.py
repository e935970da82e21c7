"""The engine's second thread for splitting work in two from Python: the matmul policy's numpy products and the
attention's halves (the C kernels have their own worker, kernel_worker.c)."""

from __future__ import annotations

import queue
import threading

import numpy as np

from .kernels import name_this_thread


class HelperThread:
    """A second thread that runs one half of a job while the caller runs the other (both release the GIL)."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="tokenloop-matmul", daemon=True).start()

    def _run(self) -> None:
        name_this_thread("tokenloop-mm")
        while True:
            job = self._jobs.get()
            try:
                job()
                self._done.put(None)
            except BaseException as exc:  # noqa: BLE001 - handed back to the caller
                self._done.put(exc)

    def split(self, mine, theirs) -> None:
        """Run `theirs` on the helper thread and `mine` here; returns when both are done."""
        self._jobs.put(theirs)
        try:
            mine()
        finally:
            error = self._done.get()
        if error is not None:
            raise error

    def matmul(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        """x @ w.T with the rows of w (the output features) halved: each thread reads half the weight."""
        out = np.empty((x.shape[0], w.shape[0]), dtype=np.result_type(x, w))
        half = w.shape[0] // 2
        # each half writes a column block of `out` in place
        self.split(lambda: np.matmul(x, w[:half].T, out=out[:, :half]),
                   lambda: np.matmul(x, w[half:].T, out=out[:, half:]))
        return out
