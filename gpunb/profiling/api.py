"""gpunb.profiling.profile and ProfilerCallback: capture -> analysis -> advice."""

from __future__ import annotations

import os

import torch

from gpunb.errors import GpunbError
from gpunb.profiling import analysis, trace
from gpunb.profiling.advice import advise
from gpunb.profiling.capture import Recorder, session_steps
from gpunb.profiling.report import ProfileResult
from gpunb.runtime.roles import OPTIONAL_SETUP



def profile(target=None, *, train: dict | None = None, steps: int = 10, warmup: int = 2,
            save: str | os.PathLike | None = None, device=None) -> ProfileResult:
    """Profile `steps` steps and say what to change.

    `warmup` steps run first unrecorded, then one while the profiler starts (not counted).

    - `profile(fn)`: calls `fn()` once per step, e.g. `profile(lambda: train_step(batch))`.
    - `profile(train=dict(model=..., train_data=..., config=..., **fit_kwargs))`: runs that
      many optimizer steps of `gpunb.Trainer` (validation skipped, one device, no
      checkpoints) and splits each step into data wait, h2d copy, forward, backward,
      optimizer and other. The model's weights and the optimizer's state are put back
      afterwards: profiling does not train your model.

    `save`: a directory to write the chrome/Perfetto trace to (its path is in the report).
    `device`: where `fn` runs (default: CUDA when available) or the Trainer's accelerator.
    """
    check_options(steps, warmup, save)
    if target is not None and train is not None:
        raise GpunbError("profile() got both a callable and train=; it profiles one of them.",
                         "pass either `profile(fn)` or `profile(train=dict(model=..., train_data=...))`.")
    if train is not None:
        return _profile_training(train, steps, warmup, save, device)
    if target is None:
        raise GpunbError("Nothing to profile.",
                         "pass a function to call once per step, e.g. `profile(lambda: step(batch))`, "
                         "or `train=dict(model=model, train_data=data)` to profile training steps.")
    if not callable(target):
        raise GpunbError(f"The target must be a callable (called once per step), got a {type(target).__name__}.",
                         "wrap the work in a function: `profile(lambda: model(x).sum().backward())`.")
    recorder = Recorder(_callable_device(device), steps=steps, warmup=warmup, save=save)
    recorder.start()
    try:
        while not recorder.done:
            target()
            recorder.step()
    finally:
        recorder.stop()
    return summarise(recorder, kind="callable")


class ProfilerCallback:
    """A Trainer callback that profiles `steps` optimizer steps after `warmup` ones.

    >>> cb = ProfilerCallback(steps=10)
    >>> Trainer(...).fit(model, data, callbacks=[cb]); cb.result()

    It asks the loop to mark its phases (`state.profile`) and, with `stop=True`,
    stops the run once the profiled steps are done.
    """

    def __init__(self, steps: int = 10, warmup: int = 2, save: str | os.PathLike | None = None,
                 stop: bool = True):
        check_options(steps, warmup, save)
        self.steps, self.warmup, self.save, self.stop = steps, warmup, save, stop
        self.total_steps = session_steps(steps, warmup)  # optimizer steps it takes
        self.recorder: Recorder | None = None
        self._result: ProfileResult | None = None

    def on_fit_start(self, state) -> None:
        state.profile = True
        self._result = None
        self.recorder = Recorder(state.device, steps=self.steps, warmup=self.warmup, save=self.save)
        batch_size = getattr(state.config, "batch_size", None)
        self.recorder.batch_size = batch_size if isinstance(batch_size, int) else None
        self.recorder.start()

    def on_step_end(self, state) -> None:
        if self.recorder is not None and not self.recorder.done and self.recorder.step():
            state.profile = False
            _note_trace(state, self.recorder)
            if self.stop:
                state.request_stop(f"profiled {self.steps} steps")

    def on_fit_end(self, state) -> None:
        self._end(state)

    def on_exception(self, state, error) -> None:
        self._end(state)

    def _end(self, state) -> None:
        state.profile = False
        if self.recorder is not None:
            self.recorder.stop()
            _note_trace(state, self.recorder)

    def result(self) -> ProfileResult:
        """The ProfileResult of the profiled steps (after `fit` returned)."""
        if self.recorder is None:
            raise GpunbError("This ProfilerCallback has not profiled anything yet.",
                             "pass it to `Trainer.fit(..., callbacks=[callback])` first.")
        if self._result is None:
            self._result = summarise(self.recorder, kind="training")
        return self._result


def _note_trace(state, recorder: Recorder) -> None:
    """Where the trace is, for the loggers (TensorBoardLogger copies it into its log directory)."""
    if recorder.trace_path is not None:
        state.extras["profile_trace"] = recorder.trace_path


