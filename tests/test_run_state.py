"""RunState: one list of what a run carries. A field added in a subclass travels through
checkpoints, resume, continue and the rank relay with no other edit; checkpoints written
before RunState (format version 1, tests/data/checkpoint_v1) still resume exactly."""

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from conftest import classification_data, mlp
from data.make_checkpoint_v1 import data as v1_data
from data.make_checkpoint_v1 import model as v1_model
from data.make_checkpoint_v1 import options as v1_options
from torch import nn

from gpunb import Trainer
from gpunb.config import TrainConfig
from gpunb.runtime.context import LocalContext
from gpunb.runtime.loop import run
from gpunb.runtime.run_state import RunState
from gpunb.runtime.state.checkpoint_files import list_checkpoints, load_checkpoint

V1 = Path(__file__).parent / "data" / "checkpoint_v1"


@dataclass(eq=False)
class CountingState(RunState):
    """A scratch subclass: two fields of its own, and nothing else anywhere."""

    odd_steps: int = 0  # counted by OddSteps below
    made_in: int = field(default_factory=os.getpid)  # the process that made the state


class OddSteps:
    def __init__(self):
        self.seen = {}

    def on_step_end(self, state):
        state.odd_steps += state.step % 2

    def on_fit_end(self, state):
        self.seen.update(type=type(state), odd_steps=state.odd_steps, made_in=state.made_in, step=state.step)


def fit(model, **options):
    settings = dict(batch_size=16, log_every=2, track=False, accelerator="cpu")
    settings.update(options)
    counter = OddSteps()
    extra = settings.pop("fit", {})
    result = Trainer(**settings).fit(model, classification_data(n=64), loss_fn=nn.CrossEntropyLoss(),
                                     callbacks=[counter], state_type=CountingState, **extra)
    return result, counter.seen


def test_a_field_of_a_subclass_is_checkpointed_and_resumed(tmp_path):
    _, first = fit(mlp(), epochs=2, checkpoint_dir=tmp_path)  # 4 steps an epoch
    assert first["type"] is CountingState and first["odd_steps"] == 4
    assert load_checkpoint(list_checkpoints(tmp_path)[-1])["odd_steps"] == 4
    _, resumed = fit(mlp(), epochs=3, checkpoint_dir=tmp_path, resume="last")
    assert resumed["step"] == 12 and resumed["odd_steps"] == 6  # steps 1..12 counted, not only 9..12


def test_a_field_of_a_subclass_goes_on_in_a_continued_fit():
    model = mlp()
    first, seen = fit(model, epochs=1)
    assert seen["odd_steps"] == 2
    _, more = fit(model, epochs=1, fit={"continue_from": first})
    assert more["step"] == 8 and more["odd_steps"] == 4


def test_a_field_of_a_subclass_comes_back_from_the_ranks_and_resumes_there(tmp_path):
    _, first = fit(mlp(), epochs=1, devices=2, checkpoint_dir=tmp_path)
    rank0 = first["made_in"]
    assert first["type"] is CountingState and rank0 != os.getpid()  # relayed from rank 0's own state
    assert load_checkpoint(list_checkpoints(tmp_path)[-1])["made_in"] == rank0
    _, resumed = fit(mlp(), epochs=2, devices=2, checkpoint_dir=tmp_path, resume="last")
    assert resumed["made_in"] == rank0 and resumed["step"] == 4  # new ranks, the saved value


def test_the_checkpoint_lists_every_carried_field_and_a_state_dict_round_trips():
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = CountingState(model=model, optimizer=optimizer, step=3, samples_seen=48, odd_steps=2,
                          history=[{"step": 2, "loss": 1.0}], epoch=1, batch_in_epoch=2)
    saved = state.state_dict()
    assert {"model", "optimizer", "scheduler", "ema", "precision", "best", "rng", "epoch", "batch_in_epoch",
            "step", "samples_seen", "splits", "history", "epochs", "validations", "odd_steps",
            "made_in"} <= set(saved)
    fresh = CountingState(model=mlp(seed=1), optimizer=None)
    fresh.load_state_dict(saved)
    assert (fresh.step, fresh.samples_seen, fresh.odd_steps, fresh.epoch, fresh.batch_in_epoch) == (3, 48, 2, 1, 2)
    assert fresh.history == state.history and fresh.history is not state.history
    for name, value in model.state_dict().items():
        assert torch.equal(fresh.model.state_dict()[name], value), name


