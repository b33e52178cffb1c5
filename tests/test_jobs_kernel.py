"""A detached job outlives the kernel that submitted it; a new kernel running the same cell
attaches to it and gets its weights (real kernels, through jupyter_client)."""

import os

import psutil
import pytest
import torch
from test_jobs import no_leftovers  # noqa: F401 (a fixture)
from torch import nn

from gpunb import Trainer

pytest.importorskip("submitit")
jupyter_client = pytest.importorskip("jupyter_client")

OPTIONS = "--detach --max-steps 60 --batch-size 16 --log-every 4 --accelerator cpu --name outlives --quiet"
CELL = """import torch
from torch import nn
g = torch.Generator().manual_seed(0)
x = torch.randn(128, 10, generator=g)
y = (x @ torch.randn(10, 3, generator=g)).argmax(1)
train_data = (x, y)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3))
loss_fn = nn.CrossEntropyLoss()"""
REPORT = "print(gputrain_result.status, gputrain_result.job['attached'], sum(p.double().sum().item() for p in model.parameters()).hex())"


def kernel(env):
    from jupyter_client.manager import start_new_kernel

    return start_new_kernel(kernel_name="python3", env=env)


def run(client, code, timeout=180):
    out = []

    def hook(message):
        if message["msg_type"] == "stream":
            out.append(message["content"]["text"])
        elif message["msg_type"] == "error":
            out.append("\n".join(message["content"]["traceback"]))

    reply = client.execute_interactive(code, timeout=timeout, output_hook=hook)
    assert reply["content"]["status"] == "ok", "".join(out)
    return "".join(out)


def attached_in_a_new_kernel(env, cell):
    """The same cell run in a new kernel: it attaches to its job and waits for the end; the report's words."""
    manager, client = kernel(env)
    try:
        run(client, "%load_ext gpunb")
        run(client, f"%%gputrain {OPTIONS}\n{cell}")
        return run(client, REPORT).split()
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def expected_checksum():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 10, generator=g)
    y = (x @ torch.randn(10, 3, generator=g)).argmax(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3))
    Trainer(max_steps=60, batch_size=16, log_every=4, accelerator="cpu", track=False).fit(
        model, (x, y), loss_fn=nn.CrossEntropyLoss())
    return sum(p.double().sum().item() for p in model.parameters()).hex()


def test_a_detached_job_outlives_its_kernel_and_a_new_kernel_gets_its_weights(gpunb_home):
    env = {**os.environ, "GPUNB_HOME": str(gpunb_home), "GPUNB_DASHBOARD": "text"}
    manager, client = kernel(env)
    try:
        run(client, "%load_ext gpunb")
        run(client, f"%%gputrain {OPTIONS} --no-wait\n{CELL}")
        folder = run(client, "print(gputrain_result.job['folder'])").strip()
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    controller = int(open(os.path.join(folder, "job.json")).read().split('"job_id": "')[1].split('"')[0])
    assert psutil.pid_exists(controller), "the job died with the kernel"
    status, attached, checksum = attached_in_a_new_kernel(env, CELL)
    assert (status, attached) == ("completed", "True")
    assert checksum == expected_checksum()
    assert len(os.listdir(gpunb_home / "jobs")) == 1  # attached, not submitted again


# The job's loss waits, from its 12th call on, while the test's hold file exists (and says so once
# with the held file): the job is mid-run for as long as the test needs, whatever the machine's load.
HELD_CELL = CELL.replace("loss_fn = nn.CrossEntropyLoss()", """import os, time
class HeldLoss(nn.CrossEntropyLoss):
    calls = 0
    def forward(self, output, target):
        self.calls += 1
        while self.calls > 12 and os.path.exists(os.environ["HOLD"]):
            open(os.environ["HELD"], "a").close()
            time.sleep(0.05)
        return super().forward(output, target)
loss_fn = HeldLoss()""")
HELD_OPTIONS = OPTIONS.replace(" --quiet", "")


def wait_for(predicate, what, timeout=180):
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"waited {timeout} s for {what}"
        time.sleep(0.1)


