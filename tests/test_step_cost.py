"""What the loop does per optimizer step beyond a plain loop: nothing that grows with the steps.

The runs here are tracked, as a user's are by default: the run recorder's per-step hook
is part of what is counted.
"""

import collections

import pytest
import torch
from conftest import classification_data, mlp
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from gpunb import Trainer
from gpunb.runtime import epoch as epochs
from gpunb.runtime.events import Callbacks
from gpunb.runtime.step import precision as precisions
from gpunb.runtime.step import stepper as steps


class Lookups:
    """A callback that counts every attribute looked up on it, and defines only on_fit_start."""

    def __init__(self):
        object.__setattr__(self, "names", [])

    def __getattribute__(self, name):
        object.__getattribute__(self, "names").append(name)
        return object.__getattribute__(self, name)

    def on_fit_start(self, state):
        pass


def test_an_event_no_callback_defines_costs_no_lookup_per_call():
    quiet, other = Lookups(), Lookups()
    callbacks = Callbacks([quiet, other])
    for _ in range(50):
        callbacks.call("on_step_end", None)
    # the first call looks up on_step_end (and its old name) once per callback; later calls none
    looked_up = [object.__getattribute__(c, "names") for c in (quiet, other)]
    assert looked_up == [["on_step_end", "on_train_batch_end"]] * 2


def test_hooks_are_called_in_order_and_a_callback_put_first_is_heard_first():
    heard = []

    class Named:
        def __init__(self, name):
            self.name = name

        def on_step_end(self, state):
            heard.append(self.name)

    callbacks = Callbacks([Named("a"), Named("b")])
    callbacks.call("on_step_end", None)
    callbacks.run_first(Named("first"))
    callbacks.call("on_step_end", None)
    assert heard == ["a", "b", "first", "a", "b"]


def test_an_unknown_event_is_refused():
    with pytest.raises(AssertionError):
        Callbacks([Lookups()]).call("on_step_begin", None)


def _contexts_made(steps, precision):
    """torch.autocast objects and Precision.autocast calls made by a fit of `steps` steps."""
    made = {"torch.autocast": 0, "Precision.autocast": 0}

    class CountedAutocast(torch.autocast):
        def __init__(self, *args, **kwargs):
            made["torch.autocast"] += 1
            super().__init__(*args, **kwargs)

    original = precisions.Precision.autocast

    def counted(self):
        made["Precision.autocast"] += 1
        return original(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "autocast", CountedAutocast)
        patch.setattr(precisions.Precision, "autocast", counted)
        torch.manual_seed(0)
        Trainer(batch_size=8, max_steps=steps, log_every=4, precision=precision).fit(
            mlp(), classification_data(n=256), loss_fn=nn.CrossEntropyLoss())
    return made


@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
def test_the_step_makes_no_autocast_context_per_micro_batch(precision):
    short, long = _contexts_made(4, precision), _contexts_made(12, precision)
    assert short == long  # set-up makes a few; the steps make none
    if precision == "32":
        assert long["torch.autocast"] == 0


class StepOps(TorchDispatchMode):
    """The aten ops of each whole step, data included: from one step's end to the next."""

    def __init__(self):
        super().__init__()
        self.steps, self.current = [], collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.current[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    def on_step_end(self, state=None):
        self.steps.append(self.current)
        self.current = collections.Counter()


def test_a_whole_step_dispatches_the_plain_loops_ops_and_one_detach_with_a_faster_gather_and_no_zero_grad_range():
    x, y = torch.randn(64, 4), torch.randn(64, 2)
    ops = {}
    for loop in ("gpunb", "plain"):
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        log = StepOps()
        with log:
            if loop == "gpunb":  # tensors batched by indexing, as below
                Trainer(batch_size=8, epochs=1, log_every=4).fit(
                    model, (x, y), loss_fn=nn.MSELoss(), optimizer=optimizer, callbacks=[log])
            else:
                order = torch.randperm(64)
                for i in range(8):
                    rows = order[8 * i:8 * (i + 1)]  # one slice of the order, one gather per tensor
                    nn.MSELoss()(model(x[rows]), y[rows]).backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    log.on_step_end()
        ops[loop] = log.steps
    assert len(ops["gpunb"]) == len(ops["plain"]) == 8
    for step in (2, 3, 6, 7):  # not the epoch's first step, nor those after a log (its one sync)
        ours, plain = ops["gpunb"][step - 1], ops["plain"][step - 1]
        extra, missing = ours - plain, plain - ours
        # gpunb gathers each tensor's rows with index_select, where the plain loop's x[rows] is
        # `index`, and drops the gradients without optimizer.zero_grad's profiler range
        assert extra == {"detach": 1, "index_select": 2}, f"step {step}: +{dict(extra)}"
        assert missing == {"index": 2, "_record_function_enter_new": 1, "_record_function_exit": 1}, \
            f"step {step}: -{dict(missing)}"


def _phases_named(profile_from_start: bool) -> list:
    """The profiler ranges the step's phases open in a fit of 3 steps (fp32)."""
    named = []

    def counted(name):
        named.append(name)
        return torch.profiler.record_function(f"gpunb/{name}")

    class Profiles:
        def on_fit_start(self, state):
            state.profile = profile_from_start

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(steps, "phase_range", counted)
        patch.setattr(epochs, "phase_range", counted)
        Trainer(batch_size=8, max_steps=3, log_every=4).fit(
            mlp(), classification_data(n=64), loss_fn=nn.CrossEntropyLoss(), callbacks=[Profiles()])
    return named


def test_the_phases_are_named_only_while_a_profiler_asks():
    assert _phases_named(False) == []
    assert _phases_named(True) == ["data_wait", "forward", "backward", "optimizer"] * 3


class Entered:
    """A no-op context that counts how often it is entered."""

    def __init__(self):
        self.count = 0

    def __enter__(self):
        self.count += 1

    def __exit__(self, *exc):
        return False


def _contexts_entered(steps_run: int) -> int:
    entered = Entered()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(steps, "_NO_CONTEXT", entered)
        patch.setattr(precisions, "_NO_AUTOCAST", entered)
        Trainer(batch_size=8, max_steps=steps_run, log_every=3, precision="32").fit(
            mlp(), classification_data(n=128), loss_fn=nn.CrossEntropyLoss())
    return entered.count


def test_an_fp32_step_enters_no_context_while_not_profiled():
    assert _contexts_entered(3) == _contexts_entered(12)  # set-up enters a few; the steps none


class CountsZeroGrad(torch.optim.SGD):
    """An optimizer class with its own zero_grad (as ZeRO's or apex's have)."""

    calls = 0

    def zero_grad(self, set_to_none: bool = True):
        CountsZeroGrad.calls += 1
        super().zero_grad(set_to_none)


def _zero_grad_calls(steps_run: int, optimizer_type) -> tuple[int, int]:
    """(calls of torch's Optimizer.zero_grad, calls of CountsZeroGrad.zero_grad) in a fit."""
    torchs = []
    original = torch.optim.Optimizer.zero_grad
    CountsZeroGrad.calls = 0
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.optim.Optimizer, "zero_grad",
                      lambda self, set_to_none=True: torchs.append(1) or original(self, set_to_none))
        model = mlp()
        optimizer = optimizer_type(model.parameters(), lr=0.1)
        Trainer(batch_size=8, max_steps=steps_run, log_every=4).fit(
            model, classification_data(n=256), loss_fn=nn.CrossEntropyLoss(), optimizer=optimizer)
    assert all(p.grad is None for p in model.parameters())  # as zero_grad(set_to_none=True) leaves them
    return len(torchs), CountsZeroGrad.calls


