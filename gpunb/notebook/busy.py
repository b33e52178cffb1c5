"""Keep the kernel's "Busy" status true while a %%gputrain cell trains.

JupyterLab (4.4 and later, with ipykernel 7) sends comms over a kernel subshell: when
the first widget of a comm target appears, it asks the kernel on the control channel to
create one (and to delete it when the last widget closes). ipykernel wraps each control
request in a busy/idle status pair of its own, and JupyterLab takes the kernel's status
from the newest status message, whatever request it belongs to: the dashboard's first
widget turns the status bar to "Idle" while the cell still runs. A plain cell with no
widgets stays "Busy".

So, while a run is live, every idle that the kernel publishes for a control request is
followed at once by a busy for the execute request that is still running. The idle that
ends the cell is untouched, and nothing is re-published once the run is over.
"""

from __future__ import annotations

import contextlib
import threading


@contextlib.contextmanager
def kernel_stays_busy(shell):
    """While the block runs, answer each control-channel idle with a busy for this cell."""
    kernel = getattr(shell, "kernel", None)
    publish = getattr(kernel, "_publish_status", None)
    get_parent = getattr(kernel, "get_parent", None)
    if publish is None or get_parent is None:  # not ipykernel (terminal IPython, tests)
        yield
        return
    cell_request = get_parent("shell")  # the execute request running this cell
    lock = threading.Lock()  # control requests are handled on the control thread
    live = True

    def publish_status(status, channel, parent=None):
        publish(status, channel, parent)
        if status == "idle" and channel == "control":
            with lock:
                if live:
                    publish("busy", "shell", cell_request)

    kernel._publish_status = publish_status  # an instance attribute: shadows the method
    try:
        yield
    finally:
        with lock:  # a busy being sent is out before the cell's own idle can follow
            live = False
        if kernel.__dict__.get("_publish_status") is publish_status:
            del kernel._publish_status
