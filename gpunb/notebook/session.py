"""What the notebook front end remembers between cells: the last %%gputrain set-up, by name."""

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
