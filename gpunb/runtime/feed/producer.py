"""Items prepared in a thread of their own, a bounded number ahead of the loop that uses them.

On a GPU a small model's step is bound by the host: the GPU waits on the Python that
launches its kernels. Preparing the next batch (gathering it, transforming it) on a side
stream hides the preparation's GPU time but not the host's time launching it, which the
step then waits for. A thread launches it instead, while the loop launches the step:
torch releases the GIL inside each op, so the two overlap: a run with device transforms
waits for data several times less than with the preparation in the loop's thread
(benchmarks/RESULTS.md, "Data wait with GPU augmentation").

The thread is DataLoader's pin-memory thread in shape: a bounded queue between it and
the loop, errors raised in the loop where the batch was due, and a stop that ends it
whenever the loop stops early (a finished fit, an interrupt, an error).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from typing import Callable, ContextManager, Iterable, Iterator

_END = object()
_POLL_S = 0.05  # how often a producer that is ahead checks whether it was stopped


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


class Producer:
    """`prepare(item)` for each item, in a thread, at most `ahead` items beyond the one in use.

    Iterate it in the consuming thread; `close()` stops the thread and waits for it (the
    item it was preparing is finished first). `within()` is entered once in the thread
    around all the preparations (a CUDA stream, say: the current stream is per thread).
    """

    def __init__(self, items: Iterable, prepare: Callable, ahead: int = 1,
                 within: Callable[[], ContextManager] = contextlib.nullcontext, name: str = "gpunb-producer"):
        self._queue = queue.Queue(maxsize=ahead)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(items, prepare, within), name=name, daemon=True)
        self._thread.start()

    def _run(self, items, prepare, within) -> None:
        try:
            with within():
                for item in items:
                    if not self._put(prepare(item)):
                        return
        except BaseException as error:  # noqa: BLE001 - raised again in the consuming thread
            self._put(_Failed(error))
            return
        self._put(_END)

    def _put(self, entry) -> bool:
        """Queue `entry` once there is room; False when stopped first."""
        while not self._stopping.is_set():
            try:
                self._queue.put(entry, timeout=_POLL_S)
                return True
            except queue.Full:
                pass
        return False

    def __iter__(self) -> Iterator:
        while True:
            entry = self._queue.get()
            if entry is _END:
                return
            if isinstance(entry, _Failed):
                raise entry.error
            yield entry

    def close(self) -> None:
        self._stopping.set()
        self._thread.join()
        while not self._queue.empty():  # what it prepared for nobody: let it go now
            self._queue.get_nowait()
