"""Checkpoints that survive NaN, shared directories, bad disks and bad files; resume checks first."""

import collections
import os
import stat
import time

import pytest
import torch
from conftest import classification_data
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from gpunb import Trainer
from gpunb.errors import GpunbError
from gpunb.runtime.state.checkpoint_files import list_checkpoints, load_checkpoint, save_checkpoint


def dropout_mlp(seed=0, classes=3):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, classes))


def train(model, epochs, optimizer=None, loss_fn=None, **overrides):
    x, y = classification_data(n=200)
    options = dict(batch_size=16, log_every=5, track=False, epochs=epochs)
    options.update(overrides)
    callbacks = options.pop("callbacks", ())
    optimizer = optimizer or torch.optim.AdamW(model.parameters(), lr=1e-2)
    return Trainer(**options).fit(model, (x, y), loss_fn=loss_fn or nn.CrossEntropyLoss(),
                                  optimizer=optimizer, callbacks=callbacks)


class NanFrom:
    """A loss that turns NaN from a given optimizer step on."""

    def __init__(self, step):
        self.step, self.calls = step, -1  # call 0: the summary's measured step before training
        self.loss = nn.CrossEntropyLoss()

    def __call__(self, out, y):
        self.calls += torch.is_grad_enabled()  # steps only, not the no-grad check before them
        loss = self.loss(out, y)
        return loss * float("nan") if self.calls >= self.step else loss


def finite(state: dict) -> bool:
    return all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())


# --- NaN -------------------------------------------------------------------------------------

def test_nan_never_reaches_a_checkpoint_and_the_last_good_weights_come_back(tmp_path):
    model = dropout_mlp()
    with pytest.raises(GpunbError) as error:
        train(model, 3, loss_fn=NanFrom(7), checkpoint_dir=tmp_path, checkpoint_every=5, keep_last=1,
              log_every=50)
    message = str(error.value)
    assert "at step 7 " in message and "last good checkpoint, step 5" in message
    saved = list_checkpoints(tmp_path)
    assert [p.name for p in saved] == ["step-000000005.pt"]
    good = load_checkpoint(saved[0])["model"]
    assert finite(good)
    for name, value in model.state_dict().items():  # the model holds the step-5 weights again
        assert torch.equal(value, good[name]), name


def test_nan_without_a_good_checkpoint_says_so(tmp_path):
    model = dropout_mlp()
    with pytest.raises(GpunbError, match="at step 7 .*No good checkpoint exists"):
        train(model, 3, loss_fn=NanFrom(7), checkpoint_dir=tmp_path, checkpoint_every=10, log_every=50)
    assert list_checkpoints(tmp_path) == []


def test_nan_found_at_the_log_interval_names_the_first_bad_step():
    with pytest.raises(GpunbError, match=r"at step 3 \(found at step 10"):
        train(dropout_mlp(), 3, loss_fn=NanFrom(3), log_every=10)


def test_detect_nan_off_trains_on_but_writes_no_nan_checkpoint(tmp_path):
    with pytest.warns(RuntimeWarning, match="not finite at step 7"):
        result = train(dropout_mlp(), 2, loss_fn=NanFrom(7), checkpoint_dir=tmp_path, checkpoint_every=5,
                       detect_nan=False)
    assert result.steps == 26
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000000005.pt"]
    assert finite(load_checkpoint(list_checkpoints(tmp_path)[0])["model"])


class NanValueAt:
    """A loss whose value (not its gradient) is NaN at one optimizer step: the weights stay finite."""

    def __init__(self, step):
        self.step, self.calls = step, -1  # call 0: the summary's measured step before training
        self.loss = nn.CrossEntropyLoss()

    def __call__(self, out, y):
        self.calls += torch.is_grad_enabled()
        loss = self.loss(out, y)
        return loss + float("nan") if self.calls == self.step else loss


