"""The step: one optimizer step, from a batch to updated weights.

    stepper.py     forward and backward over micro-batches, then the update (Stepper)
    objective.py   how a batch becomes a loss, and how validation metrics score the output
    metrics.py     metric functions: weighted means, accuracy as counts, torchmetrics
    precision.py   autocast, backward, optimizer step and scaler as one small object
    optimizer.py   the default optimizer and the built-in learning-rate schedules
    schedule.py    the fit's schedule: a shorthand (`lr_schedule`) or the user's own scheduler
    ema.py         an exponential moving average of the weights, kept on the device
    wrap.py        what the loop calls instead of the user's module: checkpointed, distributed
    compiling.py   torch.compile in a run: forced, or `compile="auto"` when it pays
    step_graph.py  the whole step as one CUDA graph, replayed for batches of the same shapes
"""
