"""`%%gputrain --eval` and `%%gputrain --dry-run`: the cell's objects, not trained.

--eval     gpunb.evaluate on val_data (or train_data when the cell has none); prints the metrics
           (not with --quiet) and stores them in gputrain_result (or --out)
--dry-run  the run's summary (parameters, FLOPs, memory) from one step that is undone
"""

from __future__ import annotations

from IPython.core.error import UsageError

from gpunb.render import fmt


def evaluate_cell(found: dict, config, args) -> dict:
    """The metrics validation would report, printed on one line (not with --quiet) and returned."""
    from gpunb.runtime.feed.inputs import adapt_data, data_length
    from gpunb.runtime.predict import DEFAULT_BATCH, evaluate

    role = "val_data" if found["val_data"] is not None else "train_data"
    data = found[role]
    if data is None:
        raise UsageError(f"%%gputrain --eval needs data to evaluate on: a variable `{args.val_data_name}` "
                         f"(or `{args.train_data_name}`), and the namespace has neither.\n"
                         f"HINT: define `{args.val_data_name} = (x_val, y_val)` in the cell, or pass "
                         "`--val-data <variable>`.")
    batch = config.batch_size if isinstance(config.batch_size, int) else DEFAULT_BATCH
    metrics = evaluate(found["model"], data, metrics=found["metrics"], loss_fn=found["loss_fn"],
                       step=found["step"], batch_size=batch, precision=config.precision,
                       accelerator=config.accelerator, transforms=config.transforms)
    if args.quiet:
        return metrics
    samples = data_length(adapt_data(data, role))
    counted = f" ({samples} samples)" if samples is not None else ""
    values = "  ".join(f"{name}={fmt(value)}" for name, value in sorted(metrics.items()))
    print(f"evaluated {getattr(args, role + '_name')}{counted}: {values}")
    return metrics


def dry_run_cell(found: dict, config):
    """The summary of the run the cell sets up, shown and returned; nothing is trained."""
    from IPython.display import display

    from gpunb.trainer import Trainer

    summary = Trainer(config).summary(found["model"], found["train_data"], found["val_data"],
                                      optimizer=found["optimizer"], loss_fn=found["loss_fn"],
                                      step=found["step"], metrics=found["metrics"])
    display(summary)
    return summary