def summarise(recorder: Recorder, kind: str) -> ProfileResult:
    """Analyse a finished Recorder's trace and attach the advice."""
    recorder.stop()
    events = None
    if recorder.trace_path is not None:
        try:
            events = trace.load(recorder.trace_path)
        finally:
            recorder.cleanup()
        events.steps = events.steps[1:]  # the extra first step: the profiler starting up (see capture)
        if not recorder.done:
            events.steps = events.steps[:-1]  # the run ended early: the last step is unfinished
    if events is None or not events.steps:
        raise GpunbError(f"No step was profiled: the run ended after {recorder.calls} step(s), "
                         f"before the {recorder.warmup} warmup step(s) and the profiler's start-up step "
                         "were over.", "lower `warmup`, or give the run more data or steps.")
    caps = recorder.caps
    result = analysis.analyse(events, kind=kind, device=_describe(recorder.device, caps),
                              device_total=caps.total_memory, batch_size=recorder.batch_size)
    if result.device_time is not None:
        result.device_time.nvml_util_pct = recorder.nvml_util
        result.device_time.nvml_read = recorder.nvml_read
    result.advice = advise(result, caps)
    result.trace_path = recorder.trace_path if recorder.save is not None else None
    if result.steps < recorder.steps:
        result.notes.append(f"profiled {result.steps} of the {recorder.steps} steps asked for (the run ended early)")
    return result


def _profile_training(train, steps, warmup, save, device) -> ProfileResult:
    from gpunb.config import TrainConfig, make_config
    from gpunb.runtime.context import LocalContext
    from gpunb.runtime.loop import run
    from gpunb.runtime.roles import check_model
    from gpunb.runtime.state import rewind

    if not isinstance(train, dict):
        raise GpunbError(f"train= must be a dict, got a {type(train).__name__}.",
                         "pass `train=dict(model=model, train_data=data, config=TrainConfig(...))`.")
    spec = dict(train)
    model, data, config = spec.pop("model", None), spec.pop("train_data", None), spec.pop("config", None)
    if model is None or data is None:
        raise GpunbError("train= needs at least `model` and `train_data`; got "
                         + (", ".join(f"`{k}`" for k in train) or "nothing") + ".",
                         "pass `train=dict(model=model, train_data=data)`.")
    unknown = sorted(set(spec) - set(OPTIONAL_SETUP))
    if unknown:
        raise GpunbError(f"train= got unknown keys: {', '.join(unknown)}.",
                         "use model, train_data, config and the fit() keywords: " + ", ".join(OPTIONAL_SETUP) + ".")
    if isinstance(config, dict):
        config = make_config(None, **config)
    elif config is not None and not isinstance(config, TrainConfig):
        raise GpunbError(f"train['config'] must be a TrainConfig or a dict, got a {type(config).__name__}.",
                         "pass e.g. `config=TrainConfig(batch_size=64)` or `config=dict(batch_size=64)`.")
    config = config or TrainConfig()
    spec.pop("val_data", None)  # profiles training steps; validation would blur them
    callback = ProfilerCallback(steps, warmup, save)
    # epochs=None: as many epochs as the steps need, however small the data set
    overrides = dict(max_steps=callback.total_steps, epochs=None, checkpoint_dir=None, resume=None,
                     track=False, devices=1)
    if config.log_every == "auto":
        # "auto" reads the metrics (a host sync) about a hundred times a run: for a session of a
        # few steps that would be every step, which the real run does not do. Read them once,
        # after the recorded steps.
        overrides["log_every"] = callback.total_steps
    if device is not None:
        overrides["accelerator"] = _torch_device(device).type
    config = make_config(config, **overrides)
    check_model(model)
    # Put the weights and optimizer state back afterwards (anything else, the runtime rejects).
    optimizer = spec.get("optimizer") if isinstance(spec.get("optimizer"), torch.optim.Optimizer) else None
    saved = rewind.capture(model, optimizer)
    try:
        # One process, the profiler's callback only (no telemetry thread beside the profiled steps).
        run(config, LocalContext(), model, data, callbacks=[callback], **spec)
    finally:
        rewind.restore(saved, model, optimizer)
    return callback.result()


def check_options(steps, warmup, save=None) -> None:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise GpunbError(f"steps must be a positive integer, got {steps!r}.", "pass e.g. `steps=10`.")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise GpunbError(f"warmup must be an integer >= 0, got {warmup!r}.", "pass e.g. `warmup=2`.")
    if save is not None and os.path.isfile(save):
        raise GpunbError(f"save={str(save)!r} is a file; the trace goes into a directory.",
                         "pass a directory, e.g. `save='profiles'` (it is created if missing).")


def _torch_device(device) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise GpunbError(f"Unknown device {device!r}.", "use e.g. `device='cuda'` or `device='cpu'`.") from error


def _callable_device(device) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = _torch_device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise GpunbError(f"device={device!r} was asked for, but PyTorch sees no CUDA GPU.",
                         "leave `device` out (CUDA when there is one, else CPU) or pass `device='cpu'`.")
    return resolved


def _describe(device: torch.device, caps) -> str:
    return f"{device} ({caps.name})" if caps.gpu else str(device)
