"""Start one process per device and drive them from this one (the notebook's kernel).

gpunb.Trainer calls `fit` here when devices > 1 and no process group exists yet; it
passes the `entry` each rank runs (entry(config, context, model, train_data, val_data,
**fit keywords, placement=) -> TrainResult, a top-level function so that spawn can pickle it).
The launcher knows nothing of Trainer. The ranks get the config as the user gave it; how each
is placed (its rank, and that the kernel records the run, not the ranks) travels beside it as
a runtime.placement.Placement.

- Start: fork while CUDA is untouched in this process (fast: nothing is pickled);
  once CUDA is initialised a forked process cannot use it, so spawn, with fit's
  arguments cloudpickled (shipping.py). torch.multiprocessing starts and joins the
  processes; a TCPStore listening on a free port of 127.0.0.1 only is the rendezvous,
  and the ranks' own gloo/NCCL sockets are kept on the loopback interface too.
- While they train: rank 0 relays its events over a queue (relay.py: the relay every run
  whose ranks train elsewhere shares, a job's too); here they update a RunState that mirrors
  rank 0's and go to the caller's callbacks (the dashboard, the run registry), which
  run in this process only. A stop asked for here
  (`state.request_stop`, the kernel's stop button) reaches the ranks through a shared
  value; they vote on it at the next log interval and stop after the same step.
- At the end rank 0's weights (and optimizer state, when an optimizer was passed) are
  loaded into the caller's objects; TrainResult.per_rank holds each rank's timings.
  This module keeps the lifetimes of the processes; what they send is relay.py's.
- A rank that raises: the others are terminated and the call raises RankFailed with
  that rank's traceback. An interrupt: the ranks stop at their next log interval and
  send their weights; any still running after INTERRUPT_GRACE_S are terminated. An
  interrupt before rank 0 has begun to train (spawned ranks take seconds to start)
  finds no weights to wait for: the ranks are terminated at once. No process outlives
  the call.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import tempfile
import time
import warnings
from queue import Empty

import torch
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException, ProcessExitedException

from gpunb.distributed import relay, worker
from gpunb.distributed.context import backend_for, check_config
from gpunb.distributed.loopback import loopback_store
from gpunb.distributed.shipping import Couriers, FitArgs, ship
from gpunb.errors import GpunbError
from gpunb.runtime.interrupt import InterruptFlag
from gpunb.runtime.result import TrainResult
from gpunb.runtime.run_state import RunState

INTERRUPT_GRACE_S = 4.0  # after a Ctrl-C, how long ranks get to reach a log interval and stop
FAILURE_GRACE_S = 1.0  # after a rank fails, how long the others get to exit before SIGTERM/SIGKILL
POLL_S = 0.05


class RankFailed(GpunbError):
    """A rank of a multi-device run raised; the message carries its traceback."""

    def __init__(self, rank: int, world_size: int, what: str, hint: str | None, remote_traceback: str):
        super().__init__(f"Rank {rank} of {world_size} failed: {what}", hint)
        self.rank, self.remote_traceback = rank, remote_traceback
        self.args = (f"{self.args[0]}\n\nTraceback on rank {rank}:\n{remote_traceback.rstrip()}",)


def needs_processes(config) -> bool:
    """True when fit must start processes: devices > 1 and no process group to join."""
    if config.devices == 1:
        return False
    import torch.distributed as dist

    if (dist.is_available() and dist.is_initialized()) or "WORLD_SIZE" in os.environ:
        return False  # under torchrun (or inside a rank): the context joins the group instead
    return plan_devices(config)[1] > 1


def plan_devices(config) -> tuple[str, int, str]:
    """(accelerator, number of processes, backend), found without initialising CUDA here."""
    from gpunb.runtime.device import mps_available

    gpus = torch.cuda.device_count()  # asks NVML before CUDA is initialised: fork stays possible
    accelerator = config.accelerator
    if accelerator == "auto":
        accelerator = "cuda" if gpus else ("mps" if mps_available() else "cpu")
    count = config.devices
    if count == "all":
        count = gpus if accelerator == "cuda" else 1
    backend = backend_for(accelerator, config.backend)
    # NCCL takes one GPU per process; gloo lets processes share them (rank r on GPU r % gpus).
    if accelerator == "cuda" and count > gpus and backend == "nccl":
        raise GpunbError(f"devices={config.devices!r} asks for {count} GPUs, but {gpus} "
                         f"{'is' if gpus == 1 else 'are'} visible.",
                         f"use `devices={gpus}` or `devices='all'`, or check CUDA_VISIBLE_DEVICES "
                         f"and `nvidia-smi`; `backend='gloo'` runs {count} processes on "
                         f"{'this GPU' if gpus == 1 else 'these GPUs'} (to try multi-process code: "
                         "slower than one process).")
    return accelerator, count, backend


def start_method() -> str:
    """fork while CUDA is untouched here (fast, nothing pickled); spawn once it is initialised."""
    return "spawn" if torch.cuda.is_initialized() else "fork"


def fit(config, entry, model, train_data, val_data=None, *, optimizer=None, scheduler=None, loss_fn=None,
        step=None, metrics=None, callbacks=(), state_type=None, method: str | None = None) -> TrainResult:
    """Train on one process per device, each running `entry`; returns rank 0's TrainResult
    (world_size = N). `callbacks` run here, in this process, on a mirror of rank 0's state
    (a `state_type`, runtime.run_state.RunState by default)."""
    devices = plan_devices(config)  # the ranks' placement; the config goes to them as the user gave it
    check_config(config, accelerator=devices[0])
    _check_arguments(model, train_data, val_data, optimizer, loss_fn, step, metrics)
    args = FitArgs(config, model, train_data, val_data, optimizer, scheduler, loss_fn, step, metrics, state_type)
    launch = _Launch(config, args, callbacks, entry, devices)
    method = method or start_method()
    try:
        return launch.run(method)
    except _ForkUnusable:
        return _Launch(config, args, callbacks, entry, devices).run("spawn")


class _ForkUnusable(Exception):
    """A forked rank found CUDA unusable (it was initialised here after all)."""


class _Launch:
    def __init__(self, config, args: FitArgs, callbacks, entry, devices: tuple[str, int, str]):
        self.config, self.args, self.entry = config, args, entry
        self.accelerator, self.count, self.backend = devices  # plan_devices: "auto" and "all" resolved
        self.state = (args.state_type or RunState)(
            config=config, model=args.model, optimizer=args.optimizer,
            device=torch.device("cpu"), run_name=config.name or type(args.model).__name__, world_size=self.count)
        self.mirror = relay.Mirror(self.state, callbacks)
        self.callbacks = self.mirror.callbacks
        self.reports: dict = {}  # rank -> its report (relay.rank_report)
        self.errors: list = []  # (rank, description) in arrival order
        self.fork_unusable = False  # a forked rank found CUDA unusable: start again with spawn
        self.forwarded = relay.RUN
        self.abandoned = None  # why the ranks were terminated before they could report, if they were

    def run(self, method: str) -> TrainResult:
        context = mp.get_context(method)
        # Forked ranks inherit the arguments; spawned ones read theirs from a pipe each.
        couriers = None if method == "fork" else Couriers(ship(self.args), self.count, context)
        queue, stop = context.Queue(), context.Value("i", relay.RUN, lock=False)
        store = loopback_store()
        scratch = tempfile.TemporaryDirectory(prefix="gpunb-launch-")
        plan = worker.RankPlan(entry=self.entry, world_size=self.count, port=store.port, method=method,
                           accelerator=self.accelerator, backend=self.backend,
                           threads=_threads_per_rank(self.count),
                           weights_path=os.path.join(scratch.name, "weights.pt"),
                           return_optimizer=self.args.optimizer is not None)
        try:
            self._drive(plan, couriers or self.args, queue, stop)
            if self.fork_unusable:
                raise _ForkUnusable
            try:
                return self._finish(plan)
            except BaseException as error:  # callbacks that heard the start hear the end (the run registry)
                self.callbacks.call("on_exception", self.state, error)
                raise
        finally:
            if couriers is not None:
                couriers.close(timeout=FAILURE_GRACE_S)
            queue.close()
            del store
            scratch.cleanup()

    def _drive(self, plan, payload, queue, stop) -> None:
        """Start the ranks and follow them to the end; none is left running afterwards."""
        processes = None
        try:
            with InterruptFlag() as interrupt:
                processes = _start(plan, payload, queue, stop)
                if isinstance(payload, Couriers):
                    payload.send()
                self._watch(processes, queue, stop, interrupt)
        except KeyboardInterrupt:  # a second Ctrl-C: stop the ranks now, keep the weights as they are
            self.state.request_stop("interrupted")
            self.abandoned = "a second interrupt stopped the ranks at once"
        except _ForkUnusable:
            raise
        except BaseException as error:
            self.callbacks.call("on_exception", self.state, error)
            raise
        finally:
            _end(processes)

    def _watch(self, processes, queue, stop, interrupt) -> None:
        deadline = None
        while True:
            self._drain(queue, timeout=POLL_S)
            if interrupt.raised and deadline is None:
                self.state.request_stop("interrupted")
                # Rank 0 has not begun to train: no weights to wait for; a spawned rank may already be dead of it.
                if not self.mirror.started:
                    self.abandoned = "the interrupt came while the ranks were starting, so they were stopped at once"
                    break
                deadline = time.monotonic() + INTERRUPT_GRACE_S
            if self.state.should_stop and self.forwarded == relay.RUN:
                self.forwarded = relay.INTERRUPT if self.state.stop_reason == "interrupted" else relay.STOP
                stop.value = self.forwarded
            try:
                if processes.join(timeout=0, grace_period=FAILURE_GRACE_S):
                    break
            except ProcessException as error:
                self._drain(queue, timeout=0)
                if interrupt.raised and not self.mirror.started:
                    continue  # the interrupt killed a starting rank: the check above ends the launch
                raise self._failure(error, processes) from None
            if deadline is not None and time.monotonic() > deadline:
                self.abandoned = (f"the ranks did not stop within {INTERRUPT_GRACE_S:.0f} s of the interrupt "
                                  "(they stop at a log interval; a smaller `log_every` makes stops quicker) "
                                  "and were terminated")
                break
        self._drain(queue, timeout=0)

    def _drain(self, queue, timeout: float) -> None:
        """Handle every message waiting (waiting up to `timeout` for the first)."""
        while True:
            try:
                kind, rank, body = queue.get(timeout=timeout) if timeout else queue.get_nowait()
            except Empty:
                return
            timeout = 0
            if kind == "event":
                self.mirror.receive(body)
            elif kind == "done":
                self.reports[rank] = body
            elif kind == "error":
                self.errors.append((rank, body))
            elif kind == "fork-unusable":
                self.fork_unusable = True

    def _failure(self, error: ProcessException, processes=None) -> GpunbError:
        """The error that explains the failure: a rank's own error first, then a rank killed by
        a signal, and only then the lost-peer errors the other ranks got because of it."""
        if self.fork_unusable:
            return _ForkUnusable()
        reported = self.errors
        cause = next((e for e in reported if not _lost_peer(e[1])), None)
        killed = _killed_rank(processes, {rank for rank, _ in reported})
        if cause is None and killed is not None:
            rank, name = killed
            return GpunbError(f"Rank {rank} of {self.count} died (killed by {name}) without raising a "
                              "Python error; the other ranks lost their peer and were stopped.",
                              _DIED_HINT)
        if reported:
            rank, info = cause or reported[0]
            what = info.get("what") or f"{info['type']}: {info['message']}"
            hint = info.get("hint") or ("the traceback below is from that rank; the other ranks "
                                        "were stopped. Fix the error, then run the cell again.")
            return RankFailed(rank, self.count, what, hint, info["traceback"])
        if isinstance(error, ProcessExitedException):
            return GpunbError(f"Rank {error.error_index} of {self.count} died ({error.msg}) without "
                              f"raising a Python error.", _DIED_HINT)
        return RankFailed(error.error_index, self.count, "it raised", None, str(error))

    def _finish(self, plan: worker.RankPlan) -> TrainResult:
        state = self.state
        missing = [r for r in range(self.count) if r not in self.reports]
        if missing and not self.abandoned:
            raise GpunbError(f"Rank(s) {missing} of {self.count} exited without finishing the run.",
                             "run the cell again; if it repeats, run with devices=1 to see the error.")
        if 0 in self.reports and os.path.exists(plan.weights_path):
            result = self.reports[0]["result"]
            result.ema_state_dict = self.mirror.weights_back(plan.weights_path)
        else:
            result = self._result_without_rank0()
        relay.with_ranks(result, list(self.reports.values()))
        if result.stop_reason and state.stop_reason:  # stopped from here: say why in our words
            result.stop_reason = state.stop_reason
            result.interrupted = state.stop_reason == "interrupted"
        state.result = result
        self.callbacks.call("on_fit_end", state)
        return result

    def _result_without_rank0(self) -> TrainResult:
        state = self.state
        checkpoint = state.checkpoint_path
        warnings.warn(f"gpunb: {self.abandoned}; the model keeps the weights it had before this run"
                      + (f" (the latest checkpoint is {checkpoint})." if checkpoint else "."),
                      RuntimeWarning, stacklevel=5)
        return TrainResult.from_state(state, world_size=self.count, interrupted=True, stop_reason="interrupted")


def _check_arguments(model, train_data, val_data, optimizer, loss_fn, step, metrics) -> None:
    """The checks a single-process fit makes first, here, before any process starts."""
    from gpunb.runtime.feed.inputs import adapt_data
    from gpunb.runtime.step.objective import Objective
    from gpunb.runtime.step.optimizer import check_optimizer

    Objective(loss_fn, step, metrics)
    adapt_data(train_data, "train_data")
    if val_data is not None:
        adapt_data(val_data, "val_data")
    if optimizer is not None:
        check_optimizer(optimizer, model)


def _threads_per_rank(count: int) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // count)


_DIED_HINT = ("SIGKILL usually means the host ran out of memory (fewer devices, a smaller batch "
              "or fewer DataLoader workers help); SIGSEGV/SIGABRT a crash in native code (check "
              "driver and library versions).")


def _killed_rank(processes, reporting: set) -> tuple[int, str] | None:
    """A rank that a signal ended (the OOM killer's SIGKILL first; our own SIGTERM of the
    survivors last), among those that sent no error of their own."""
    import signal

    if processes is None:
        return None
    killed = [(rank, -process.exitcode) for rank, process in enumerate(processes.processes)
              if rank not in reporting and process.exitcode is not None and process.exitcode < 0]
    killed.sort(key=lambda found: found[1] == signal.SIGTERM)
    if not killed:
        return None
    rank, number = killed[0]
    try:
        name = signal.Signals(number).name
    except ValueError:
        name = f"signal {number}"
    return rank, name


def _lost_peer(info: dict) -> bool:
    """An error a rank gets because another rank died under it."""
    text = f"{info['type']} {info['message']}"
    return info["type"] in ("DistBackendError", "DistNetworkError") or any(
        sign in text for sign in ("Connection closed by peer", "Connection reset by peer",
                                  "Broken pipe", "NCCL communicator was aborted"))


def _start(plan: worker.RankPlan, payload: FitArgs | Couriers, queue, stop):
    if plan.method == "fork":
        # The forked ranks must never collect this process's garbage: finalising a copy of an
        # object that owned a thread here (a store, a loader from an earlier cell) hangs there.
        gc.freeze()
        try:
            return mp.start_processes(worker.run_rank, args=(plan, payload, queue, stop),
                                      nprocs=plan.world_size, join=False, start_method="fork")
        finally:
            gc.unfreeze()
    with _main_module_hidden():
        return mp.start_processes(worker.run_rank, args=(plan, payload.readers, queue, stop),
                                  nprocs=plan.world_size, join=False, start_method="spawn")


@contextlib.contextmanager
def _main_module_hidden():
    """A spawned rank gets everything from the payload, so multiprocessing need not run the
    caller's main module again in it (the kernel's launcher, or a script, which without an
    `if __name__ == "__main__"` guard would start training again there)."""
    main = sys.modules["__main__"]
    saved = {name: main.__dict__[name] for name in ("__spec__", "__file__") if name in main.__dict__}
    main.__spec__ = None
    main.__dict__.pop("__file__", None)
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


def _end(processes) -> None:
    """No rank outlives the call: SIGTERM what still runs, then SIGKILL, and reap all."""
    if processes is None:
        return
    for process in processes.processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + FAILURE_GRACE_S
    for process in processes.processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()
