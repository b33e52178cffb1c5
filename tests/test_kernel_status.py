"""The kernel stays "Busy" for as long as a %%gputrain cell runs, dashboard and all.

JupyterLab takes a kernel's status from the newest iopub status message of any request,
and it sends a control request (create a comms subshell) as soon as the dashboard's first
widget appears. A real kernel is driven here the way JupyterLab drives it.
"""

import pytest

jupyter_client = pytest.importorskip("jupyter_client")

CELL = """%%gputrain --epochs 3 --batch-size 32 --name busy --no-track {options}
from torch import nn
from gpunb.demo import digits_data, digits_cnn
train_data, val_data = digits_data()
model = digits_cnn()
loss_fn = nn.CrossEntropyLoss()"""


@pytest.fixture(scope="module")
def kernel():
    from jupyter_client.manager import start_new_kernel

    manager, client = start_new_kernel(kernel_name="python3", startup_timeout=120)
    try:
        client.execute_interactive("%load_ext gpunb", timeout=60)
        yield client
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def _run(client, code: str) -> tuple[str, list, str | None]:
    """Execute `code`; at the first widget, send a control request as JupyterLab does.

    Returns the execute request's id, every status message as (state, parent id), and the
    control request's id (None when no widget appeared).
    """
    info = client.kernel_info(reply=True, timeout=30)["content"]
    control_type = ("create_subshell_request" if "kernel subshells" in info.get("supported_features", [])
                    else "kernel_info_request")
    cell_id = client.execute(code)
    statuses, control_id = [], None
    while True:
        message = client.get_iopub_msg(timeout=240)
        parent = message["parent_header"].get("msg_id")
        if message["msg_type"] == "comm_open" and control_id is None:
            request = client.session.msg(control_type, {})
            control_id = request["header"]["msg_id"]
            client.control_channel.send(request)
        elif message["msg_type"] == "status":
            statuses.append((message["content"]["execution_state"], parent))
            if parent == cell_id and statuses[-1][0] == "idle":
                break
    if control_id is not None:  # its reply is in by now: statuses are published before it ends
        client.get_control_msg(timeout=30)
    return cell_id, statuses, control_id


def _shown(statuses: list, upto: int) -> str:
    """What JupyterLab's status bar reads after the first `upto` status messages."""
    return statuses[upto - 1][0]


def test_the_status_stays_busy_while_the_dashboard_trains(kernel):
    cell_id, statuses, control_id = _run(kernel, CELL.format(options=""))
    assert control_id is not None, "the dashboard showed no widget"
    ours = [state for state, parent in statuses if parent == cell_id]
    assert ours[0] == "busy" and ours.count("idle") == 1 and statuses[-1] == ("idle", cell_id)
    # The control request's own idle came while the cell ran; a busy for the cell follows it.
    control_idle = statuses.index(("idle", control_id))
    assert all(_shown(statuses, i) == "busy" for i in range(control_idle + 2, len(statuses))), statuses
    assert statuses[control_idle + 1] == ("busy", cell_id), statuses


def test_after_the_run_a_control_request_gets_no_extra_busy(kernel):
    _run(kernel, CELL.format(options="--quiet"))  # the patch is gone with the run
    request = kernel.session.msg("kernel_info_request", {})
    kernel.control_channel.send(request)
    kernel.get_control_msg(timeout=30)
    seen = []
    while not seen or seen[-1] != ("idle", request["header"]["msg_id"]):
        message = kernel.get_iopub_msg(timeout=30)
        if message["msg_type"] == "status":
            seen.append((message["content"]["execution_state"], message["parent_header"].get("msg_id")))
    assert [state for state, _ in seen] == ["busy", "idle"], seen


def test_a_quiet_run_has_one_busy_and_one_idle(kernel):
    cell_id, statuses, control_id = _run(kernel, CELL.format(options="--quiet"))
    assert control_id is None
    assert [s for s in statuses if s[1] == cell_id] == [("busy", cell_id), ("idle", cell_id)]
