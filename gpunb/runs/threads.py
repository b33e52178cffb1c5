"""The writers' threads, kept between runs: a fit hands its run's writing to a thread that waits
for work, so that it does not wait for a new thread to start (`Thread.start` returns only once
the new thread runs, which on a loaded machine can take a scheduler's slice of several ms).

A thread with no run to write waits KEEP_S for the next one, then ends. Daemon threads, as the
writers were: a writer's own exit hook sees that a run's end is not cut off at exit.
"""

from __future__ import annotations

import functools
import os
import queue
import threading
from collections.abc import Callable

KEEP_S = 60.0  # a thread with no run to write waits this long for the next one

_idle: list[queue.SimpleQueue] = []  # the inboxes of the threads waiting for work
_lock = threading.Lock()


def run_in_thread(work: Callable[[], None], name: str) -> None:
    """Run `work` on a waiting thread, named `name` while it runs, or on a new one."""
    _forget_in_forked_children()
    with _lock:
        inbox = _idle.pop() if _idle else None
    if inbox is None:
        inbox = queue.SimpleQueue()
        threading.Thread(target=_serve, args=(inbox,), name=name, daemon=True).start()
    inbox.put((work, name))


def _serve(inbox: queue.SimpleQueue) -> None:
    task = inbox.get()
    while True:
        work, threading.current_thread().name = task
        work()
        del work, task  # the writer's last reference from here: it may now be collected
        with _lock:
            _idle.append(inbox)
        try:
            task = inbox.get(timeout=KEEP_S)
        except queue.Empty:
            with _lock:
                if inbox in _idle:  # nobody took this thread meanwhile
                    _idle.remove(inbox)
                    return
            task = inbox.get()  # taken just now: its work is on the way


@functools.cache
def _forget_in_forked_children() -> None:
    # A forked child has none of these threads (and maybe a lock held by one of them).
    os.register_at_fork(after_in_child=_reset)


def _reset() -> None:
    global _lock
    _idle.clear()
    _lock = threading.Lock()
