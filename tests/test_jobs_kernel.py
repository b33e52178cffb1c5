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
    manager, client = kernel(env)
    try:
        run(client, "%load_ext gpunb")
        run(client, f"%%gputrain {OPTIONS}\n{CELL}")  # the same cell: it attaches, and waits for the end
        status, attached, checksum = run(client, REPORT).split()
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    assert (status, attached) == ("completed", "True")
    assert checksum == expected_checksum()
    assert len(os.listdir(gpunb_home / "jobs")) == 1  # attached, not submitted again