@pytest.mark.parametrize("log_every", [3, 12])  # NaN found by a log first / by a checkpoint first
def test_detect_nan_off_skips_only_the_checkpoint_after_a_passing_nan(tmp_path, log_every):
    with pytest.warns(RuntimeWarning, match="not finite at step 7"):
        train(dropout_mlp(), 2, loss_fn=NanValueAt(7), checkpoint_dir=tmp_path, checkpoint_every=5,
              keep_last=10, log_every=log_every, detect_nan=False)
    assert [p.name for p in list_checkpoints(tmp_path)] == [f"step-0000000{s:02d}.pt" for s in (5, 15, 20, 25)]


class OpLog(TorchDispatchMode):
    """The aten ops run between a model's forward and the end of each optimizer step."""

    def __init__(self, model):
        super().__init__()
        self.steps, self.current = [], None
        model.register_forward_pre_hook(lambda module, args: setattr(self, "current", collections.Counter()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.current is not None:
            self.current[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    def on_step_end(self, state=None):
        self.steps.append(self.current)
        self.current = None


def test_the_loop_adds_no_device_op_per_step_to_forward_backward_and_optimizer(tmp_path):
    x, y = torch.randn(64, 4), torch.randn(64, 2)
    ops = {}
    for loop in ("gpunb", "plain"):
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        log = OpLog(model)
        with log:
            if loop == "gpunb":  # NaN detection and checkpoints on; logs and checkpoints every 4 steps
                Trainer(batch_size=8, epochs=1, log_every=4, checkpoint_every=4, checkpoint_dir=tmp_path,
                        detect_nan=True).fit(model, (x, y), loss_fn=nn.MSELoss(),  # tracked: the default
                                             optimizer=optimizer, callbacks=[log])
            else:
                for i in range(0, 64, 8):
                    nn.MSELoss()(model(x[i:i + 8]), y[i:i + 8]).backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    log.on_step_end()
        ops[loop] = log.steps
    assert len(ops["gpunb"]) == len(ops["plain"]) == 8
    for step in (1, 2, 3, 5, 6, 7):  # not the log and checkpoint steps, which sync anyway
        added = ops["gpunb"][step - 1] - ops["plain"][step - 1]
        del added["detach"]  # the step loss kept without its graph: a view, no kernel
        assert not added, f"step {step}: {dict(added)}"


# --- runs own their checkpoints ----------------------------------------------------------------

def test_a_new_run_in_a_used_directory_keeps_its_own_checkpoints(tmp_path, capsys):
    first = train(dropout_mlp(), 5, checkpoint_dir=tmp_path, keep_last=2)
    second = train(dropout_mlp(), 2, checkpoint_dir=tmp_path, keep_last=2)
    assert os.path.exists(second.checkpoint_path) and os.path.exists(first.checkpoint_path)
    assert len(list_checkpoints(tmp_path)) == 4
    capsys.readouterr()
    resumed = train(dropout_mlp(), 3, checkpoint_dir=tmp_path, resume="last", keep_last=2)
    assert capsys.readouterr().out == ("Resuming run 'Sequential' at step 26 (epoch 2) from step-000000026.pt "
                                       "(result.resumed_from says which run and when it was saved).\n")
    assert resumed.resumed_from["saved_at"] <= time.time()
    assert resumed.resumed_from["path"] == second.checkpoint_path
    assert resumed.resumed_from["step"] == 26 and resumed.resumed_from["run"] in second.checkpoint_path
    assert os.path.dirname(resumed.checkpoint_path) == os.path.dirname(second.checkpoint_path)
    assert os.path.exists(first.checkpoint_path)


# --- the directory and the disk ----------------------------------------------------------------

def test_an_unwritable_checkpoint_dir_is_refused_before_training(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    model = dropout_mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(GpunbError, match="Cannot write checkpoints to") as error:
        train(model, 1, checkpoint_dir=blocker / "checkpoints")
    assert "checkpoint_dir" in error.value.hint
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name])


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600)])
def test_checkpoints_and_the_registry_follow_the_umask(tmp_path, gpunb_home, umask, mode):
    old = os.umask(umask)
    try:
        result = train(dropout_mlp(), 1, checkpoint_dir=tmp_path / "ckpt", track=True)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(result.checkpoint_path).st_mode) == mode
    assert stat.S_IMODE(os.stat(gpunb_home / "runs.sqlite").st_mode) == mode


