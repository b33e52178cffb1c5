"""The training loop: recorded losses, data types, objectives, accumulation, schedules."""

import numpy as np
import pytest
import torch
from conftest import charts_in, classification_data, mlp
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from gpunb import Trainer, TrainResult
from gpunb.errors import GpunbError
from gpunb.runtime.step.optimizer import default_optimizer

# Losses of the first 8 steps of a seeded 2-layer MLP (batch 16, AdamW 1e-3, fp32, CPU).
RECORDED = [1.118733, 1.053832, 1.0929, 1.098509, 1.067541, 1.057247, 1.032906, 1.108601]


def fit(model=None, data=None, **overrides):
    options = dict(batch_size=16, log_every=1, track=False)
    fit_kwargs = {k: overrides.pop(k) for k in ("loss_fn", "step", "val_data", "metrics",
                                                 "optimizer", "callbacks") if k in overrides}
    fit_kwargs.setdefault("loss_fn", nn.CrossEntropyLoss() if "step" not in fit_kwargs else None)
    options.update(overrides)
    model = model or mlp()
    data = data if data is not None else classification_data(n=128)
    val = fit_kwargs.pop("val_data", None)
    return model, Trainer(**options).fit(model, data, val, **fit_kwargs)


def test_losses_match_recorded_values():
    _, result = fit(max_steps=8)
    assert [h["loss"] for h in result.history] == pytest.approx(RECORDED, rel=1e-4)
    assert result.steps == 8 and result.samples == 128


def test_the_default_optimizer_is_adamw_with_torchs_fused_kernel_and_matches_it():
    model, _ = fit(max_steps=8, shuffle=False)
    default = default_optimizer(mlp(), lr=None)
    assert isinstance(default, torch.optim.AdamW) and default.defaults["fused"] is True
    assert default.defaults["lr"] == 1e-3
    # the same run by hand, with the fused AdamW a user would have to ask for
    reference = mlp()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3, fused=True)
    x, y = classification_data(n=128)
    for i in range(8):
        nn.functional.cross_entropy(reference(x[16 * i:16 * (i + 1)]), y[16 * i:16 * (i + 1)]).backward()
        optimizer.step()
        optimizer.zero_grad()
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


@pytest.mark.filterwarnings("ignore:Complex modules")
def test_parameters_without_a_fused_kernel_get_the_foreach_adamw():
    model = nn.Linear(4, 4).to(torch.complex64)  # torch's fused AdamW takes real floating point only
    optimizer = default_optimizer(model, lr=None)
    assert optimizer.defaults["foreach"] is True and not optimizer.defaults["fused"]


def test_same_seed_same_run_and_different_seed_differs():
    _, a = fit(max_steps=5)
    _, b = fit(max_steps=5)
    _, c = fit(max_steps=5, seed=1)
    assert [h["loss"] for h in a.history] == [h["loss"] for h in b.history]
    assert [h["loss"] for h in a.history] != [h["loss"] for h in c.history]


def test_training_learns_and_reports_validation_accuracy():
    x, y = classification_data(n=512)
    model, result = fit(data=(x[:400], y[:400]), val_data=(x[400:], y[400:]), epochs=15,
                        batch_size=32, lr=1e-2, log_every=10)
    assert result.final_metrics["val_acc"] > 0.9
    assert result.final_metrics["val_loss"] < result.epochs[0]["val_loss"]
    assert len(result.epochs) == 15 and result.steps == 15 * 13
    assert result.wall_time_s >= result.data_wait_s >= 0


