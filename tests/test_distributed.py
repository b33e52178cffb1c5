"""Multi-process training: 2 CPU processes over gloo, as CI runs it.

Parity with one process and with a hand-written DDP loop, FSDP, both start methods,
failures, interrupts, the torchrun export; and after every test, no child process.
"""

import gc
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import types
import warnings

import psutil
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import classification_data, mlp
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

from gpunb import TrainConfig, Trainer
from gpunb.distributed import launch
from gpunb.errors import GpunbError
from gpunb.notebook.export import export_script
from gpunb.runtime.state.checkpoint_files import list_checkpoints, load_checkpoint

CPU2 = dict(devices=2, accelerator="cpu", track=False)
ATOL = 1e-5  # fp32: gradients averaged in another order


@pytest.fixture(autouse=True)
def no_process_left_behind():
    """Every test ends with no child process; leftovers are killed (and fail the test)."""
    yield
    leftovers = [p for p in psutil.Process().children(recursive=True) if not _helper(p)]
    for process in leftovers:
        process.kill()
    assert not leftovers, f"processes left behind: {leftovers}"


def _helper(process) -> bool:
    """By design, kept for the process's lifetime: multiprocessing's resource tracker (one per
    process that ever used spawn) and torch.compile's pool of compile workers (started at the
    first Inductor compile where Triton is installed, as with a CUDA build of torch)."""
    try:
        commands = [" ".join(p.cmdline()) for p in (process, *process.parents())]  # the pool's workers too
    except psutil.Error:
        return True
    return "resource_tracker" in commands[0] or any("_inductor/compile_worker" in c for c in commands)


def assert_same_weights(a, b, atol=ATOL):
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(x, y, atol=atol, rtol=0, msg=name)


class Recorder:
    """A parent-side callback, as the dashboard is: what it saw, in order."""

    def __init__(self):
        self.events, self.fit_start = [], None

    def on_fit_start(self, state):
        self.events.append("on_fit_start")
        self.fit_start = dict(total_steps=state.total_steps, batch_size=state.config.batch_size,
                              world_size=state.world_size, device=str(state.device), pid=os.getpid())

    def on_log(self, state, metrics):
        self.events.append("on_log")
        assert state.history[-1] == metrics and state.progress == state.step / state.total_steps

    def on_validation_end(self, state, metrics):
        self.events.append("on_validation_end")

    def on_epoch_end(self, state, metrics):
        self.events.append("on_epoch_end")

    def on_checkpoint(self, state, path):
        self.events.append("on_checkpoint")

    def on_fit_end(self, state):
        self.events.append("on_fit_end")
        self.result = state.result


# --------------------------------------------------------------------------- parity