def wait_for_output(client, text, timeout=180):
    """Read the kernel's output until `text` is in a stream or a display (the cell runs on)."""
    import queue
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            message = client.get_iopub_msg(timeout=1)
        except queue.Empty:
            continue
        content = message["content"]
        shown = content.get("text", "") + str(content.get("data", {}).get("text/plain", ""))
        if text in shown:
            return
    raise AssertionError(f"the kernel did not show {text!r} in {timeout} s")


def held_job(tmp_path, gpunb_home):
    hold, held = tmp_path / "hold", tmp_path / "held"
    hold.touch()
    env = {**os.environ, "GPUNB_HOME": str(gpunb_home), "GPUNB_DASHBOARD": "text", "HOLD": str(hold),
           "HELD": str(held)}
    return env, hold, held


def job_folder(gpunb_home):
    folders = os.listdir(gpunb_home / "jobs")
    assert len(folders) == 1, folders  # attached, never submitted again
    return gpunb_home / "jobs" / folders[0]


def restarted_client(manager):
    client = manager.client()
    client.start_channels()
    client.wait_for_ready(timeout=120)
    return client


def test_restarting_or_shutting_down_the_kernel_leaves_the_job_running(tmp_path, gpunb_home):
    """As JupyterLab's Restart and Shut Down do it: jupyter_client interrupts the kernel, then asks it
    to shut down. Neither may stop the job that the kernel's cell follows."""
    import json

    env, hold, held = held_job(tmp_path, gpunb_home)
    manager, client = kernel(env)
    try:
        run(client, "%load_ext gpunb")
        client.execute(f"%%gputrain {HELD_OPTIONS}\n{HELD_CELL}")  # submits, and follows the job
        wait_for(held.exists, "the job to train its first steps")
        client.stop_channels()
        manager.restart_kernel()  # SIGINT, shutdown_request, then a new kernel
        client = restarted_client(manager)
        folder = job_folder(gpunb_home)
        assert not (folder / "stop").exists(), "the restart asked the job to stop"
        run(client, "%load_ext gpunb")
        client.execute(f"%%gputrain {HELD_OPTIONS}\n{HELD_CELL}")  # the same cell attaches and follows
        wait_for_output(client, "Attached to")
        client.stop_channels()
        manager.shutdown_kernel()  # SIGINT, shutdown_request, the kernel leaves
        assert not (folder / "stop").exists(), "the shutdown asked the job to stop"
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    hold.unlink()
    status, attached, checksum = attached_in_a_new_kernel(env, HELD_CELL)
    assert (status, attached) == ("completed", "True")
    assert checksum == expected_checksum()
    with open(folder / "events.jsonl") as handle:
        events = [json.loads(line) for line in handle]
    kinds = [event["event"] for event in events]
    assert kinds.count("job_started") == 1 and kinds[-1] == "job_done"
    assert events[-1]["step"] == 60 and events[-1]["stop_reason"] is None
    assert job_folder(gpunb_home) == folder


def test_the_kernels_interrupt_stops_the_job_after_its_grace(tmp_path, gpunb_home):
    """The interrupt button alone (no shutdown after it): the job stops at its next step, with its
    weights; the reason says who asked."""
    env, hold, held = held_job(tmp_path, gpunb_home)
    manager, client = kernel(env)
    try:
        run(client, "%load_ext gpunb")
        reply = client.execute(f"%%gputrain {OPTIONS}\n{HELD_CELL}")
        wait_for(held.exists, "the job to train its first steps")
        manager.interrupt_kernel()
        folder = job_folder(gpunb_home)
        wait_for(lambda: (folder / "stop").exists(), "the stop file", timeout=60)
        hold.unlink()
        assert client.get_shell_msg(timeout=180)["parent_header"]["msg_id"] == reply
        report = run(client, "r = gputrain_result; print(r.status, r.steps, repr(r.stop_reason), "
                             "r.checkpoint_path is not None)")
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    status, steps, *reason, saved = report.split()
    assert status == "stopped" and 0 < int(steps) < 60 and saved == "True"
    assert " ".join(reason) == "'stopped from the notebook'"
