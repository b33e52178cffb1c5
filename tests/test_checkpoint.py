"""Checkpoints: exact resume, atomic files, interrupts, and clear errors for bad files."""

import errno
import os
import signal
from pathlib import Path

import pytest
import torch
from conftest import classification_data
from torch import nn

from gpunb import Trainer
from gpunb.errors import GpunbError
from gpunb.runtime.state.checkpoint_files import list_checkpoints, load_checkpoint


def dropout_mlp(seed=0):
    # Dropout makes the run depend on the RNG state, which resume must restore too.
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 3))


def train(model, epochs, **overrides):
    x, y = classification_data(n=200)
    options = dict(batch_size=16, log_every=5, track=False, epochs=epochs)
    options.update(overrides)
    callbacks = options.pop("callbacks", ())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    result = Trainer(**options).fit(model, (x, y), loss_fn=nn.CrossEntropyLoss(), optimizer=optimizer,
                                    callbacks=callbacks)
    return result, optimizer


class StopAt:
    def __init__(self, step):
        self.step = step

    def on_step_end(self, state):
        if state.step == self.step:
            state.request_stop("test stop")


def assert_same_state(model_a, opt_a, model_b, opt_b):
    for (name, a), b in zip(model_a.state_dict().items(), model_b.state_dict().values()):
        assert torch.equal(a, b), name
    state_a, state_b = opt_a.state_dict(), opt_b.state_dict()
    assert state_a["param_groups"] == state_b["param_groups"]
    for key in state_a["state"]:
        for field, value in state_a["state"][key].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(state_b["state"][key][field]))


def test_three_epochs_equal_two_plus_resume_for_one_more_bitwise(tmp_path):
    straight = dropout_mlp()
    _, opt_straight = train(straight, epochs=3)

    train(dropout_mlp(), epochs=2, checkpoint_dir=tmp_path)
    resumed = dropout_mlp(seed=123)  # a fresh process would start from other weights
    result, opt_resumed = train(resumed, epochs=3, checkpoint_dir=tmp_path, resume="last")

    assert_same_state(straight, opt_straight, resumed, opt_resumed)
    assert result.steps == 39 and len(result.epochs) == 3


def test_resume_mid_epoch_with_a_schedule_is_bitwise_exact(tmp_path):
    options = dict(epochs=2, lr_schedule="one-cycle", checkpoint_dir=tmp_path)
    straight = dropout_mlp()
    _, opt_straight = train(straight, **{**options, "checkpoint_dir": None})
    stopped, _ = train(dropout_mlp(), callbacks=[StopAt(7)], **options)
    assert stopped.stop_reason == "test stop" and stopped.steps == 7
    resumed = dropout_mlp(seed=5)
    _, opt_resumed = train(resumed, resume="last", **options)
    assert_same_state(straight, opt_straight, resumed, opt_resumed)


def test_keep_last_and_atomic_names(tmp_path):
    result, _ = train(dropout_mlp(), epochs=5, checkpoint_dir=tmp_path, keep_last=2)
    run_dir = Path(result.checkpoint_path).parent
    assert run_dir.parent == tmp_path and run_dir.name.startswith("run-")
    names = [p.name for p in list_checkpoints(tmp_path)]
    assert names == ["step-000000052.pt", "step-000000065.pt"]
    assert not [p for p in run_dir.iterdir() if p.name.startswith(".tmp")]
    payload = load_checkpoint(run_dir / names[-1])
    assert payload["step"] == 65 and payload["epoch"] == 5 and payload["batch_in_epoch"] == 0
    assert set(payload["rng"]) >= {"torch", "python", "numpy"}
    assert payload["config"]["batch_size"] == 16


