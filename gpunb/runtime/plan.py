"""RunPlan: what the runtime decided for one fit, and why, beside the TrainConfig the user gave.

The config stays what was asked ("auto" batch size, "auto" precision, epochs counted from
where a continued fit starts); the plan holds the answers, made once in set-up
(prepare.py) and read by the loop, the checkpoints, the callbacks and the result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RunPlan:
    device: torch.device
    precision: str  # "bf16-mixed", "16-mixed" or "32"
    precision_reason: str  # one line saying why this precision
    batch_size: int  # samples per micro-batch as loaded (a user's DataLoader's own size)
    batch_size_reason: str = ""  # how batch_size="auto" chose it ("" when it was given)
    batch_probe: tuple = ()  # batch_size="auto": what each probed size did
    epochs: int | None = None  # as asked (None: 1, or as many as max_steps needs); a continued fit's count on
    max_steps: int | None = None  # the step to stop at (a continued fit's counts on from its start)
    steps_per_epoch: int | None = None  # None: data of unknown length
    total_steps: int | None = None  # optimizer steps the run will take, when known
    log_every: int = 1  # steps between metric reads (the only host syncs)
    compile: object = "auto"  # what was asked of torch.compile; compiling.py decides when (result.compilation)
    strategy: str | None = None  # devices > 1: "ddp" or "fsdp" ("auto" resolved by the memory plan); None: one
    strategy_reason: str = ""  # why: "asked for", or under "auto" the memory estimate's numbers
    # where checkpoints go and what the run resumes from: the config's, or its placement's
    # (runtime/placement.py: a job's folder, a requeued job's newest checkpoint); the config keeps
    # what the user gave
    checkpoint_dir: str | None = None
    resume: bool | str | None = None

    @property
    def epoch_limit(self) -> int:
        return epoch_limit(self.epochs, self.max_steps)

    def settings(self, config) -> dict:
        """The config as the run used it: the user's, with the decisions above filled in."""
        strategy = {"strategy": self.strategy} if self.strategy is not None else {}
        return {**config.to_dict(), "batch_size": self.batch_size, "precision": self.precision,
                "log_every": self.log_every, "epochs": self.epochs, "max_steps": self.max_steps, **strategy}


def length(config, num_batches: int | None, continued=None) -> dict:
    """epochs, max_steps, steps_per_epoch and total_steps of a fit; `continued`: the ContinueState
    of the fit it goes on from, whose step and epoch count the new ones on."""
    epochs, max_steps = config.epochs, config.max_steps
    if continued is not None:
        if config.max_steps is not None:
            max_steps = continued.step + config.max_steps
        if config.epochs is not None or config.max_steps is None:
            epochs = continued.next_epoch + (config.epochs or 1)
    steps_per_epoch = math.ceil(num_batches / config.grad_accum) if num_batches is not None else None
    total_steps = steps_per_epoch * epoch_limit(epochs, max_steps) if steps_per_epoch is not None else None
    if max_steps is not None:
        total_steps = min(total_steps or max_steps, max_steps)
    return {"epochs": epochs, "max_steps": max_steps, "steps_per_epoch": steps_per_epoch,
            "total_steps": total_steps}


def epoch_limit(epochs: int | None, max_steps: int | None) -> int:
    """Epochs the loop may run: `epochs`, else unbounded under max_steps, else 1."""
    if epochs is not None:
        return epochs
    return 2**62 if max_steps is not None else 1
