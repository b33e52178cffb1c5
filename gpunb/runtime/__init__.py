"""The managed training runtime: pure PyTorch, no IPython, no Jupyter.

`run(config, dist, model, ...)` trains in this process; gpunb.Trainer (the front door, one
layer up) picks the context (`dist`: runtime/context.py, or one rank's, distributed/context.py)
and the default callbacks and calls it.

Rooms along the path of one step, each importing only those above it in this list
(docs/architecture.md maps every module):

    events.py, context.py, device.py, roles.py, matching.py, trainable.py,
    run_state.py (RunState), plan.py (RunPlan), placement.py (Placement)   the words every room uses
    feed/         the user's data into batches on the training device
    step/         one optimizer step: stepper, objective, precision, optimizer, schedule, EMA, compile
    validation/   when and how the weights are scored on held-out data; early stopping
    state/        checkpoints, resume, continue, rewind, the NaN guard, the run lock
    memory/       the memory plan: measures (one class each) under which a run fits, the strategy
                  (DDP or FSDP), and the next measure after an OOM
    setup.py      what every run needs before its first batch
    probes/       before the first step: preflight, batch size, LR finder, summary, peak FLOPS
    prepare.py    everything a fit needs before its first batch: decided, then put in place
    loop.py       run(): the training loop, top to bottom; dry_run(): run stopped before the loop; with epoch.py, eta.py, interrupt.py,
                  teardown.py, result.py (TrainResult), predict.py (predict, evaluate) and
                  adapters.py (peft models at a fit's ends)
"""

from gpunb.runtime.context import LocalContext
from gpunb.runtime.loop import run
from gpunb.runtime.result import TrainResult

__all__ = ["LocalContext", "TrainResult", "run"]