def _handwritten_ddp(rank, port, x, y, batch, path):
    """What a careful user writes with torch alone: DistributedSampler, DDP, AdamW."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.TCPStore("127.0.0.1", port, is_master=False),
                            rank=rank, world_size=2)
    model = nn.parallel.DistributedDataParallel(mlp())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    data = TensorDataset(x, y)
    for xb, yb in DataLoader(data, batch_size=batch, sampler=DistributedSampler(data, shuffle=False)):
        nn.functional.cross_entropy(model(xb), yb).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if rank == 0:
        torch.save(model.module.state_dict(), path)
    # No destroy_process_group(): with Python objects in the thread-local state that this
    # forked process inherited from earlier tests, gloo's teardown can deadlock.


def test_ddp_matches_one_process_and_a_handwritten_ddp_loop(tmp_path):
    x, y = classification_data(n=256)
    one = mlp()
    single = Trainer(batch_size=32, shuffle=False, log_every=2, track=False).fit(
        one, (x, y), loss_fn=nn.CrossEntropyLoss())

    two, recorder = mlp(), Recorder()
    result = Trainer(batch_size=16, shuffle=False, log_every=2, **CPU2).fit(
        two, (x, y), loss_fn=nn.CrossEntropyLoss(), callbacks=[recorder])

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    gc.freeze()  # as gpunb does: forked processes must not finalise earlier tests' garbage
    try:
        mp.start_processes(_handwritten_ddp, args=(store.port, x, y, 16, tmp_path / "by-hand.pt"),
                           nprocs=2, start_method="fork")
    finally:
        gc.unfreeze()
    by_hand = mlp()
    by_hand.load_state_dict(torch.load(tmp_path / "by-hand.pt"))

    assert_same_weights(two, one)
    assert_same_weights(two, by_hand)
    assert [r["loss"] for r in result.history] == pytest.approx([r["loss"] for r in single.history], abs=1e-5)
    assert result.world_size == 2 and result.effective_batch_size == 32
    assert result.steps == 8 and result.samples == 256
    assert [t["rank"] for t in result.per_rank] == [0, 1]
    assert all(t["steps"] == 8 and t["wall_time_s"] >= t["data_wait_s"] >= 0 for t in result.per_rank)
    # The parent's callbacks saw rank 0's run as it went, in this process.
    assert recorder.events == ["on_fit_start"] + ["on_log"] * 4 + ["on_epoch_end", "on_fit_end"]
    assert recorder.fit_start == dict(total_steps=8, batch_size=16, world_size=2, device="cpu", pid=os.getpid())
    assert recorder.result is result


def test_accumulation_a_user_dataloader_and_validation_match_one_process(tmp_path, gpunb_home):
    """grad_accum (DDP's no_sync between micro-batches), a DataLoader re-sharded with its own
    collate_fn kept, validation means over both ranks, and the registry written once, here."""
    x, y = classification_data(n=320)
    train, val = (x[:256], y[:256]), (x[256:], y[256:])

    def doubled(samples):  # the user's collate_fn: must still be used after re-sharding
        xs, ys = zip(*samples)
        return torch.stack(xs) * 2, torch.stack(ys)

    loader = DataLoader(TensorDataset(*train), batch_size=8, shuffle=True, collate_fn=doubled)
    two, recorder = mlp(), Recorder()
    result = Trainer(grad_accum=2, log_every=4, epochs=2, devices=2, accelerator="cpu").fit(
        two, loader, val, loss_fn=nn.CrossEntropyLoss(), callbacks=[recorder])

    # The same samples per step as one process with twice the micro-batch.
    one = mlp()
    single = Trainer(batch_size=16, grad_accum=2, log_every=4, epochs=2, track=False).fit(
        one, (train[0] * 2, train[1]), val, loss_fn=nn.CrossEntropyLoss())
    # ... and as tensors handed to the ranks directly (each rank its shard, same order).
    tensors = mlp()
    Trainer(batch_size=8, grad_accum=2, log_every=4, epochs=2, **CPU2).fit(
        tensors, (train[0] * 2, train[1]), val, loss_fn=nn.CrossEntropyLoss())
    assert_same_weights(two, tensors, atol=1e-6)
    assert_same_weights(two, one)
    assert result.steps == single.steps == 16
    for name in ("val_loss", "val_acc"):
        assert result.final_metrics[name] == pytest.approx(single.final_metrics[name], abs=1e-5)
    assert "on_validation_end" in recorder.events
    from gpunb.runs import Registry

    runs = Registry().list_runs()
    assert [(r["status"], r["pid"]) for r in runs] == [("completed", os.getpid())]


# --------------------------------------------------------------------------- FSDP


def test_fsdp_trains_matches_ddp_and_resumes_from_a_full_checkpoint(tmp_path):
    x, y = classification_data(n=192)
    data, val = (x[:160], y[:160]), (x[160:], y[160:])
    options = dict(batch_size=16, log_every=5, **CPU2)

    def run(strategy, epochs, **more):
        model = mlp()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        result = Trainer(strategy=strategy, epochs=epochs, **options, **more).fit(
            model, data, val, optimizer=optimizer, loss_fn=nn.CrossEntropyLoss())
        return model, optimizer, result

    ddp, _, ddp_result = run("ddp", 3)
    fsdp, fsdp_optimizer, fsdp_result = run("fsdp", 3)
    assert_same_weights(fsdp, ddp)
    assert fsdp_result.run_name == "Sequential" and fsdp_result.steps == 15
    assert fsdp_result.final_metrics["val_loss"] == pytest.approx(ddp_result.final_metrics["val_loss"], abs=1e-5)
    assert type(fsdp[0].weight) is nn.Parameter  # the notebook's model is a plain module again
    assert fsdp_optimizer.state[fsdp[0].weight]["exp_avg"].shape == fsdp[0].weight.shape

    run("fsdp", 2, checkpoint_dir=tmp_path)
    saved = load_checkpoint(list_checkpoints(tmp_path)[-1])
    assert {k: tuple(v.shape) for k, v in saved["model"].items()} == {
        k: tuple(v.shape) for k, v in mlp().state_dict().items()}  # full weights, not shards
    resumed, resumed_optimizer, result = run("fsdp", 3, checkpoint_dir=tmp_path, resume="last")
    assert result.steps == 15 and len(result.epochs) == 3
    assert_same_weights(resumed, fsdp, atol=1e-6)
    torch.testing.assert_close(resumed_optimizer.state_dict()["state"], fsdp_optimizer.state_dict()["state"],
                               atol=1e-6, rtol=0)


def test_fsdp_fp16_skips_a_step_on_every_rank_when_one_shard_overflows():
    x, y = classification_data(n=256)
    x[37] = float("inf")  # in rank 1's share of the third step only
    model = mlp()
    result = Trainer(batch_size=16, shuffle=False, strategy="fsdp", precision="16-mixed", detect_nan=False,
                     **CPU2).fit(model, (x, y), loss_fn=nn.CrossEntropyLoss())
    assert result.skipped_steps == 1 and [t["steps"] for t in result.per_rank] == [8, 8]
    assert all(torch.isfinite(p).all() for p in model.parameters())


class ShardProbe(nn.Module):
    """1.03 MiB of weights; its buffer notes whether it trained sharded (FSDP2 renames the class)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(10, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 3))
        self.register_buffer("sharded", torch.zeros(()))

    def forward(self, x):
        if self.training:
            self.sharded.fill_(float(type(self).__name__.startswith("FSDP")))
        return self.body(x)