def test_a_step_drops_the_gradients_itself_unless_the_optimizer_has_its_own_zero_grad():
    # torch's zero_grad (a profiler range around `p.grad = None` per parameter) is not called per step
    assert _zero_grad_calls(4, torch.optim.SGD) == _zero_grad_calls(12, torch.optim.SGD)
    short, long = _zero_grad_calls(4, CountsZeroGrad), _zero_grad_calls(12, CountsZeroGrad)
    assert long[1] - short[1] == 8  # an optimizer's own zero_grad is called once per step


class DeviceReads(TorchDispatchMode):
    """Reads of tensor values into Python (on a GPU, each waits for the device), counted between
    one step's end and the next; a window in which the run logged is marked as such.
    `.item()`, `float()`, `int()`, `bool()` and printing dispatch aten's `_local_scalar_dense`;
    `.tolist()` and `.numpy()` do not, and are counted by `counting_conversions`."""

    def __init__(self):
        super().__init__()
        self.windows, self.reads, self.logged = [], 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ == "_local_scalar_dense":
            self.reads += 1
        return func(*args, **(kwargs or {}))

    def counting_conversions(self, patch):
        for name in ("tolist", "numpy"):
            original = getattr(torch.Tensor, name)

            def counted(tensor, *args, _original=original, **kwargs):
                self.reads += 1
                return _original(tensor, *args, **kwargs)

            patch.setattr(torch.Tensor, name, counted)

    def close_window(self):
        self.windows.append((self.logged, self.reads))
        self.reads, self.logged = 0, False

    def on_step_end(self, state):
        self.close_window()

    def on_log(self, state, metrics):
        self.logged = True

    def on_fit_end(self, state):
        self.close_window()


def _device_reads(steps_run: int, log_every: int, samples: int = 64) -> list:
    """(logged, reads) per step of a tracked fit (8 steps an epoch of 64 samples), then the fit's end."""
    reads = DeviceReads()
    with pytest.MonkeyPatch.context() as patch:
        reads.counting_conversions(patch)
        with reads:
            Trainer(batch_size=8, max_steps=steps_run, log_every=log_every).fit(
                mlp(), classification_data(n=samples), loss_fn=nn.CrossEntropyLoss(), callbacks=[reads])
    return reads.windows


def test_a_tracked_run_reads_the_device_only_where_it_logs():
    windows = _device_reads(steps_run=20, log_every=4)  # 2 epochs and a half: epoch ends too
    assert len(windows) == 21 and sum(logged for logged, _ in windows) == 5
    # the first window also holds the fit's set-up (preflight checks read values once)
    assert [i for i, (logged, reads) in enumerate(windows, 1) if i > 1 and reads and not logged] == []
    # one epoch, logged once at its end: 24 steps read no more than 3
    long, short = _device_reads(24, log_every=100, samples=192), _device_reads(3, log_every=100, samples=192)
    assert sum(logged for logged, _ in long) == sum(logged for logged, _ in short) == 1
    assert sum(reads for _, reads in long) == sum(reads for _, reads in short)
