"""A sweep by gpunb against the same search written by hand with Optuna around a plain loop.

The same seeded sampler asks for the same trials (a seeded random sampler draws the same values
whatever the objectives are, so both sweeps train the same configurations); each trial trains
an MLP on a synthetic classification task for a few epochs and is judged by its last val_loss.
Sweeps run interleaved (by hand, gpunb, gpunb with the run registry off, by hand, ...) and the
median wall time of each is kept; gpunb untracked against tracked is what tracking costs.
With `--prune median` both prune at each epoch's validation with Optuna's MedianPruner, and the
trials per hour are compared with and without pruning.

With `--packing`, trials per hour of 4 small trials on one GPU: packed onto it together as jobs
(`parallel=4`, placed by their memory estimates) against one at a time, in the kernel (the
default) and as jobs (`cluster="local"`, `parallel=1`, the same start-up cost per trial). On a CPU
the packer is given a stand-in GPU, so that the same path runs (estimates, placement, the
trial's CUDA_VISIBLE_DEVICES, which a CPU job ignores): a check that it works, not a figure.

    python benchmarks/sweep.py                      # CPU: 8 trials, 3 rounds
    python benchmarks/sweep.py --device cuda --trials 16
    python benchmarks/sweep.py --packing --device cuda --epochs 20   # one GPU (CUDA_VISIBLE_DEVICES=0)
    python benchmarks/sweep.py --packing --epochs 1 --rounds 1      # CPU: the path, reduced
"""

from __future__ import annotations

import argparse
import functools
import os
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


def build(trial):
    train, val = data()
    lr = suggest("lr", 1e-4, 1e-1, log=True)
    model = model_of(suggest("width", [64, 128, 256]))
    return dict(model=model, train_data=train, val_data=val, loss_fn=nn.CrossEntropyLoss(),
                optimizer=torch.optim.AdamW(model.parameters(), lr=lr))


def by_gpunb(args, prune: bool, parallel: int = 1, track: bool = True, **where):
    trainer = Trainer(epochs=args.epochs, batch_size=args.batch_size, accelerator=args.device, precision="32",
                      track=track, **where)
    sweep = trainer.sweep(build, args.trials, sampler="random", seed=args.seed, parallel=parallel,
                          prune="median" if prune else "none", name=f"bench-{time.time_ns()}")
    assert {row.state for row in sweep.rows} <= {"complete", "pruned"}, sweep.rows
    return [row.params for row in sweep.rows], sum(row.state == "pruned" for row in sweep.rows)


def packing(args):
    """Trials per hour: 4 small trials packed onto one GPU against one at a time."""
    from gpunb.sweeps import packing as placement

    if args.device == "cpu":  # a stand-in GPU with room for all four: the packing path, on a CPU
        placement.read_devices = lambda: [placement.Device(0, "stand-in", 2**40, 2**40)]
    args.trials = 4
    ways = {"in the kernel, one at a time": dict(), "jobs, one at a time": dict(cluster="local"),
            "jobs, 4 packed on one GPU": dict(parallel=4)}
    times = {way: [] for way in ways}
    for _ in range(args.rounds):
        for way, options in ways.items():
            started = time.perf_counter()
            by_gpunb(args, False, **options)
            times[way].append(time.perf_counter() - started)
    print("| 4 trials | s (median) | trials/h |")
    print("|---|---|---|")
    per_hour = {}
    for way, seconds in times.items():
        per_hour[way] = 3600 * args.trials / statistics.median(seconds)
        print(f"| {way} | {statistics.median(seconds):.2f} | {per_hour[way]:.0f} |")
    packed = per_hour["jobs, 4 packed on one GPU"]
    print(f"packed / one at a time: {packed / per_hour['in the kernel, one at a time']:.2f}x (in the kernel), "
          f"{packed / per_hour['jobs, one at a time']:.2f}x (as jobs); target >= 2.5x")


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
    parser.add_argument("--packing", action="store_true", help="4 small trials packed on one GPU vs one at a time")
    args = parser.parse_args()
    if args.packing:
        if args.device == "cuda":
            os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")  # one GPU: the packer reads what is visible
        print(f"device {args.device}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
              f"4 trials x {args.epochs} epochs, {args.rounds} rounds")
        return packing(args)
    print(f"device {args.device}, torch {torch.__version__}, optuna {optuna.__version__}, "
          f"{torch.get_num_threads()} threads; {args.trials} trials x {args.epochs} epochs, {args.rounds} rounds")
    print("| pruning | by hand s | gpunb s | gpunb / by hand | untracked / by hand | tracked / untracked "
          "| same trials | pruned (hand, gpunb) | trials/h gpunb |")
    print("|---|---|---|---|---|---|---|---|---|")
    untracked = functools.partial(by_gpunb, track=False)  # the run registry off: what tracking costs
    per_hour = {}
    for prune in (False, True):
        hand, ours, bare = [], [], []
        for _ in range(args.rounds):
            hand.append(timed(by_hand, args, prune))
            ours.append(timed(by_gpunb, args, prune))
            bare.append(timed(untracked, args, prune))
        h, g, u = (statistics.median(t for t, _, _ in runs) for runs in (hand, ours, bare))
        same = all(a[1] == b[1] == c[1] for a, b, c in zip(hand, ours, bare))
        per_hour[prune] = 3600 * args.trials / g
        print(f"| {'median' if prune else 'none'} | {h:.2f} | {g:.2f} | {g / h:.3f} | {u / h:.3f} | {g / u:.3f} | "
              f"{same} | {hand[0][2]}, {ours[0][2]} | {per_hour[prune]:.0f} |")
    print(f"pruning's gain in trials per hour (gpunb): {per_hour[True] / per_hour[False]:.2f}x")


if __name__ == "__main__":
    main()