def test_auto_shards_a_run_that_fits_only_sharded_and_says_why():
    data = classification_data(n=128)

    def run(budget):
        model = ShardProbe()
        result = Trainer(batch_size=16, memory_budget=budget, **CPU2).fit(model, data, loss_fn=nn.CrossEntropyLoss())
        return model, result

    # weights, gradients and AdamW's two states: 4.2 MiB whole on each device, over 0.9 x 3 MiB; half each sharded
    sharded, result = run("3MiB")
    assert sharded.sharded.item() == 1.0 and result.steps == 4 and type(sharded.body[0].weight) is nn.Parameter
    assert result.strategy == "fsdp" and result.config["strategy"] == "fsdp"
    assert re.fullmatch(r"DDP needs 4\.\d MiB per device of 3\.0 MiB; sharded: 2\.\d MiB", result.strategy_reason)
    assert f"  strategy: fsdp — {result.strategy_reason}\n  plan: FSDP sharding over 2 devices" in repr(result)
    assert result.summary.strategy == f"strategy: fsdp — {result.strategy_reason}"
    # a budget DDP fits: DDP as before, and the same training
    replicated, result = run("64MiB")
    assert replicated.sharded.item() == 0.0 and result.strategy == "ddp" and "strategy:" not in repr(result)
    assert result.strategy_reason == "auto: the whole model fits on each device"
    assert_same_weights(sharded.body, replicated.body)


def test_auto_sharded_fp16_skips_a_step_on_every_rank_when_one_shard_overflows():
    # the precision was built for DDP before the plan sharded (its rebuild: test_memory_plan.py)
    x, y = classification_data(n=256)
    x[37] = float("inf")  # in rank 1's share of the third step only
    model = ShardProbe()
    result = Trainer(batch_size=16, shuffle=False, precision="16-mixed", detect_nan=False, memory_budget="3MiB",
                     **CPU2).fit(model, (x, y), loss_fn=nn.CrossEntropyLoss())
    assert result.strategy == "fsdp" and model.sharded.item() == 1.0
    assert result.skipped_steps == 1 and [t["steps"] for t in result.per_rank] == [8, 8]
    assert all(torch.isfinite(p).all() for p in model.parameters())


# --------------------------------------------------------------------------- start methods

CELL = '''
import torch
from torch import nn


class CellNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3))

    def forward(self, x):
        return self.body(x)


def cell_loss(output, target):
    return nn.functional.cross_entropy(output, target)
'''


def test_spawn_ships_a_notebook_class_by_value_and_matches_fork(monkeypatch):
    # A module made at run time, like a notebook cell: a spawned process cannot import it.
    cell = types.ModuleType("notebook_cell_7")
    exec(CELL, cell.__dict__)
    monkeypatch.setitem(sys.modules, "notebook_cell_7", cell)
    x, y = classification_data(n=128)

    def train():
        model = cell.CellNet()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        Trainer(batch_size=16, log_every=4, **CPU2).fit(model, (x, y), optimizer=optimizer,
                                                        loss_fn=cell.cell_loss)
        return model, optimizer

    forked, forked_optimizer = train()
    methods = []
    real_start = mp.start_processes
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # as after any CUDA use
    monkeypatch.setattr(mp, "start_processes",
                        lambda *a, **k: methods.append(k["start_method"]) or real_start(*a, **k))
    spawned, spawned_optimizer = train()

    assert methods == ["spawn"]
    assert_same_weights(spawned, forked, atol=1e-6)
    torch.testing.assert_close(spawned_optimizer.state_dict(), forked_optimizer.state_dict())


