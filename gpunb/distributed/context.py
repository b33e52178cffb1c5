"""Where this process stands in a (possibly) distributed run, and what differs there.

`current_context(config)` is what gpunb.Trainer asks when a process group may exist.
It is the runtime's `LocalContext` unless this process is one rank of a process group:
one started by gpunb's launcher (launch.py), or one torchrun describes in the
environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), which is then
joined here. The loop calls the same methods
on either (see runtime/context.py), so it reads the same in both cases:

    reduce_loss(mean_loss, state)  the log interval's one sync (and, in a group, its stop vote)
    sync_stop(state)               the vote alone, at an epoch's end
    reduce_sums(sums, count)       validation means over all ranks
    use_strategy(strategy)         the strategy set-up resolved ("auto": FSDP when only sharded fits), before wrap
    wrap(model, device)            DDP, or FSDP2 sharding (then adopt_shards: the optimizer)
    grad_scaler                    FSDP's fp16 loss scaler, given to Precision when it is built
    state_dicts / load_*           checkpoints (FSDP gathers to rank 0 and scatters back)
"""

from __future__ import annotations

import os

import torch

from gpunb.errors import GpunbError
from gpunb.runtime.context import LocalContext, optimizer_state_by_index
from gpunb.runtime.trainable import load_weights

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class ProcessGroupRank:
    """One rank of an initialised torch.distributed process group (DDP or FSDP)."""

    stops_by_vote = True  # ranks vote on a stop at the next log interval (RunState.request_stop)

    def __init__(self, strategy: str):
        import torch.distributed as dist

        self.dist = dist
        self.strategy = "ddp" if strategy == "auto" else strategy  # "auto": DDP unless set-up shards (use_strategy)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        self.device = torch.device("cpu")  # set by wrap(); where collectives' tensors live
        self._sharded = None  # FSDP: the model and its (old parameter, sharded parameter) pairs
        self._last_work = None  # the latest collective (see _all_reduce)

    def reduce_loss(self, mean_loss: torch.Tensor, state) -> float:
        """Mean loss over ranks; the same all_reduce carries the stop vote (one sync)."""
        votes = self._votes(state, mean_loss.device)
        values = torch.cat([mean_loss.detach().float().reshape(1), votes])
        self._all_reduce(values)
        loss, stops, interrupts = values.tolist()  # the interval's one host-device sync
        state.apply_vote(stops, interrupts)
        return loss / self.world_size

    def sync_stop(self, state) -> None:
        votes = self._votes(state, self.device)
        self._all_reduce(votes)
        state.apply_vote(*votes.tolist())

    def smallest(self, value: int) -> int:
        """The smallest of the ranks' values (e.g. each rank's automatic batch size)."""
        tensor = torch.tensor([value], device=self._collective_device())
        self._all_reduce(tensor, op=self.dist.ReduceOp.MIN)
        return int(tensor.item())

    def reduce_sums(self, sums: dict, count: int) -> dict:
        """Means over every rank's samples: the sums and the count in one all_reduce."""
        if not sums:
            return {}
        values = torch.stack([v.float().reshape(()) for v in sums.values()])
        values = torch.cat([values, values.new_tensor([float(count)])])
        self._all_reduce(values)
        values = values.cpu()
        return dict(zip(sums, (values[:-1] / max(1.0, values[-1].item())).tolist()))

    def use_strategy(self, strategy: str) -> None:
        """The strategy set-up resolved (strategy="auto": the memory plan's choice); called before
        wrap(), the same on every rank. The checkpoints and the weights returned read it too."""
        self.strategy = strategy

    def wrap(self, model, device):
        self.device = device
        if self.strategy == "fsdp":
            from gpunb.distributed import fsdp

            self._sharded = fsdp.shard(model, device, self.world_size)
            return model
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                       gradient_as_bucket_view=True)

    @property
    def grad_scaler(self):
        """FSDP: fp16 loss scaling must skip a step on every rank when any rank's shard of
        the gradients holds inf/NaN (each rank sees only its shard). None: torch's own."""
        if self.strategy != "fsdp":
            return None
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler

    def adopt_shards(self, optimizer) -> None:
        """FSDP swapped the model's parameters for sharded ones: point the optimizer at those."""
        if self._sharded is None:
            return
        from gpunb.distributed import fsdp

        fsdp.rebind_optimizer(optimizer, *self._sharded)
        self._sharded = None

    def state_dicts(self, model, optimizer) -> tuple[dict | None, dict | None]:
        """Full model and optimizer (when given) state on rank 0, None elsewhere; every rank
        must call it."""
        if self.strategy == "fsdp":
            from gpunb.distributed import fsdp

            return fsdp.full_state_dicts(model, optimizer, self.rank)
        if self.rank != 0:
            return None, None
        return model.state_dict(), optimizer.state_dict() if optimizer is not None else None

    def load_model_state(self, model, state: dict) -> None:
        if self.strategy == "fsdp":
            from gpunb.distributed import fsdp

            fsdp.load_model_state(model, state)
        else:
            load_weights(model, state)  # a checkpoint may hold only what trains

    def load_optimizer_state(self, model, optimizer, state: dict) -> None:
        if self.strategy == "fsdp":
            from gpunb.distributed import fsdp

            fsdp.load_optimizer_state(model, optimizer, state)
        else:
            optimizer.load_state_dict(optimizer_state_by_index(state, model, optimizer))

    def _all_reduce(self, tensor: torch.Tensor, op=None) -> None:
        work = self.dist.all_reduce(tensor, op=op or self.dist.ReduceOp.SUM, async_op=True)
        work.wait()
        # Hold the work until the next one, so that it dies on this thread. Left to gloo's
        # worker thread, the last reference to a tensor made in Python needs the GIL, and
        # at interpreter exit that aborts ("terminate called without an active exception").
        self._last_work = work

    def _votes(self, state, device) -> torch.Tensor:
        pending = state.pending_stop
        return torch.tensor([float(pending is not None), float(pending == "interrupted")], device=device)

    def _collective_device(self) -> torch.device:
        if self.dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def current_context(config):
    """The distributed context of this process (single process unless a group is running)."""
    import torch.distributed as dist

    if not dist.is_available():
        return LocalContext()
    if not dist.is_initialized():
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return LocalContext()
        join_torchrun_group(config)
    if dist.get_world_size() == 1:
        return LocalContext()
    check_config(config)
    return ProcessGroupRank(config.strategy)