class LoadedAtStart:
    def on_fit_start(self, state):
        self.weights = {k: v.clone() for k, v in state.model.state_dict().items()}
        self.moments = {k: {f: t.clone() for f, t in v.items()} for k, v in state.optimizer.state_dict()["state"].items()}
        self.position = (state.step, state.epoch, state.batch_in_epoch, state.samples_seen)
        self.lr = state.optimizer.param_groups[0]["lr"]
        self.rng = torch.get_rng_state().clone()


def test_a_checkpoint_written_before_run_state_resumes_exactly(tmp_path):
    shutil.copytree(V1, tmp_path / "checkpoints")
    directory = tmp_path / "checkpoints"
    saved = load_checkpoint(next(directory.glob("run-*/step-*.pt")))
    expected = torch.load(directory / "expected.pt", weights_only=True)
    model, start = v1_model(), LoadedAtStart()
    val = v1_data()
    result = Trainer(**v1_options(directory), resume="last").fit(model, v1_data(), val, loss_fn=nn.MSELoss(),
                                                                    callbacks=[start])
    # what the new code loaded is exactly what the old code saved
    assert start.position == (4, 1, 0, 32)
    for name, value in saved["model"].items():
        assert torch.equal(start.weights[name], value), name
    for index, fields in saved["optimizer"]["state"].items():
        for name, value in fields.items():
            assert torch.equal(torch.as_tensor(start.moments[index][name]), torch.as_tensor(value)), (index, name)
    assert start.lr == saved["optimizer"]["param_groups"][0]["lr"]
    assert torch.equal(start.rng, saved["rng"]["torch"])
    # and it trains on to where the straight run of that time ended
    assert result.steps == expected["steps"] == 8 and result.start_step == 4
    for name, value in expected["model"].items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=1e-6, atol=1e-7)
    for name, value in expected["ema"].items():
        torch.testing.assert_close(result.ema_state_dict[name], value, rtol=1e-6, atol=1e-7)
    assert [row["step"] for row in result.history] == [row["step"] for row in expected["history"]]
    losses = [row["loss"] for row in result.history]
    assert losses == pytest.approx([row["loss"] for row in expected["history"]], rel=1e-6)
    assert [row["epoch"] for row in result.epochs] == [row["epoch"] for row in expected["epochs"]]


def test_the_relay_sends_plain_fields_and_merges_the_notes_into_the_kernels():
    model = mlp()
    rank0 = CountingState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), step=5,
                          odd_steps=3, history=[{"step": 1}], latest={"loss": 0.5}, extras={"gpu": {"index": 0}})
    rank0.extras["handle"] = object()  # not plain: stays on the rank
    sent = rank0.relayed()
    assert {"module", "optimizer", "stepper", "config", "history", "precision", "best"}.isdisjoint(sent)
    assert sent["step"] == 5 and sent["odd_steps"] == 3 and sent["extras"] == {"gpu": {"index": 0}}
    kernel = CountingState(latest={"seen_here": 1}, extras={"log_dir": "/tmp/x"})
    kernel.load_relayed(sent)
    assert (kernel.step, kernel.odd_steps, kernel.made_in) == (5, 3, rank0.made_in)
    assert kernel.latest == {"seen_here": 1, "loss": 0.5}
    assert kernel.extras == {"log_dir": "/tmp/x", "gpu": {"index": 0}}


class Wrapper(nn.Module):
    """What a process group's context wraps the model in (DDP's shape: the model as `.module`)."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


class TwoRanksAlone(LocalContext):
    """A context of two ranks whose collectives are this process's own, and whose wrap is Wrapper."""

    world_size = 2
    strategy = "ddp"

    def wrap(self, model, device):
        return Wrapper(model)

    def use_strategy(self, strategy):
        self.strategy = strategy


class Models:
    def on_fit_start(self, state):
        self.model, self.train_model, self.stepped = state.model, state.train_model, state.stepper.model


def test_model_is_the_users_module_and_train_model_what_the_loop_calls_in_run_and_state():
    model, seen = mlp(), Models()
    run(TrainConfig(max_steps=1, batch_size=16, accelerator="cpu", compile=False), TwoRanksAlone(), model,
        classification_data(n=64), loss_fn=nn.CrossEntropyLoss(), callbacks=[seen])
    assert seen.model is model
    assert isinstance(seen.train_model, Wrapper) and seen.train_model.module is model
    assert seen.stepped is seen.train_model  # the stepper trains what the loop calls