class PairDataset(Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class Stream(IterableDataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __iter__(self):
        return iter(zip(self.x, self.y))


def _as(kind, x, y):
    if kind == "tuple":
        return (x, y)
    if kind == "numpy":
        return (x.numpy(), y.numpy())
    if kind == "dlpack":
        class DLPackOnly:  # an array type gpunb knows only through the DLPack protocol
            def __init__(self, t):
                self.t = t

            def __dlpack__(self, **kwargs):
                return self.t.__dlpack__(**kwargs)

            def __dlpack_device__(self):
                return self.t.__dlpack_device__()

        return (DLPackOnly(x), DLPackOnly(y))
    if kind == "tensordataset":
        return TensorDataset(x, y)
    if kind == "dataset":
        return PairDataset(x, y)
    if kind == "dataloader":
        return DataLoader(PairDataset(x, y), batch_size=16, shuffle=False)
    return Stream(x, y)


@pytest.mark.parametrize("kind", ["tuple", "numpy", "dlpack", "tensordataset", "dataset",
                                  "dataloader", "iterable"])
def test_every_data_type_trains_the_same_number_of_samples(kind):
    x, y = classification_data(n=96)
    _, result = fit(data=_as(kind, x, y), epochs=2, shuffle=False)
    assert result.samples == 192
    assert result.steps == 12


def test_numpy_data_is_taken_without_a_copy():
    from gpunb.runtime.feed.inputs import adapt_data

    x = np.random.rand(10, 3).astype(np.float32)
    tensors = adapt_data((x, np.arange(10)))
    tensors[0][0, 0] = 42.0  # shares memory with the NumPy array
    assert x[0, 0] == 42.0


def test_unshuffled_tensor_data_and_dataset_give_identical_runs():
    x, y = classification_data(n=96)
    _, a = fit(data=(x, y), epochs=2, shuffle=False)
    _, b = fit(data=PairDataset(x, y), epochs=2, shuffle=False)
    assert [h["loss"] for h in a.history] == pytest.approx([h["loss"] for h in b.history], rel=1e-6)


def test_shuffled_tensor_data_and_dataset_see_the_same_order():
    x, y = classification_data(n=96)
    _, a = fit(data=(x, y), epochs=2)
    _, b = fit(data=PairDataset(x, y), epochs=2)
    assert [h["loss"] for h in a.history] == pytest.approx([h["loss"] for h in b.history], rel=1e-6)


class LossModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = mlp()

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.net(x), y)


class HFStyle(LossModel):
    def forward(self, x, y):
        class Output:
            loss = super(HFStyle, self).forward(x, y)
        return Output()


def test_model_returning_its_loss_and_custom_step_match_loss_fn():
    _, reference = fit(max_steps=6)
    _, own_loss = fit(model=LossModel(), loss_fn=None, max_steps=6)
    _, hf = fit(model=HFStyle(), loss_fn=None, max_steps=6)
    _, custom = fit(step=lambda model, batch: nn.functional.cross_entropy(model(batch[0]), batch[1]),
                    max_steps=6)
    expected = [h["loss"] for h in reference.history]
    for result in (own_loss, hf, custom):
        assert [h["loss"] for h in result.history] == pytest.approx(expected, rel=1e-6)


def test_grad_accumulation_equals_the_large_batch():
    model_a, _ = fit(batch_size=32, max_steps=4, shuffle=False)
    model_b, result = fit(batch_size=8, grad_accum=4, max_steps=4, shuffle=False)
    assert result.steps == 4 and result.samples == 128
    for a, b in zip(model_a.parameters(), model_b.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_clipping_bounds_the_update():
    x, y = classification_data(n=64)
    start, clipped, free = mlp(), mlp(), mlp()
    for model, clip in ((clipped, 1e-3), (free, None)):
        sgd = torch.optim.SGD(model.parameters(), lr=1.0)  # SGD: the step is the gradient itself
        fit(model=model, data=(x, y), optimizer=sgd, max_steps=1, batch_size=64, clip_grad_norm=clip)

    def moved(model):
        with torch.no_grad():
            return sum((p - q).norm() ** 2 for p, q in zip(model.parameters(), start.parameters())) ** 0.5

    assert moved(clipped).item() == pytest.approx(1e-3, rel=1e-3)
    assert moved(free).item() > 10 * moved(clipped).item()


@pytest.mark.parametrize("schedule", ["one-cycle", "cosine"])
def test_lr_schedules_follow_their_shape(schedule):
    _, result = fit(lr_schedule=schedule, warmup_steps=4, epochs=4, batch_size=16, lr=1e-2)
    lrs = [h["lr"] for h in result.history]
    peak = lrs.index(max(lrs))
    assert 0 < peak < len(lrs) - 1, "warms up, then decays"
    assert lrs[-1] < 0.05 * max(lrs)
    assert max(lrs) <= 1e-2 + 1e-12


def test_custom_metrics_and_builtin_accuracy():
    x, y = classification_data(n=64)
    top2 = lambda out, target: (out.topk(2, dim=1).indices == target[:, None]).any(1).float().mean()  # noqa: E731
    _, result = fit(data=(x, y), val_data=(x, y), metrics={"top2": top2, "acc": "accuracy"}, epochs=1)
    metrics = result.final_metrics
    assert 0 <= metrics["val_acc"] <= metrics["val_top2"] <= 1


def test_early_stopping_stops_and_says_why():
    from gpunb.runtime.validation.early_stopping import EarlyStopping

    x, y = classification_data(n=64)
    _, result = fit(data=(x, y), val_data=(x, torch.randint(0, 3, (64,))), epochs=50, lr=0.05,
                    callbacks=[EarlyStopping(patience=2)])
    assert result.stop_reason.startswith("early stopping")
    assert len(result.epochs) < 50 and not result.interrupted


def test_callbacks_hear_every_event_in_order():
    events = []

    class Recorder:
        def __getattr__(self, name):
            if name.startswith("on_"):
                return lambda *args: events.append(name)
            raise AttributeError(name)

    x, y = classification_data(n=64)
    fit(data=(x, y), val_data=(x, y), epochs=2, log_every=2, callbacks=[Recorder()])
    assert events[0] == "on_fit_start" and events[-1] == "on_fit_end"
    assert events.count("on_step_end") == 8
    assert events.count("on_log") == 4
    assert events.count("on_validation_end") == 2 and events.count("on_epoch_end") == 2
    assert "on_exception" not in events


def test_exception_reaches_callbacks_and_the_caller():
    seen = []

    class Boom(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(10, 3)

        def forward(self, x, y):
            if torch.is_grad_enabled():  # in the loop, not in the no-grad check before it
                raise RuntimeError("user bug")
            return self.layer(x).sum()

    class Watcher:
        def on_exception(self, state, error):
            seen.append(str(error))

    with pytest.raises(RuntimeError, match="user bug"):
        Trainer(track=False).fit(Boom(), classification_data(), callbacks=[Watcher()])
    assert seen == ["user bug"]


def test_result_renders_deterministically():
    _, a = fit(max_steps=6, val_data=classification_data(n=32), epochs=1)
    _, b = fit(max_steps=6, val_data=classification_data(n=32), epochs=1)
    assert repr(a) == repr(b)
    assert charts_in(a._repr_html_()) and "val_loss" in a._repr_html_()
    assert isinstance(a, TrainResult) and "completed" in repr(a)


def test_result_plot_draws_the_curves():
    import matplotlib

    matplotlib.use("Agg")
    _, result = fit(max_steps=6)
    ax = result.plot()
    assert len(ax.lines) == 1 and ax.get_xlabel() == "optimizer step"


def test_activation_checkpointing_gives_the_same_gradients_and_restores_the_model():
    x, y = classification_data(n=64)
    plain, _ = fit(model=mlp(), data=(x, y), max_steps=3)
    model = mlp()
    checkpointed, _ = fit(model=model, data=(x, y), max_steps=3, activation_checkpointing=True)
    for a, b in zip(plain.parameters(), checkpointed.parameters()):
        torch.testing.assert_close(a, b)
    assert all("forward" not in child.__dict__ for child in model.children())


def test_compile_trains_the_same_model_object():
    x, y = classification_data(n=64)
    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    trained, result = fit(model=model, data=(x, y), max_steps=2, compile=True)
    assert trained is model and type(model) is nn.Sequential
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert result.steps == 2


def test_nan_loss_stops_with_the_step_and_fixes():
    x, y = classification_data(n=64)
    x[5:] = float("nan")
    with pytest.raises(GpunbError) as error:
        fit(data=(x, y), epochs=1, log_every=2, shuffle=False)
    message = str(error.value)
    assert "step 2" in message and "lr" in message and "clip_grad_norm" in message


# The front door (gpunb/trainer.py) over the runtime's one-process loop


# What a one-device fit may load beyond what a plain torch loop (forward, backward, AdamW) loads.
_HEAVY = ("cloudpickle", "IPython", "ipykernel", "ipywidgets", "jupyter_client", "jupyter_core", "jupyter_server",
          "tornado", "sqlite3", "matplotlib", "pandas", "tensorboard", "transformers", "torchmetrics", "mlflow",
          "wandb", "datasets")
_ALLOWED_NEW = {"gpunb", "torch", "psutil", "resource"}  # psutil: free host memory, for the summary


def test_a_one_process_fit_imports_nothing_of_the_launcher_or_anything_heavy():
    import json
    import os
    import subprocess
    import sys

    code = ("import json, sys, torch; from torch import nn\n"
            "x, y = torch.randn(32, 4), torch.randint(0, 2, (32,))\n"
            "plain = nn.Linear(4, 2); opt = torch.optim.AdamW(plain.parameters())\n"
            "nn.CrossEntropyLoss()(plain(x), y).backward(); opt.step()\n"
            "before = set(sys.modules)\n"
            "import gpunb\n"
            "result = gpunb.Trainer(batch_size=16, track=False).fit(nn.Linear(4, 2), (x, y), "
            "loss_fn=nn.CrossEntropyLoss())\n"
            "assert result.steps == 2, result.steps\n"
            "print(json.dumps(sorted(set(sys.modules) - before)))")
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    new = json.loads(done.stdout)
    gpunb_parts = ("gpunb.distributed", "gpunb.notebook", "gpunb.runs", "gpunb.loggers", "gpunb.profiling",
                   "gpunb.server.", "gpunb.telemetry.nvml", "gpunb.telemetry.sampler")
    assert [m for m in new if m.startswith(gpunb_parts)] == []
    assert [m for m in new if m.split(".")[0] in _HEAVY] == []
    assert {m.split(".")[0] for m in new} <= _ALLOWED_NEW


class _CountingContext:
    """A LocalContext that counts the log intervals it reduced."""

    def __init__(self):
        from gpunb.runtime.context import LocalContext

        self.inner, self.reduced = LocalContext(), 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def reduce_loss(self, mean_loss, state):
        self.reduced += 1
        return self.inner.reduce_loss(mean_loss, state)


def test_the_runtime_trains_with_the_context_and_only_the_callbacks_it_is_given(monkeypatch):
    from gpunb.config import TrainConfig
    from gpunb.runtime import run
    import gpunb.telemetry

    heard, made = [], []
    monkeypatch.setattr(gpunb.telemetry, "TelemetryCallback", lambda: made.append("telemetry") or object())

    class Listener:
        def on_fit_start(self, state):
            heard.append(type(state).__name__)

    context = _CountingContext()
    result = run(TrainConfig(batch_size=16, log_every=2, track=False), context, mlp(), classification_data(n=128),
                 loss_fn=nn.CrossEntropyLoss(), callbacks=[Listener()])
    assert context.reduced == len(result.history) == 4  # 8 steps, a log every 2
    assert heard == ["RunState"]
    assert made == []  # the defaults are the Trainer's to add
    fit(max_steps=1)
    assert made == ["telemetry"]


def test_the_trainer_adds_telemetry_and_on_rank_0_the_run_registry():
    from gpunb.config import TrainConfig
    from gpunb.runtime.context import LocalContext
    from gpunb.runtime.placement import Placement
    from gpunb.trainer import _default_callbacks

    class Rank1(LocalContext):
        rank = 1

    names = lambda found: [type(c).__name__ for c in found]  # noqa: E731
    assert names(_default_callbacks(TrainConfig(track=True), LocalContext())) == ["TelemetryCallback", "RunRecorder"]
    assert names(_default_callbacks(TrainConfig(track=False), LocalContext())) == ["TelemetryCallback"]
    assert names(_default_callbacks(TrainConfig(track=True), Rank1())) == ["TelemetryCallback"]
    # a launched rank or a job's task: its launcher or its job records the run
    placed = Placement(records=False)
    assert names(_default_callbacks(TrainConfig(track=True), LocalContext(), placed)) == ["TelemetryCallback"]


def test_the_runtime_refuses_what_is_not_a_module_before_any_work():
    from gpunb.config import TrainConfig
    from gpunb.runtime import LocalContext, run

    with pytest.raises(GpunbError, match=r"`model` must be a torch.nn.Module, got a function"):
        run(TrainConfig(), LocalContext(), lambda x: x, classification_data())


class OneWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))


def test_a_short_last_accumulation_group_weights_its_batches_by_its_real_size():
    # 10 batches, grad_accum=4: groups of 4, 4 and 2. Each batch's loss is 1.0 with gradient 1.
    model = OneWeight()
    step = lambda model, batch: (model.w - model.w.detach()).sum() + 1.0  # noqa: E731
    sgd = torch.optim.SGD(model.parameters(), lr=1.0)  # SGD: each step moves w by its gradient
    x = torch.zeros(10, 1)
    _, result = fit(model=model, data=(x, x), step=step, optimizer=sgd, batch_size=1, grad_accum=4,
                    epochs=1, shuffle=False)
    assert [h["loss"] for h in result.history] == pytest.approx([1.0, 1.0, 1.0])
    assert model.w.item() == pytest.approx(-3.0)  # three steps of mean gradient 1, the last one too


def test_auto_batch_size_leaves_the_callers_config_untouched():
    from gpunb import TrainConfig

    config = TrainConfig(batch_size="auto", epochs=1, track=False)
    result = Trainer(config).fit(mlp(), classification_data(n=64), loss_fn=nn.CrossEntropyLoss())
    assert result.batch_size_reason.startswith("auto: ")  # the probe ran and said why
    assert config == TrainConfig(batch_size="auto", epochs=1, track=False) and config.batch_size == "auto"


def test_a_failed_set_up_after_wrapping_gives_the_model_its_forwards_back(tmp_path):
    model = mlp()
    with pytest.raises(GpunbError):
        fit(model=model, max_steps=2, activation_checkpointing=True,
            checkpoint_dir=str(tmp_path), resume="last")  # no checkpoint there to resume
    assert all("forward" not in child.__dict__ for child in model.children())


def test_the_old_step_hook_name_still_works_with_one_warning_per_class():
    calls = []

    class OldStyle:
        def on_train_batch_end(self, state):
            calls.append(state.step)

    with pytest.warns(DeprecationWarning, match="OldStyle.on_train_batch_end is deprecated: name the "
                                               "hook on_step_end") as caught:
        fit(max_steps=3, callbacks=[OldStyle(), OldStyle()])
    assert calls == [1, 1, 2, 2, 3, 3]
    assert len([w for w in caught if w.category is DeprecationWarning]) == 1


def test_the_old_hook_warning_points_at_the_callbacks_own_definition():
    class Old:
        def on_train_batch_end(self, state):
            pass

    with pytest.warns(DeprecationWarning) as caught:
        fit(max_steps=1, callbacks=[Old()])
    warning = next(w for w in caught if w.category is DeprecationWarning)
    assert warning.filename == __file__ and warning.lineno == Old.on_train_batch_end.__code__.co_firstlineno


def test_a_finished_fit_lets_go_of_its_run_and_loader_workers_without_the_garbage_collector(monkeypatch):
    """The run (optimizer state, data the GPU holds, the loader's persistent workers) goes when
    fit returns, not at the garbage collector's next full pass, which may be long after."""
    import gc
    import weakref

    import psutil

    from gpunb.runtime import loop

    x, y = classification_data(n=128)
    fit(data=PairDataset(x, y), max_steps=2)  # torch's first imports inside a fit hold its frames until gc
    runs = []
    train = loop._train
    monkeypatch.setattr(loop, "_train", lambda run: runs.append(weakref.ref(run)) or train(run))
    before = {p.pid for p in psutil.Process().children()}
    gc.collect()
    gc.disable()
    try:
        _, result = fit(data=PairDataset(x, y), val_data=(x, y), epochs=2, num_workers=2)
        assert result.steps == 16
        del result
        assert runs[0]() is None
        assert not [p for p in psutil.Process().children() if p.pid not in before]
    finally:
        gc.enable()