@pytest.mark.cuda
def test_spawn_after_the_kernel_used_cuda_brings_the_weights_back_and_leaves_no_process(monkeypatch):
    """As in a notebook that already used the GPU: CUDA is initialised in this process (for real,
    not faked), so the launcher spawns the ranks. Two processes on the first GPU over gloo (NCCL
    takes one GPU per process); the notebook's model lives on the GPU and gets the trained weights
    back there, equal to one process's training on the same GPU."""
    torch.ones(1, device="cuda")  # the kernel's earlier GPU work
    assert torch.cuda.is_initialized()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # one GPU, seen by the ranks as by this process
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    x, y = classification_data(n=256)
    # SGD: a gradient that differs in the last bits (TF32, another summation order) moves a
    # weight by as little; AdamW's normalised step could move a near-zero gradient's weight by lr.
    settings = dict(shuffle=False, log_every=2, track=False, accelerator="cuda", precision="32", compile=False)
    reference = mlp().cuda()
    Trainer(batch_size=32, **settings).fit(reference, (x, y), loss_fn=nn.CrossEntropyLoss(),
                                           optimizer=torch.optim.SGD(reference.parameters(), lr=0.1))
    methods = []
    real_start = mp.start_processes
    monkeypatch.setattr(mp, "start_processes",
                        lambda *a, **k: methods.append(k["start_method"]) or real_start(*a, **k))
    model = mlp().cuda()
    result = Trainer(batch_size=16, devices=2, backend="gloo", **settings).fit(
        model, (x, y), loss_fn=nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))

    assert methods == ["spawn"]
    assert result.world_size == 2 and result.steps == 8
    assert [rank["device"] for rank in result.per_rank] == ["cuda:0", "cuda:0"]
    assert all(p.is_cuda for p in model.parameters())  # loaded into the notebook's model, where it lives
    assert_same_weights(model, reference, atol=1e-4)
    assert not [p for p in psutil.Process().children(recursive=True) if not _helper(p)]


class StreamDataset(Dataset):
    def __init__(self):
        self.source = (i for i in range(10))

    def __len__(self):
        return 10

    def __getitem__(self, i):
        return torch.zeros(10), 0


def test_what_cannot_be_shipped_is_named(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(GpunbError, match=r"`train_data` holds a generator \(at `train_data.source`\)"
                                         r"(.|\n)*HINT: .*spawn"):
        Trainer(batch_size=2, **CPU2).fit(mlp(), StreamDataset(), loss_fn=nn.CrossEntropyLoss())


# --------------------------------------------------------------------------- failures and stops


def _fails_on_rank_1(model, batch):
    x, y = batch
    if dist.get_rank() == 1 and model.training and _fails_on_rank_1.calls >= 2:
        if _fails_on_rank_1.marker is not None:  # when it failed, on the clock all processes share
            _fails_on_rank_1.marker.write_text(repr(time.monotonic()))
        raise ValueError("boom on rank 1")
    _fails_on_rank_1.calls += 1
    return nn.functional.cross_entropy(model(x), y)


_fails_on_rank_1.calls, _fails_on_rank_1.marker = 0, None


def test_a_failing_rank_stops_all_and_raises_its_traceback_here(tmp_path, monkeypatch):
    x, y = classification_data(n=512)
    monkeypatch.setattr(_fails_on_rank_1, "marker", tmp_path / "failed-at", raising=False)
    with pytest.raises(launch.RankFailed) as raised:
        Trainer(batch_size=16, log_every=1, **CPU2).fit(mlp(), (x, y), step=_fails_on_rank_1)
    # A hang-type bound from the failure on (the ranks' start, slow on a busy machine, does not
    # count): rank 0 never waits out the gradients' all-reduce that rank 1 will not join.
    assert time.monotonic() - float((tmp_path / "failed-at").read_text()) < 10
    message = str(raised.value)
    assert message.startswith("Rank 1 of 2 failed: ValueError: boom on rank 1")
    assert "Traceback on rank 1" in message and "_fails_on_rank_1" in message
    assert raised.value.rank == 1

    # A mistake of the user's keeps gpunb's own explanation and hint.
    with pytest.raises(GpunbError, match=r"(?s)not a scalar loss.*HINT: reduce it"):
        Trainer(batch_size=16, **CPU2).fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss(reduction="none"))

    # ... and the next run in the same process works.
    result = Trainer(batch_size=16, max_steps=3, **CPU2).fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss())
    assert result.steps == 3