def test_a_failed_save_warns_once_keeps_training_and_the_old_checkpoints(tmp_path, monkeypatch):
    train(dropout_mlp(), epochs=1, checkpoint_dir=tmp_path)
    before = {p: p.read_bytes() for p in list_checkpoints(tmp_path)}

    def broken_save(obj, f, *args, **kwargs):
        f.write(b"half a file")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.warns(RuntimeWarning, match="the disk is full") as caught:
        result, _ = train(dropout_mlp(), epochs=3, checkpoint_dir=tmp_path, resume="last")
    assert len([w for w in caught if "Could not write" in str(w.message)]) == 1
    assert result.steps == 39 and len(result.epochs) == 3  # the run went on to the end
    assert result.checkpoint_path is None  # no checkpoint of this stretch made it to disk
    after = {p: p.read_bytes() for p in list_checkpoints(tmp_path)}
    assert after == before
    assert not [p for p in tmp_path.rglob(".tmp*")]


class InterruptAt:
    """Sends a real SIGINT (what the kernel's stop button does) at a given step."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, state):
        if state.step == self.step:
            os.kill(os.getpid(), signal.SIGINT)


def test_interrupt_mid_epoch_returns_a_result_and_a_loadable_checkpoint(tmp_path):
    model = dropout_mlp()
    x, y = classification_data(n=200)
    result = Trainer(epochs=3, batch_size=16, track=False, checkpoint_dir=tmp_path).fit(
        model, (x, y), loss_fn=nn.CrossEntropyLoss(), callbacks=[InterruptAt(5)])
    assert result.interrupted and result.steps == 5 and result.stop_reason == "interrupted"
    assert result.checkpoint_path.endswith("step-000000005.pt")
    payload = load_checkpoint(result.checkpoint_path)
    assert payload["epoch"] == 0 and payload["batch_in_epoch"] == 5
    for name, value in model.state_dict().items():  # the notebook's model keeps its weights
        assert torch.equal(value, payload["model"][name])
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_process_that_ignores_ctrl_c_trains_on_and_goes_on_ignoring_it():
    """A script started in the background (`python train.py &`, `nohup`) ignores SIGINT: Ctrl-C
    was never meant to reach it, and gpunb does not make it listen."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    x, y = classification_data(n=200)
    result = Trainer(epochs=1, batch_size=16, track=False).fit(
        dropout_mlp(), (x, y), loss_fn=nn.CrossEntropyLoss(), callbacks=[InterruptAt(5)])
    assert not result.interrupted and result.steps == 13 and result.stop_reason is None
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_keyboard_interrupt_inside_a_step_is_caught_not_raised():
    calls = []

    class Interrupting(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(10, 3)

        def forward(self, x):
            if torch.is_grad_enabled():  # the summary's one step, then training steps (not the no-grad check)
                calls.append(1)
            if len(calls) == 5:  # the 4th training step
                raise KeyboardInterrupt
            return self.layer(x)

    x, y = classification_data(n=200)
    result = Trainer(epochs=1, batch_size=16, track=False).fit(Interrupting(), (x, y),
                                                               loss_fn=nn.CrossEntropyLoss())
    assert result.interrupted and result.steps == 3


def test_missing_checkpoint_names_the_fix(tmp_path):
    with pytest.raises(GpunbError, match="does not exist"):
        train(dropout_mlp(), epochs=1, resume=str(tmp_path / "nope.pt"))
    with pytest.raises(GpunbError, match="found no checkpoint"):
        train(dropout_mlp(), epochs=1, checkpoint_dir=tmp_path, resume="last")


def test_corrupt_checkpoint_names_the_fix(tmp_path):
    bad = tmp_path / "step-000000001.pt"
    bad.write_bytes(b"\x00not a zip file")
    with pytest.raises(GpunbError, match="corrupt") as error:
        train(dropout_mlp(), epochs=1, checkpoint_dir=tmp_path, resume="last")
    assert "HINT" in str(error.value)


def test_foreign_checkpoint_names_the_fix(tmp_path):
    foreign = tmp_path / "weights.pt"
    torch.save(dropout_mlp().state_dict(), foreign)
    with pytest.raises(GpunbError, match="not a gpunb checkpoint") as error:
        train(dropout_mlp(), epochs=1, resume=str(foreign))
    assert "load_state_dict" in str(error.value)


def test_checkpoint_of_another_model_names_the_fix(tmp_path):
    train(dropout_mlp(), epochs=1, checkpoint_dir=tmp_path)
    other = nn.Sequential(nn.Linear(10, 8), nn.ReLU(), nn.Linear(8, 3))
    x, y = classification_data(n=64)
    with pytest.raises(GpunbError, match="does not fit this model"):
        Trainer(track=False, checkpoint_dir=tmp_path, resume="last").fit(
            other, (x, y), loss_fn=nn.CrossEntropyLoss())


class InterruptedWhileMoved(nn.Sequential):
    """Ctrl-C pressed `presses` times while fit sets up (moving the model is part of set-up)."""

    def __init__(self, presses):
        super().__init__(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3))
        self.presses = presses

    def to(self, *args, **kwargs):
        presses, self.presses = self.presses, 0  # only at the first move (fit's own)
        for _ in range(presses):
            os.kill(os.getpid(), signal.SIGINT)
        return super().to(*args, **kwargs)