def join_torchrun_group(config) -> None:
    """init_process_group from torchrun's environment (env://); no processes are started."""
    import torch.distributed as dist

    missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
    if missing:
        raise GpunbError(f"WORLD_SIZE={os.environ['WORLD_SIZE']} is set, but not "
                         f"{', '.join(missing)}: this does not look like a complete torchrun environment.",
                         "start the script with `torchrun --nproc-per-node N script.py` (or srun with "
                         "all of RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT set), or unset "
                         "WORLD_SIZE to train in one process.")
    backend = backend_for(config.accelerator, config.backend)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    dist.init_process_group(backend, init_method="env://")


def backend_for(accelerator: str, backend: str = "auto") -> str:
    """The process group's backend on `accelerator`: the one asked for, else NCCL between
    GPUs and gloo between CPU processes."""
    if accelerator == "auto":
        accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    if backend == "auto":
        return "nccl" if accelerator == "cuda" else "gloo"
    if backend == "nccl" and accelerator != "cuda":
        raise GpunbError("backend='nccl' connects CUDA GPUs, and this run has none "
                         f"(accelerator {accelerator!r}).",
                         "use `backend='gloo'` (or 'auto') between CPU processes, or check `nvidia-smi` "
                         "and CUDA_VISIBLE_DEVICES.")
    return backend


def check_config(config, accelerator: str | None = None) -> None:
    """Settings that cannot work with several ranks, caught before any process starts
    (`accelerator`: the one the launcher resolved "auto" to)."""
    if config.strategy == "fsdp" and config.batch_size == "auto":
        raise GpunbError("batch_size='auto' is not available with strategy='fsdp': the probe would "
                         "run the whole, unsharded model on one device, which is what FSDP avoids.",
                         "pass the per-device batch size, e.g. `batch_size=8`.")
    if config.strategy == "fsdp" and config.ema is not None:
        raise GpunbError("ema is not available with strategy='fsdp': the average is kept beside whole "
                         "parameters, and FSDP shards them across ranks.",
                         "use `strategy='ddp'` with `ema`, or train without `ema` under FSDP.")
    if (accelerator or config.accelerator) == "mps":
        raise GpunbError("Apple MPS has one device; devices > 1 cannot use it.",
                         "use `devices=1`, or `accelerator='cpu'` for several CPU processes.")
