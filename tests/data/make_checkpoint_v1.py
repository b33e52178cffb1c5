"""Writes checkpoint_v1/: a checkpoint of the format gpunb wrote before RunState (format version 1).

Run once, with the gpunb of that time, from the repository root:
    PYTHONPATH=$PWD python tests/data/make_checkpoint_v1.py
It trains a tiny model (AdamW, cosine schedule, weight average, best-k) for 2 epochs of 4
steps, keeps the checkpoint written after epoch 1 (step 4), and records the weights and
counters of the straight 2-epoch run, which a resume from step 4 must reach again.
"""

import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from gpunb import Trainer

HERE = Path(__file__).parent / "checkpoint_v1"


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Dropout(0.2), nn.Linear(3, 2))


def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 4, generator=g)
    return x, x[:, :2] * 2 + 0.1 * torch.randn(32, 2, generator=g)


def options(directory):
    return dict(epochs=2, batch_size=8, log_every=2, track=False, accelerator="cpu", lr_schedule="cosine",
                ema=0.9, save_top_k=1, keep_last=5, checkpoint_dir=str(directory))


def main():
    with tempfile.TemporaryDirectory() as scratch:
        trained = model()
        val = data()
        result = Trainer(**options(scratch)).fit(trained, data(), val, loss_fn=nn.MSELoss())
        run_dir = next(Path(scratch).glob("run-*"))
        shutil.rmtree(HERE, ignore_errors=True)
        (HERE / run_dir.name).mkdir(parents=True)
        shutil.copy(run_dir / "step-000000004.pt", HERE / run_dir.name / "step-000000004.pt")
        torch.save({"model": trained.state_dict(), "ema": result.ema_state_dict, "steps": result.steps,
                    "history": result.history, "epochs": result.epochs}, HERE / "expected.pt")


if __name__ == "__main__":
    main()