class InterruptAt:
    """Presses the kernel's stop button (SIGINT to this process) once `step` is logged."""

    def __init__(self, step):
        self.step, self.sent = step, None

    def on_log(self, state, metrics):
        if self.sent is None and state.step >= self.step:
            self.sent = time.monotonic()
            os.kill(os.getpid(), signal.SIGINT)


class StopAt:
    def __init__(self, step):
        self.step = step

    def on_log(self, state, metrics):
        if state.step >= self.step:
            state.request_stop("stopped from the dashboard")


def test_an_interrupt_stops_all_ranks_at_one_step_and_keeps_the_weights():
    x, y = classification_data(n=4096)
    model, interrupt = mlp(), InterruptAt(step=4)
    result = Trainer(batch_size=16, log_every=2, epochs=5, **CPU2).fit(
        model, (x, y), loss_fn=nn.CrossEntropyLoss(), callbacks=[interrupt])
    assert time.monotonic() - interrupt.sent < 5
    assert result.interrupted and result.stop_reason == "interrupted"
    assert 4 <= result.steps < 640 and [t["steps"] for t in result.per_rank] == [result.steps] * 2
    # The notebook's model holds the weights of exactly that step.
    reference = mlp()
    Trainer(batch_size=32, max_steps=result.steps, track=False).fit(reference, (x, y), loss_fn=nn.CrossEntropyLoss())
    assert_same_weights(model, reference)

    # A stop asked for by a callback here (the dashboard's button) works the same way.
    stopped = Trainer(batch_size=16, log_every=2, epochs=5, **CPU2).fit(
        mlp(), (x, y), loss_fn=nn.CrossEntropyLoss(), callbacks=[StopAt(4)])
    assert stopped.stop_reason == "stopped from the dashboard" and not stopped.interrupted
    assert 4 <= stopped.steps < 640


def _slow(model, batch):
    time.sleep(0.2)
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


class InterruptOnceTraining:
    """Presses the kernel's stop button (SIGINT to this process) `delay` s after rank 0 began to train."""

    def __init__(self, delay):
        self.delay, self.sent = delay, None

    def on_fit_start(self, state):
        threading.Timer(self.delay, self._press).start()

    def _press(self):
        self.sent = time.monotonic()
        os.kill(os.getpid(), signal.SIGINT)