def test_an_interrupt_during_set_up_is_deferred_and_the_run_stops_before_its_first_step():
    x, y = classification_data(n=64)
    try:
        result = Trainer(epochs=1, batch_size=16, track=False).fit(
            InterruptedWhileMoved(1), (x, y), loss_fn=nn.CrossEntropyLoss())
    except KeyboardInterrupt:
        pytest.fail("a Ctrl-C during set-up escaped fit")
    assert result.interrupted and result.steps == 0
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_second_interrupt_during_set_up_is_raised_and_never_masked_by_cleanup(monkeypatch):
    from gpunb.runtime import device

    def broken_restore(saved):
        raise AttributeError("module 'sympy' has no attribute 'core'")

    monkeypatch.setattr(device, "restore_globals", broken_restore)
    torch.set_float32_matmul_precision("highest")
    x, y = classification_data(n=64)
    with pytest.warns(RuntimeWarning, match="Cleaning up after the failed run also failed"):
        with pytest.raises(KeyboardInterrupt):
            Trainer(epochs=1, batch_size=16, track=False).fit(
                InterruptedWhileMoved(2), (x, y), loss_fn=nn.CrossEntropyLoss())
    assert torch.get_float32_matmul_precision() == "highest"  # the other clean-up steps still ran
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_the_run_keeps_its_own_state_in_typed_fields_and_leaves_extras_to_callbacks(tmp_path):
    seen = {}

    class Look:
        def on_checkpoint(self, state, path):
            seen.setdefault("first_checkpoint_at", state.step)

        def on_step_end(self, state):  # the checkpointer runs first: this step's file is there
            if state.step == 13 and "first_checkpoint_at" in seen:
                seen["path_at_13"] = state.checkpoint_path

        def on_fit_end(self, state):
            seen.update(epochs=list(state.epochs), path=state.checkpoint_path, extras=dict(state.extras),
                        resumed=state.resumed, run=state.checkpoint_run, profile=state.profile)

    result, _ = train(dropout_mlp(), epochs=2, checkpoint_dir=tmp_path, checkpoint_every=13,
                      callbacks=[Look()])
    assert [row["epoch"] for row in seen["epochs"]] == [0, 1] and seen["epochs"] == result.epochs
    assert seen["path"] == result.checkpoint_path and seen["run"] in seen["path"]
    assert seen["first_checkpoint_at"] == 13 and seen["path_at_13"].endswith(".pt")
    assert seen["resumed"] is None and seen["profile"] is False
    runtime_names = {"epochs", "checkpoint_path", "checkpoint_run", "resumed", "resumed_from", "profile"}
    assert not runtime_names & set(seen["extras"])

    train(dropout_mlp(), epochs=3, checkpoint_dir=tmp_path, resume="last", callbacks=[Look()])
    assert seen["resumed"]["path"] == result.checkpoint_path and seen["run"] in seen["path"]