def test_leftover_temp_files_are_removed_at_the_next_save_and_at_resume(tmp_path):
    result = train(dropout_mlp(), 1, checkpoint_dir=tmp_path)
    run_dir = os.path.dirname(result.checkpoint_path)
    leftover = os.path.join(run_dir, ".tmp-killed.pt")
    open(leftover, "wb").write(b"x" * 100)
    train(dropout_mlp(), 2, checkpoint_dir=tmp_path, resume="last", max_steps=14)
    assert not os.path.exists(leftover)
    open(leftover, "wb").write(b"x")
    save_checkpoint(run_dir, {"step": 99}, 99, keep_last=5)
    assert not os.path.exists(leftover)


# --- a resume that does not fit changes nothing and says what differs ---------------------------

def test_a_partly_matching_model_is_refused_untouched_with_every_mismatch(tmp_path):
    train(dropout_mlp(), 1, checkpoint_dir=tmp_path)
    other = dropout_mlp(seed=3, classes=5)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(GpunbError, match="does not fit this model") as error:
        train(other, 2, checkpoint_dir=tmp_path, resume="last")
    assert "3.weight: checkpoint (3, 32), model (5, 32)" in str(error.value)
    assert "3.bias: checkpoint (3,), model (5,)" in str(error.value)
    for name, value in other.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_missing_and_unexpected_keys_are_listed(tmp_path):
    train(dropout_mlp(), 1, checkpoint_dir=tmp_path)
    other = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3), nn.Linear(3, 3))
    with pytest.raises(GpunbError) as error:
        train(other, 2, checkpoint_dir=tmp_path, resume="last")
    assert "missing from the checkpoint: 2.weight, 2.bias" in str(error.value)
    assert "not in the model: 3.weight, 3.bias" not in str(error.value)  # 3.* exist in both
    assert "3.weight: checkpoint (3, 32), model (3, 3)" in str(error.value)


def test_another_optimizer_type_is_refused_before_anything_loads(tmp_path):
    train(dropout_mlp(), 1, checkpoint_dir=tmp_path)
    model = dropout_mlp(seed=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(GpunbError, match="state of AdamW, this run uses SGD"):
        train(model, 2, optimizer=sgd, checkpoint_dir=tmp_path, resume="last")
    assert sgd.param_groups[0]["lr"] == 0.1 and "momentum" in sgd.param_groups[0]
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_a_gpunb_file_with_missing_parts_is_a_clear_error(tmp_path):
    broken = tmp_path / "step-000000001.pt"
    torch.save({"format": "gpunb-checkpoint", "version": 1, "step": 1}, broken)
    with pytest.raises(GpunbError, match="is incomplete: it has no 'model', 'optimizer'"):
        train(dropout_mlp(), 1, resume=str(broken))


def test_a_changed_batch_size_is_refused(tmp_path):
    train(dropout_mlp(), 1, checkpoint_dir=tmp_path)
    with pytest.raises(GpunbError, match="batch_size=16 in the checkpoint, 32 now"):
        train(dropout_mlp(), 2, checkpoint_dir=tmp_path, resume="last", batch_size=32)


class Evil:
    def __reduce__(self):
        return (os.system, ("true",))


def test_a_file_that_could_run_code_is_refused_without_suggesting_the_unsafe_fix(tmp_path):
    evil = tmp_path / "evil.pt"
    torch.save({"model": Evil()}, evil)
    with pytest.raises(GpunbError, match="could run code") as error:
        train(dropout_mlp(), 1, resume=str(evil))
    message = str(error.value)
    assert "corrupt" not in message and "False" not in message and "weights_only" not in message
    assert "system" in message and "state_dict()" in message
