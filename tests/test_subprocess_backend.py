"""A job backend added from outside gpunb runs jobs end to end: tests/subprocess_backend.py, one
file that registers itself on import, starts each task as a plain subprocess. Its two tasks form
the torch.distributed group from its TaskEnvironment's torchrun variables, rank 0's events reach
the kernel while the job trains, the weights come back into the kernel's model, and its requeue
resumes exactly. Nothing in gpunb/ names it."""

import json
import os
from pathlib import Path

import pytest
import subprocess_backend
from conftest import mlp
from test_jobs import (SETTINGS, PreemptOnce, SlowLoss, Watch, assert_resumed_from_the_newest_checkpoint,  # noqa: F401
                       data, in_kernel, no_leftovers, weights_equal)
from torch import nn

from gpunb import Trainer
from gpunb.runs import Registry

pytest.importorskip("psutil")
PACKAGE = Path(__file__).resolve().parent.parent / "gpunb"


def events(result) -> list:
    with open(os.path.join(result.job["folder"], "events.jsonl")) as handle:
        return [json.loads(line) for line in handle]


def test_a_backend_in_one_file_runs_a_two_task_job_and_brings_the_weights_back():
    watch = Watch()
    model = mlp()
    # SlowLoss (the same numbers, 50 ms a step) keeps the job training while its rows arrive.
    result = Trainer(**SETTINGS, cluster="subprocess", devices=2, max_steps=16, name="plain").fit(
        model, data(), loss_fn=SlowLoss(), callbacks=[watch])
    assert result.status == "completed" and result.steps == 16
    assert result.world_size == 2 and sorted(timing["rank"] for timing in result.per_rank) == [0, 1]
    assert weights_equal(model, in_kernel(devices=2, max_steps=16))  # the group trained as two launched ranks do
    steps = [step for step, _, _ in watch.rows]
    assert steps == sorted(steps) and steps[-1] == 16
    assert any(not done for _, done, _ in watch.rows), "every row came after the job had finished"
    started = [line for line in events(result) if line["event"] == "job_started"]
    assert len(started) == 1 and started[0]["world_size"] == 2 and started[0]["job_id"] == result.job["id"]
    run = Registry().get_run(result.job["run_id"])
    assert (run["status"], run["job"]["cluster"], run["step"]) == ("completed", "subprocess", 16)


def test_the_backends_requeue_resumes_exactly(tmp_path):
    model = mlp()
    hook = model.register_forward_pre_hook(PreemptOnce(12, tmp_path / "preempted"))  # SIGUSR2, once
    result = Trainer(**SETTINGS, cluster="subprocess", max_steps=40, name="requeued").fit(
        model, data(), loss_fn=nn.CrossEntropyLoss())
    hook.remove()
    assert (tmp_path / "preempted").exists() and result.status == "completed" and result.steps == 40
    kinds = [line["event"] for line in events(result)]
    assert kinds.count("job_started") == 2 and kinds.count("requeued") == 1
    assert_resumed_from_the_newest_checkpoint(result)
    assert weights_equal(model, in_kernel(max_steps=40))


def test_nothing_in_gpunb_names_the_backend():
    assert subprocess_backend.SubprocessBackend.__module__ == "subprocess_backend"
    named = [path for path in PACKAGE.rglob("*.py") if "subprocess_backend" in path.read_text()
             or "SubprocessBackend" in path.read_text() or '"subprocess"' in path.read_text()]
    assert not named, named
