"""A sweep by gpunb against the same search written by hand with Optuna around a plain loop.

The same seeded sampler asks for the same trials (a seeded random sampler draws the same values
whatever the objectives are, so both sweeps train the same configurations); each trial trains
an MLP on a synthetic classification task for a few epochs and is judged by its last val_loss.
Sweeps run interleaved (by hand, gpunb, by hand, ...) and the median wall time of each is kept.
With `--prune median` both prune at each epoch's validation with Optuna's MedianPruner, and the
trials per hour are compared with and without pruning.

    python benchmarks/sweep.py                      # CPU: 8 trials, 3 rounds
    python benchmarks/sweep.py --device cuda --trials 16
"""

from __future__ import annotations

import argparse
import statistics
import time

import optuna
import torch
from torch import nn

from gpunb import Trainer, suggest

optuna.logging.set_verbosity(optuna.logging.WARNING)


def data(n=4096, features=32, classes=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    y = (x @ torch.randn(features, classes, generator=g)).argmax(1)
    cut = n * 7 // 8
    return (x[:cut], y[:cut]), (x[cut:], y[cut:])


def model_of(width: int, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


def by_hand(args, prune: bool):
    """Optuna's own loop (study.optimize) around a plain PyTorch training loop."""
    (x, y), (vx, vy) = data()
    device = torch.device(args.device)
    x, y, vx, vy = (t.to(device) for t in (x, y, vx, vy))

    def objective(trial):
        lr = trial.suggest_float("lr", 1e-4, 1e-1, log=True)
        width = trial.suggest_categorical("width", [64, 128, 256])
        model = model_of(width).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        generator = torch.Generator(device="cpu").manual_seed(0)
        for epoch in range(args.epochs):
            model.train()
            for batch in torch.randperm(len(x), generator=generator).split(args.batch_size):
                loss = nn.functional.cross_entropy(model(x[batch.to(device)]), y[batch.to(device)])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
            model.eval()
            with torch.no_grad():
                val_loss = nn.functional.cross_entropy(model(vx), vy).item()
            trial.report(val_loss, epoch)
            if prune and trial.should_prune():
                raise optuna.TrialPruned()
        return val_loss

    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=args.seed), pruner=_pruner(prune))
    study.optimize(objective, n_trials=args.trials)
    return [t.params for t in study.trials], sum(t.state == optuna.trial.TrialState.PRUNED for t in study.trials)


def by_gpunb(args, prune: bool):
    train, val = data()

    def build(trial):
        lr = suggest("lr", 1e-4, 1e-1, log=True)
        model = model_of(suggest("width", [64, 128, 256]))
        return dict(model=model, train_data=train, val_data=val, loss_fn=nn.CrossEntropyLoss(),
                    optimizer=torch.optim.AdamW(model.parameters(), lr=lr))

    trainer = Trainer(epochs=args.epochs, batch_size=args.batch_size, accelerator=args.device, precision="32")
    sweep = trainer.sweep(build, args.trials, sampler="random", seed=args.seed,
                          prune="median" if prune else "none", name=f"bench-{time.time_ns()}")
    return [row.params for row in sweep.rows], sum(row.state == "pruned" for row in sweep.rows)


def _pruner(prune: bool):
    return optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0) if prune else optuna.pruners.NopPruner()


def timed(fn, args, prune):
    started = time.perf_counter()
    params, pruned = fn(args, prune)
    return time.perf_counter() - started, params, pruned


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"device {args.device}, torch {torch.__version__}, optuna {optuna.__version__}, "
          f"{torch.get_num_threads()} threads; {args.trials} trials x {args.epochs} epochs, {args.rounds} rounds")
    print("| pruning | by hand s | gpunb s | gpunb / by hand | same trials | pruned (hand, gpunb) | trials/h gpunb |")
    print("|---|---|---|---|---|---|---|")
    per_hour = {}
    for prune in (False, True):
        hand, ours = [], []
        for _ in range(args.rounds):
            hand.append(timed(by_hand, args, prune))
            ours.append(timed(by_gpunb, args, prune))
        h, g = statistics.median(t for t, _, _ in hand), statistics.median(t for t, _, _ in ours)
        same = all(a[1] == b[1] for a, b in zip(hand, ours))
        per_hour[prune] = 3600 * args.trials / g
        print(f"| {'median' if prune else 'none'} | {h:.2f} | {g:.2f} | {g / h:.3f} | {same} | "
              f"{hand[0][2]}, {ours[0][2]} | {per_hour[prune]:.0f} |")
    print(f"pruning's gain in trials per hour (gpunb): {per_hour[True] / per_hour[False]:.2f}x")


if __name__ == "__main__":
    main()
