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
(dynamo) that every loop pays for, gpunb or not. Two plain loops:

    plain    torch's defaults: fp32, `torch.optim.AdamW(model.parameters())`
    same     the work gpunb chose for this device: fused AdamW, and on a GPU with native
             bf16, bf16 autocast and TF32 matmuls

so that "call -> first step" shows apart what gpunb's own set-up costs and what its choices
cost on a first step (a bf16 step loads other GPU kernels than an fp32 one). Below it, the
parts of gpunb's first step: set-up (device, precision, the model moved, the optimizer:
torch's first `AdamW(...)` imports dynamo, as the plain loops' does),
the one-batch check, the run summary (one forward and backward under the FLOP counter),
the feed, the callbacks' on_fit_start (telemetry, the registry), and the first step's
forward and backward, and its update (each synchronised, on a GPU).

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
KINDS = {"gpunb": "gpunb s", "plain": "plain s", "same": "same s"}  # "same": plain, gpunb's choices
# The parts of gpunb's "call -> first step": (label, module, attribute) of what is timed.
PARTS = (("set-up", "gpunb.runtime.loop", "setup"),
         ("of it, the optimizer", "gpunb.runtime.setup", "default_optimizer"),
         ("one-batch check", "gpunb.runtime.loop", "preflight"),
         ("summary (FLOPs)", "gpunb.runtime.loop", "summarize"), ("feed", "gpunb.runtime.loop", "build_feed"),
         ("model wrap", "gpunb.runtime.loop", "wrap_model"), ("compile set-up", "gpunb.runtime.loop", "Compilation"))
LATER_PARTS = ("on_fit_start", "first forward + backward", "first update")
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
    if kind in ("plain", "same"):
        start = time.perf_counter()
        as_gpunb = kind == "same"  # the work gpunb chose for this device
        bf16 = as_gpunb and device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)
        if as_gpunb and device.type == "cuda":
            torch.set_float32_matmul_precision("high")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, **({"fused": True} if as_gpunb else {}))
        xb, yb = x[:128].to(device), y[:128].to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = nn.functional.cross_entropy(model(xb), yb)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        synchronize()
        times["call -> first step"] = time.perf_counter() - start
        return times
    _time_parts(times, synchronize)

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


def _time_parts(times: dict, synchronize) -> None:
    """Time the parts of gpunb's first step (PARTS, the callbacks' on_fit_start, the first
    step's forward and backward and its update) by wrapping them in this process."""
    import importlib

    from gpunb.runtime.events import Callbacks
    from gpunb.runtime.step.stepper import Stepper

    def timed(label, function, once=False):
        def wrapper(*args, **kwargs):
            if once and label in times:
                return function(*args, **kwargs)
            begin = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                synchronize()
                times[label] = times.get(label, 0.0) + time.perf_counter() - begin

        return wrapper

    for label, module, name in PARTS:
        module = importlib.import_module(module)
        setattr(module, name, timed(label, getattr(module, name)))
    call = Callbacks.call
    Callbacks.call = lambda self, event, *args: (timed(LATER_PARTS[0], call)(self, event, *args)
                                                 if event == "on_fit_start" else call(self, event, *args))
    Stepper.accumulate = timed(LATER_PARTS[1], Stepper.accumulate, once=True)
    Stepper.update = timed(LATER_PARTS[2], Stepper.update, once=True)


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
    parser.add_argument("--child", choices=tuple(KINDS))
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
        with tempfile.TemporaryDirectory() as home:  # the kinds in turn, round by round
            rounds = [{kind: _fresh(kind, device, home) for kind in KINDS} for _ in range(args.rounds)]
        print(f"{'phase':<28}" + "".join(f"{title:>10}" for title in KINDS.values()))
        parts = [label for label in (*(part[0] for part in PARTS), *LATER_PARTS) if label in rounds[0]["gpunb"]]
        for phase in [*PHASES[:5], *parts, PHASES[5]]:
            row = f"{phase if phase in PHASES else '  ' + phase:<28}"
            for kind in KINDS:
                values = [r[kind][phase] for r in rounds if phase in r[kind]]
                row += f"{statistics.median(values):>10.3f}" if values else f"{'':>10}"
            print(row)
        first = {kind: statistics.median(r[kind]["call -> first step"] for r in rounds) for kind in KINDS}
        print(f"call -> first step, gpunb over plain: {first['gpunb'] - first['plain']:+.3f} s; over plain "
              f"with gpunb's choices: {first['gpunb'] - first['same']:+.3f} s (goal: within 0.3 s)")


if __name__ == "__main__":
    main()
