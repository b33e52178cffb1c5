"""What the notebook front end remembers between cells (the last %%gputrain set-up)."""

from __future__ import annotations

# {"config": TrainConfig, "model": ..., "train_data": ..., "fit_kwargs": {...}} or None.
LAST_TRAIN: dict | None = None
