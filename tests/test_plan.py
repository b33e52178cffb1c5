"""The RunPlan: what set-up decided, and why, beside a TrainConfig that stays what the user asked."""

import ast
import copy
from pathlib import Path

from conftest import classification_data, mlp
from torch import nn

import gpunb
from gpunb import TrainConfig, Trainer
from gpunb.runtime.context import LocalContext
from gpunb.runtime.loop import run


class Look:
    def __init__(self):
        self.seen = {}

    def on_fit_start(self, state):
        self.seen.update(plan=state.plan, config=state.config, settings=state.settings())


def test_the_plan_holds_the_decisions_and_the_config_stays_as_asked():
    config = TrainConfig(batch_size="auto", log_every="auto", epochs=2, accelerator="cpu", track=False)
    asked = copy.deepcopy(config.to_dict())
    look = Look()
    result = run(config, LocalContext(), mlp(), classification_data(n=256), loss_fn=nn.CrossEntropyLoss(),
                 callbacks=[look])
    plan = look.seen["plan"]
    assert look.seen["config"] is config and config.to_dict() == asked  # never replaced, never written
    assert plan.batch_size == result.batch_size and plan.batch_size_reason.startswith("auto: ")
    assert result.batch_size in {probe["batch_size"] for probe in plan.batch_probe} and result.batch_probe
    assert (plan.precision, plan.device.type) == ("32", "cpu") and plan.precision_reason
    assert plan.total_steps == 2 * plan.steps_per_epoch == result.total_steps and plan.epochs == 2
    assert plan.log_every >= 1 and result.history[0]["step"] == plan.log_every
    assert result.config == look.seen["settings"]
    assert (result.config["batch_size"], result.config["log_every"]) == (plan.batch_size, plan.log_every)


def test_a_continued_fits_plan_counts_its_epochs_on_from_the_fit_it_continues():
    model, data = mlp(), classification_data(n=64)
    trainer = Trainer(epochs=1, batch_size=16, track=False, accelerator="cpu")
    first = trainer.fit(model, data, loss_fn=nn.CrossEntropyLoss())
    look = Look()
    more = trainer.fit(model, data, loss_fn=nn.CrossEntropyLoss(), continue_from=first, callbacks=[look])
    plan = look.seen["plan"]
    assert (plan.epochs, plan.total_steps, more.steps) == (2, 8, 8)
    assert trainer.config.epochs == 1 and look.seen["config"].epochs == 1 and more.config["epochs"] == 2


def test_the_runtime_keeps_no_untyped_notes():
    """`extras` (the callbacks' notes on the state) is neither read nor written by the runtime."""
    runtime = Path(gpunb.__file__).parent / "runtime"
    uses = []
    for path in runtime.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "extras":
                uses.append(f"{path.name}:{node.lineno}")
    assert uses == []
    assert "extras" not in {f for f in TrainConfig.__dataclass_fields__}
