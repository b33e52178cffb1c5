"""The body of each process launch.py starts: one rank of the run.

It joins the process group (the parent's TCPStore is the rendezvous), runs the plan's
`entry` with this rank's context (the runtime then wraps the model in DDP / FSDP), and
leaves its report on the queue (relay.py). Rank 0 also relays its events to the parent over
that queue and brings the parent's stop requests in.
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gpunb.distributed.loopback import HOST, keep_sockets_on_loopback
from gpunb.distributed.relay import QueueChannel, RelayWriter, describe, rank_report, write_weights
from gpunb.distributed.shipping import FitArgs, receive
from gpunb.runtime.placement import Placement


@dataclass
class RankPlan:
    """How the ranks of one launch find each other, what they run and where they leave their results."""

    entry: object  # entry(config, context, model, train_data, val_data, **fit keywords, placement=) -> TrainResult
    world_size: int
    port: int  # of the parent's TCPStore on HOST
    method: str  # "fork" or "spawn"
    accelerator: str  # "cuda" or "cpu"
    backend: str  # "nccl" or "gloo"
    threads: int  # CPU threads per rank (the cores shared out)
    weights_path: str  # where rank 0 writes the final weights
    return_optimizer: bool  # also the optimizer's state (the caller passed an optimizer)


def run_rank(rank: int, plan: RankPlan, payload, queue, stop) -> None:
    """Started by torch.multiprocessing.start_processes as fn(rank, *args)."""
    _own_signals()
    torch.set_num_threads(plan.threads)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(plan.world_size),
                      LOCAL_WORLD_SIZE=str(plan.world_size), MASTER_ADDR=HOST, MASTER_PORT=str(plan.port))
    keep_sockets_on_loopback()
    try:
        if plan.method == "fork" and plan.accelerator == "cuda" and torch.cuda._is_in_bad_fork():
            # CUDA was set up in the parent after all (e.g. by torch.cuda.is_available()):
            # a forked process cannot use it. The parent starts again with spawn.
            queue.put(("fork-unusable", rank, None))
            return
        args = payload if isinstance(payload, FitArgs) else receive(payload, rank)
        _join_group(rank, plan)
        queue.put(("done", rank, _fit(rank, plan, args, queue, stop)))
    except BaseException as error:
        queue.put(("error", rank, describe(error)))
        raise  # torch.multiprocessing records the traceback and exits with 1
    _exit_now(queue)


def _exit_now(queue) -> None:
    """Leave without tearing the process group down. Its gloo threads may still be
    releasing work that holds Python objects, which needs the GIL: destroying the group
    (joining those threads with the GIL held) can deadlock, and interpreter shutdown can
    abort. The parent has everything it needs once the queue is flushed."""
    queue.close()
    queue.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _own_signals() -> None:
    """Only the parent answers Ctrl-C and the kernel's stop button: it forwards a stop that
    the ranks then carry out together. So leave the parent's process group (the kernel
    signals the whole group), and die with the parent if it dies."""
    os.setpgrp()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a forked rank inherits the parent's
    try:
        from torch.multiprocessing import _prctl_pr_set_pdeathsig
    except ImportError:  # not Linux, or a torch without it: the parent's clean-up still applies
        return
    _prctl_pr_set_pdeathsig(signal.SIGKILL)


def _join_group(rank: int, plan: RankPlan) -> None:
    store = dist.TCPStore(HOST, plan.port, is_master=False)
    if plan.backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(plan.backend, store=store, rank=rank, world_size=plan.world_size)


def _fit(rank: int, plan: RankPlan, args: FitArgs, queue, stop) -> dict:
    from gpunb.distributed.context import current_context
    from gpunb.runtime.device import select_device

    model, optimizer = args.model, args.optimizer
    if optimizer is not None and optimizer.state:
        # Shipped from a GPU its state arrived on the CPU: move it next to the parameters.
        model.to(select_device(plan.accelerator, rank))
        optimizer.load_state_dict(optimizer.state_dict())
    callbacks = [RelayWriter(QueueChannel(queue, stop))] if rank == 0 else []
    context = current_context(args.config)  # after the fit it holds the strategy set-up resolved ("auto")
    # The registry is written by the parent, from rank 0's relayed events, not by the ranks.
    placement = Placement(rank=rank, world_size=plan.world_size, local_rank=rank, records=False)
    result = plan.entry(args.config, context, model, args.train_data, args.val_data,
                        optimizer=optimizer, scheduler=args.scheduler, loss_fn=args.loss_fn, step=args.step,
                        metrics=args.metrics, callbacks=callbacks, state_type=args.state_type, placement=placement)
    # Every rank takes part (FSDP gathers the shards); rank 0 writes the weights, the parent loads them.
    write_weights(plan.weights_path, context, model, optimizer if plan.return_optimizer else None, result)
    return rank_report(rank, result)
