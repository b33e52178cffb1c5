"""What the loop does per optimizer step beyond a plain loop: nothing that grows with the steps."""

import pytest
import torch
from conftest import classification_data, mlp
from torch import nn

from gpunb import Trainer
from gpunb.runtime import precision as precisions
from gpunb.runtime.events import Callbacks


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
        Trainer(batch_size=8, max_steps=steps, log_every=4, precision=precision, track=False).fit(
            mlp(), classification_data(n=256), loss_fn=nn.CrossEntropyLoss())
    return made


@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
def test_the_step_makes_no_autocast_context_per_micro_batch(precision):
    short, long = _contexts_made(4, precision), _contexts_made(12, precision)
    assert short == long  # set-up makes a few; the steps make none
    if precision == "32":
        assert long["torch.autocast"] == 0