def test_ranks_that_do_not_reach_a_log_interval_are_terminated_after_the_interrupt():
    x, y = classification_data(n=4096)  # 128 steps of 0.2 s: no log interval, no epoch end
    model, interrupt = mlp(), InterruptOnceTraining(delay=0.5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = Trainer(batch_size=16, log_every=1000, **CPU2).fit(model, (x, y), step=_slow,
                                                                    callbacks=[interrupt])
    took = time.monotonic() - interrupt.sent
    assert result.interrupted and any("did not stop within" in str(w.message) for w in caught)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    # The ranks had their grace period, and were terminated right after it (a hang-type bound,
    # from the interrupt on, so that a slow start of the ranks does not count).
    assert launch.INTERRUPT_GRACE_S <= took < launch.INTERRUPT_GRACE_S + launch.FAILURE_GRACE_S + 5


SPAWN_INTERRUPTED_WHILE_STARTING = """
import json, os, signal, threading, time, warnings
import psutil, torch
from torch import nn
from conftest import classification_data, mlp
from gpunb import Trainer
from gpunb.distributed import launch

torch.cuda.is_initialized = lambda: True  # as after any CUDA use in the kernel: the ranks are spawned
# A kernel answers Ctrl-C, also when these tests run in the background (which ignores SIGINT);
# the ranks, spawned from here, then start answering it too.
signal.signal(signal.SIGINT, signal.default_int_handler)
sent = []
real_start = launch.mp.start_processes

def press_stop():  # the kernel's stop button signals the kernel's whole process group
    sent.append(time.monotonic())
    os.killpg(os.getpgrp(), signal.SIGINT)

def start_then_interrupt(*args, **kwargs):
    threading.Timer(0.5, press_stop).start()  # the ranks are still starting (importing torch)
    return real_start(*args, **kwargs)

def slow_step(model, batch):
    time.sleep(0.2)
    return nn.functional.cross_entropy(model(batch[0]), batch[1])

launch.mp.start_processes = start_then_interrupt
x, y = classification_data(n=4096)
model = mlp()
before = [p.detach().clone() for p in model.parameters()]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    result = Trainer(batch_size=16, log_every=1000, devices=2, accelerator="cpu", track=False).fit(
        model, (x, y), step=slow_step)
took = time.monotonic() - sent[0]
left = [p.pid for p in psutil.Process().children(recursive=True) if "resource_tracker" not in " ".join(p.cmdline())]
print(json.dumps({"took": took, "interrupted": result.interrupted, "steps": result.steps, "left": left,
                  "unchanged": all(torch.equal(a, b) for a, b in zip(before, model.parameters())),
                  "warnings": [str(w.message) for w in caught]}))
"""


def test_an_interrupt_while_spawned_ranks_start_returns_at_once_and_leaves_no_process(tmp_path):
    """The kernel's Ctrl-C reaches its whole process group, and so spawned ranks that have not yet
    left it: they die while starting. The launch used to stay blocked writing the pickled
    arguments into a dead rank's pipe until a second Ctrl-C. Run in a session of its own, so
    that the SIGINT to the group reaches only that script and its ranks."""
    tests = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join([os.path.dirname(tests), tests, os.environ.get("PYTHONPATH", "")])
    script = subprocess.Popen([sys.executable, "-c", SPAWN_INTERRUPTED_WHILE_STARTING], cwd=tmp_path,
                              env={**os.environ, "PYTHONPATH": path}, start_new_session=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = script.communicate(timeout=180)  # ample for a loaded machine; the hang never ended
    finally:
        if script.poll() is None:
            os.killpg(script.pid, signal.SIGKILL)
            script.wait()
    assert script.returncode == 0, err[-3000:]
    report = json.loads(out.strip().splitlines()[-1])
    assert report["interrupted"] and report["steps"] == 0 and report["unchanged"] and report["left"] == []
    assert any("while the ranks were starting, so they were stopped at once" in w for w in report["warnings"])
    # It did not wait out the grace period meant for ranks that are training (a hang-type bound).
    assert report["took"] < launch.INTERRUPT_GRACE_S


# --------------------------------------------------------------------------- the launcher's entry


def _entry_that_names_its_context(config, context, model, train_data, val_data=None, **fit):
    """What each rank runs: the runtime's loop, under a name that says which context it got."""
    from gpunb.runtime import run

    result = run(config, context, model, train_data, val_data, **fit)
    result.run_name = f"{type(context).__name__} {context.rank}/{context.world_size}"
    return result


def test_the_launcher_runs_the_entry_it_is_given_with_each_ranks_context():
    heard = Recorder()
    x, y = classification_data(n=64)
    model = mlp()
    result = launch.fit(TrainConfig(batch_size=16, log_every=2, **CPU2), _entry_that_names_its_context,
                        model, (x, y), loss_fn=nn.CrossEntropyLoss(), callbacks=[heard])
    assert result.run_name == "ProcessGroupRank 0/2"  # rank 0's result, from the entry
    assert result.world_size == 2 and result.steps == 2 and len(result.per_rank) == 2
    assert "on_fit_end" in heard.events  # the caller's callbacks run here


# --------------------------------------------------------------------------- devices and torchrun


def test_devices_all_on_cpu_is_one_process_and_too_many_gpus_is_an_error(monkeypatch):
    assert not launch.needs_processes(TrainConfig(devices="all", accelerator="cpu"))
    assert launch.plan_devices(TrainConfig(devices=3, accelerator="cpu")) == ("cpu", 3, "gloo")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert launch.plan_devices(TrainConfig(devices="all")) == ("cuda", 2, "nccl")
    with pytest.raises(GpunbError, match="asks for 4 GPUs, but 2 are visible"):
        launch.plan_devices(TrainConfig(devices=4, accelerator="cuda"))
    with pytest.raises(GpunbError, match="batch_size='auto' is not available with strategy='fsdp'"):
        Trainer(devices=2, accelerator="cpu", strategy="fsdp", batch_size="auto").fit(mlp(), classification_data())


def test_gloo_may_put_several_processes_on_one_gpu_and_nccl_may_not(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for backend in ("auto", "nccl"):
        with pytest.raises(GpunbError, match=r"asks for 2 GPUs, but 1 is visible(.|\n)*HINT: (.|\n)*"
                                             r"`backend='gloo'` runs 2 processes on this GPU"):
            launch.plan_devices(TrainConfig(devices=2, backend=backend))
    assert launch.plan_devices(TrainConfig(devices=2, backend="gloo")) == ("cuda", 2, "gloo")
    assert launch.plan_devices(TrainConfig(devices="all", backend="gloo")) == ("cuda", 1, "gloo")


def test_nccl_without_a_gpu_is_refused_before_any_process_starts(monkeypatch):
    import gpunb.runtime.device

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(gpunb.runtime.device, "mps_available", lambda: False)
    monkeypatch.setattr(mp, "start_processes", lambda *a, **k: pytest.fail("a process was started"))
    with pytest.raises(GpunbError, match=r"backend='nccl' connects CUDA GPUs, and this run has none "
                                         r"(.|\n)*HINT: use `backend='gloo'`"):
        Trainer(devices=2, backend="nccl", track=False).fit(mlp(), classification_data(),
                                                             loss_fn=nn.CrossEntropyLoss())
    with pytest.raises(GpunbError, match="backend='nccl' connects CUDA GPUs, and accelerator='cpu'"):
        TrainConfig(accelerator="cpu", backend="nccl")
    with pytest.raises(GpunbError, match=r"Unknown backend 'mpi'(.|\n)*`auto`, `nccl` or `gloo`"):
        TrainConfig(backend="mpi")


def test_a_torchrun_group_is_joined_with_the_backend_asked_for(monkeypatch):
    from gpunb.distributed.context import join_torchrun_group

    joined = []
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kwargs: joined.append(backend))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name, value in dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT="29500").items():
        monkeypatch.setenv(name, value)
    join_torchrun_group(TrainConfig())
    join_torchrun_group(TrainConfig(backend="gloo"))
    with pytest.raises(GpunbError, match="backend='nccl' connects CUDA GPUs"):
        join_torchrun_group(TrainConfig(backend="nccl"))
    assert joined == ["gloo", "gloo"]


NOTEBOOK = [
    "import torch\nfrom torch import nn\n%matplotlib inline",
    "%load_ext gpunb",
    "torch.manual_seed(0)\nx = torch.randn(256, 10)\ny = (x[:, 0] > 0).long()\nprint(x.shape)",
    CELL,
    "%%bash\necho not python",
    "step = 5  # a stray variable that is not a step function",
    ("%%gputrain --devices 2 --accelerator cpu --batch-size 16\n"
     "model = CellNet()\ntrain_data = (x, y)\nloss_fn = cell_loss\n"),
]


class FakeShell:
    """What export_script reads from IPython: the history and the user namespace."""

    def __init__(self, cells):
        from gpunb.notebook.export import _python_of

        self.user_ns = {"__name__": "__main__"}
        for cell in cells:
            exec(_python_of(cell) or "", self.user_ns)
        self.history_manager = types.SimpleNamespace(input_hist_raw=[""] + cells)


def test_the_exported_script_runs_under_torchrun_and_matches_the_notebook_run(tmp_path):
    shell = FakeShell(NOTEBOOK)
    config = TrainConfig(batch_size=16, log_every=4, **CPU2)
    script = export_script(tmp_path / "train.py", NOTEBOOK[-1], config, shell,
                           options_line="--devices 2 --accelerator cpu --batch-size 16")
    text = script.read_text()
    assert "torch.manual_seed(0)" in text and "class CellNet" in text and "print(x.shape)" not in text
    assert "echo" not in text and "step = 5" not in text and "%" not in text.replace("%%gputrain", "")

    notebook_model = shell.user_ns["model"]
    Trainer(config).fit(notebook_model, shell.user_ns["train_data"], loss_fn=shell.user_ns["loss_fn"])

    torchrun = [shutil.which("torchrun")] if shutil.which("torchrun") else [sys.executable, "-m",
                                                                          "torch.distributed.run"]
    completed = subprocess.run([*torchrun, "--standalone", "--nproc-per-node", "2", script.name],
                               cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "TrainResult('CellNet': completed" in completed.stdout
    exported = torch.load(tmp_path / "train.weights.pt", weights_only=True)
    for name, value in notebook_model.state_dict().items():
        torch.testing.assert_close(exported[name], value, atol=1e-6, rtol=0, msg=name)


def test_export_follows_the_magic_names_and_says_what_it_cannot_find(tmp_path):
    cells = [
        "import torch\nimport numpy as np\nfrom torch import nn",
        "from gpunb.runtime.step.objective import accuracy as acc",
        ("torch.manual_seed(3)\nfeatures = torch.randn(64, 10)\nfeatures /= features.std()\n"
         "labels = torch.zeros(64, dtype=torch.long)"),
        "net = nn.Linear(10, 2)\nnet.requires_grad_(True)\nplt_like = print",
        ("%%gputrain --model net --epochs 2\ntrain_data = (features, labels)\nmetrics = {'acc': acc}\n"
         "loss_fn = nn.CrossEntropyLoss(weight=class_weights)"),
    ]
    shell = FakeShell(cells[:4])
    shell.user_ns["class_weights"] = torch.ones(2)  # made by code the history does not show
    with pytest.warns(RuntimeWarning, match="define class_weights"):
        script = export_script(tmp_path / "run.py", cells[-1], TrainConfig(epochs=2), shell,
                               names={"model": "net"}, options_line="--model net --epochs 2")
    text = script.read_text()
    assert "define them here: class_weights" in text
    assert "features /= features.std()" in text and "net.requires_grad_(True)" in text
    assert "from gpunb.runtime.step.objective import accuracy as acc" in text and "numpy" not in text
    assert ".fit(net, train_data, loss_fn=loss_fn, metrics=metrics)" in text
    assert "TrainConfig(epochs=2)" in text and "save_weights(net," in text
    compile(text, "run.py", "exec")
    with pytest.raises(GpunbError, match="defines no `model`"):
        export_script(tmp_path / "x.py", "train_data = (features, labels)", TrainConfig(), FakeShell([]))


class ListeningSockets:
    """A step that, on rank 0's first training step (the group is formed then: every rank has
    its gloo listener, and the other rank waits for rank 0 at the gradients' all-reduce), writes
    every listening TCP socket of the launching process and of its ranks into `path`."""

    def __init__(self, path):
        self.path = path

    def __call__(self, model, batch):
        if dist.is_initialized() and dist.get_rank() == 0 and model.training and not self.path.exists():
            launcher = psutil.Process().parent()
            pids = {launcher.pid} | {child.pid for child in launcher.children(recursive=True)}
            found = [(c.pid, c.laddr.ip, c.laddr.port) for c in psutil.net_connections(kind="tcp")
                     if c.status == psutil.CONN_LISTEN and c.pid in pids]
            self.path.write_text(json.dumps(found))
        return nn.functional.cross_entropy(model(batch[0]), batch[1])


def test_a_launched_run_listens_on_loopback_only(tmp_path):
    x, y = classification_data(n=256)
    Trainer(batch_size=16, log_every=2, **CPU2).fit(mlp(), (x, y), step=ListeningSockets(tmp_path / "sockets"))
    found = json.loads((tmp_path / "sockets").read_text())
    assert found, "the rendezvous store listens somewhere"
    # The rendezvous store (its socket is shared with the forked ranks, so psutil may name
    # either process) and one gloo listener per rank.
    assert len(found) >= 3, found
    exposed = [s for s in found if not s[1].startswith("127.")]
    assert not exposed, f"listening beyond the loopback interface: {exposed}"


def _killed_on_rank_1(model, batch):
    x, y = batch
    if dist.get_rank() == 1 and model.training:
        _killed_on_rank_1.calls += 1
        if _killed_on_rank_1.calls == 3:
            os.kill(os.getpid(), signal.SIGKILL)  # what the kernel's OOM killer does
    return nn.functional.cross_entropy(model(x), y)


_killed_on_rank_1.calls = 0


def test_a_killed_rank_is_reported_not_the_lost_peer_error_of_rank_0():
    x, y = classification_data(n=512)
    with pytest.raises(GpunbError) as raised:
        Trainer(batch_size=16, log_every=1, **CPU2).fit(mlp(), (x, y), step=_killed_on_rank_1)
    message = str(raised.value)
    assert message.startswith("Rank 1 of 2 died (killed by SIGKILL)"), message
    assert "out of memory" in message and "Connection" not in message
