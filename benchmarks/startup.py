"""How long gpunb takes to start and to stop a run, each measured in a fresh process.

Phases of one `Trainer(...).fit` of a small MLP (64-256-10, batch 128, 20 steps):

    import torch            `import torch`
    import gpunb            `import gpunb` and the Trainer class (gpunb loads it on first use)
    Trainer()               constructing the Trainer (the config)
    model + warm-up         model to the device, one forward, CUDA synchronised
    call -> first step      `fit` called -> the first optimizer step done (a callback's on_step_end)
    last step -> return     the last optimizer step done -> `fit` returned

A plain PyTorch loop's first step (forward, backward, AdamW) after the same warm-up is
measured in a fresh process too: torch's first optimizer step loads part of torch
(dynamo) that every loop pays for, gpunb or not.

    python benchmarks/startup.py               # CPU (+ CUDA when there), 3 fresh processes each
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

PHASES = ("import torch", "import gpunb", "Trainer()", "model + warm-up", "call -> first step",
          "last step -> return")
STEPS = 20


def _child(kind: str, device_name: str) -> dict:
    """Runs in the fresh process: the phases' durations in seconds."""
    times = {}
    start = time.perf_counter()
    import torch
    from torch import nn

    times["import torch"] = time.perf_counter() - start
    device = torch.device(device_name)
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if kind == "gpunb":
        start = time.perf_counter()
        import gpunb

        trainer_class = gpunb.Trainer
        times["import gpunb"] = time.perf_counter() - start
        start = time.perf_counter()
        trainer = trainer_class(max_steps=STEPS, batch_size=128, accelerator=device.type)
        times["Trainer()"] = time.perf_counter() - start
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8192, 64, generator=g), torch.randint(0, 10, (8192,), generator=g)
    start = time.perf_counter()
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)).to(device)
    with torch.no_grad():
        model(x[:128].to(device))
    synchronize()
    times["model + warm-up"] = time.perf_counter() - start
    if kind == "plain":
        start = time.perf_counter()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        xb, yb = x[:128].to(device), y[:128].to(device)
        nn.functional.cross_entropy(model(xb), yb).backward()
        optimizer.step()
        optimizer.zero_grad()
        synchronize()
        times["call -> first step"] = time.perf_counter() - start
        return times

    class Clock:
        """Time of the first and of the last optimizer step (synchronised: the work is done)."""

        first = last = None

        def on_step_end(self, state):
            if state.step == 1 or state.step == STEPS:
                synchronize()
                now = time.perf_counter()
                self.first = self.first or now
                self.last = now

    clock = Clock()
    start = time.perf_counter()
    trainer.fit(model, (x, y), loss_fn=nn.CrossEntropyLoss(), callbacks=[clock])
    returned = time.perf_counter()
    times["call -> first step"] = clock.first - start
    times["last step -> return"] = returned - clock.last
    return times


def _fresh(kind: str, device: str, home: str) -> dict:
    env = dict(os.environ, GPUNB_HOME=home)
    done = subprocess.run([sys.executable, __file__, "--child", kind, "--device", device],
                          capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the {kind} run on {device} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", choices=("gpunb", "plain"))
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.device)))
        return
    import torch

    devices = [args.device] if args.device else ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
        print(f"device: {name}, torch {torch.__version__}, medians of {args.rounds} fresh processes")
        with tempfile.TemporaryDirectory() as home:
            rounds = [(_fresh("gpunb", device, home), _fresh("plain", device, home)) for _ in range(args.rounds)]
        print(f"{'phase':<22}{'gpunb s':>10}{'plain s':>10}")
        for phase in PHASES:
            ours = statistics.median(r[0][phase] for r in rounds)
            plain = [r[1][phase] for r in rounds if phase in r[1]]
            plain_text = f"{statistics.median(plain):>10.3f}" if plain else f"{'':>10}"
            print(f"{phase:<22}{ours:>10.3f}{plain_text}")


if __name__ == "__main__":
    main()
