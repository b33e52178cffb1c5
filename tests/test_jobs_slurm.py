"""A run as a Slurm job on the local cluster of .ci/slurm (the `slurm_cluster` fixture; these tests
skip with its reason where Slurm cannot start): two nodes train the kernel's weights bit for bit,
a requeue or a preemption signal resumes exactly, a cancel is reported as one."""

import json
import os
import sys
import time

import cloudpickle
import pytest
import torch
from conftest import mlp
from test_jobs import (SETTINGS, Watch, assert_resumed_from_the_newest_checkpoint, data, in_kernel,  # noqa: F401
                       no_leftovers, weights_equal)
from torch import nn

import gpunb
from gpunb import Trainer
from gpunb.runs import Registry

pytestmark = pytest.mark.slurm

# The jobs import nothing from the tests (pytest's sys.path is not theirs): SlowLoss travels by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def slurm(cluster, **overrides):
    """A Slurm run's settings: the test cluster's partition, a limit above submitit's 10 minutes."""
    return {**SETTINGS, "cluster": "slurm", "slurm": {"partition": cluster.partition, "time": "30"}, **overrides}


def test_a_two_node_job_trains_the_weights_of_two_processes_in_the_kernel(slurm_cluster):
    watch = Watch()
    model = mlp()
    result = Trainer(**slurm(slurm_cluster, nodes=2, max_steps=12, name="two-nodes")).fit(
        model, data(), loss_fn=SlowLoss(), callbacks=[watch])
    assert result.status == "completed" and result.world_size == 2 and len(result.per_rank) == 2
    assert weights_equal(model, in_kernel(devices=2, max_steps=12))
    assert any(not done for _, done, _ in watch.rows), "every row came after the job had finished"
    assert "PENDING" in [job["state"] for job in watch.jobs] or "RUNNING" in [job["state"] for job in watch.jobs]
    slurm_cluster.wait_for_state(result.job["id"], "COMPLETED", timeout=30)  # sacct learns of the end a moment later
    run = Registry().get_run(result.job["run_id"])
    assert run["status"] == "completed" and run["job"]["cluster"] == "slurm" and run["job"]["nodes"] == 2


class At:
    """Runs `action(job)` once, at the first log row at or after `step`."""

    def __init__(self, step, action):
        self.step, self.action, self.job, self.done = step, action, None, False

    def on_job_state(self, state, job):
        self.job = job

    def on_log(self, state, row):
        if row["step"] >= self.step and not self.done:
            self.done = True
            self.action(self.job)


def events_of(result):
    with open(os.path.join(result.job["folder"], "events.jsonl")) as handle:
        return [json.loads(line)["event"] for line in handle]


@pytest.mark.parametrize("how", ["scancel --signal=USR1", "scontrol requeue"])
def test_a_preempted_or_requeued_job_resumes_exactly(slurm_cluster, how):
    def interrupt(job):
        if how == "scontrol requeue":
            slurm_cluster.run(["scontrol", "requeue", job["id"]])
        else:
            slurm_cluster.run(["scancel", "--signal=USR1", job["id"]])

    watch = Watch()
    model = mlp()
    # Slow steps (a sleep in the loss) keep the job running while the signal travels.
    result = Trainer(**slurm(slurm_cluster, max_steps=60, checkpoint_every=4, name="requeued")).fit(
        model, data(), loss_fn=SlowLoss(), callbacks=[At(8, interrupt), watch])
    assert result.status == "completed" and result.steps == 60
    assert_resumed_from_the_newest_checkpoint(result)  # of those written before the requeue (4, 8, ...)
    kinds = events_of(result)
    assert kinds.count("job_started") == 2
    if how.startswith("scancel"):
        assert kinds.count("requeued") == 1  # the job wrote a checkpoint at the signal and requeued itself
    shown = [step for step, _, _ in watch.rows]
    assert shown == sorted(set(shown)) and shown[-1] == 60  # the dashboard's rows go on, no gap, no repeat
    assert max(b - a for a, b in zip(shown, shown[1:])) <= SETTINGS["log_every"]
    assert weights_equal(model, in_kernel(max_steps=60))


class SlowLoss(nn.CrossEntropyLoss):
    def forward(self, output, target):
        time.sleep(0.1)
        return super().forward(output, target)


def test_a_cancelled_job_is_reported_cancelled(slurm_cluster):
    model = mlp()
    result = Trainer(**slurm(slurm_cluster, max_steps=100_000, checkpoint_every=4, name="scancelled")).fit(
        model, data(), loss_fn=SlowLoss(), callbacks=[At(8, lambda job: slurm_cluster.run(["scancel", job["id"]]))])
    assert result.status == "cancelled" and result.stop_reason == "cancelled"
    slurm_cluster.wait_for_state(result.job["id"], "CANCELLED", timeout=30)
    assert Registry().get_run(result.job["run_id"])["status"] == "cancelled"
    checkpoint = torch.load(result.checkpoint_path, weights_only=True)
    assert all(torch.equal(checkpoint["model"][k], v) for k, v in model.state_dict().items())


def test_a_pending_job_is_listed_with_its_reason(slurm_cluster):
    hold = slurm_cluster.run(["sbatch", "--parsable", "-p", slurm_cluster.partition, "-N2", "--exclusive", "--output=/dev/null",
                              "--wrap", "sleep 60"]).strip()
    try:
        slurm_cluster.wait_for_state(hold, "RUNNING")
        submitted = Trainer(**slurm(slurm_cluster, nodes=2, max_steps=4, name="waiting")).submit(
            mlp(), data(), loss_fn=nn.CrossEntropyLoss())
        deadline = time.monotonic() + 30
        while True:
            waiting = gpunb.attach("waiting", wait=False)
            run = Registry().get_run(submitted.job["run_id"])
            if run["job"].get("reason") or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert waiting.status == "queued" and run["status"] == "queued"
        assert run["job"]["state"] == "PENDING" and run["job"]["reason"] in ("Resources", "Priority")
    finally:
        slurm_cluster.run(["scancel", hold], check=False)
    result = gpunb.attach("waiting")
    assert result.status == "completed" and result.steps == 4
