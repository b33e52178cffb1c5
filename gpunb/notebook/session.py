"""What the notebook front end remembers between cells: the last %%gputrain set-up, by name,
and what `--continue` goes on from."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LastTrain:
    """The last %%gputrain that ran: its config and, per set-up role, the variable holding it.

    Names, not objects: the model and data stay freeable, and `%gpuprofile --train` looks
    them up again in the user namespace when it runs.
    """

    config: object  # the TrainConfig the magic built
    names: dict  # role -> variable name, for the roles the cell provided (model, train_data, ...)
    continue_state: object = None  # weakref to the fit's runtime.continuing.ContinueState (`--continue`)


LAST_TRAIN: LastTrain | None = None


def continue_state():
    """What `%%gputrain --continue` goes on from: the last fit's ContinueState, or a UsageError."""
    from IPython.core.error import UsageError

    last = LAST_TRAIN
    kept = last.continue_state() if last is not None and last.continue_state is not None else None
    if kept is None:
        if last is None:
            why = "no %%gputrain has trained in this kernel yet"
        elif last.continue_state is None:
            why = "the last one ran in several processes, which keep no optimizer here"
        else:
            why = "its result, which holds the optimizer state, was deleted"
        raise UsageError(f"--continue goes on from the last %%gputrain, and {why}.\n"
                         "HINT: run the cell without `--continue` first (with `--devices 1`, and keep "
                         "`gputrain_result`, to continue it later).")
    return kept
