"""torch.compile in gpunb: what a second compile of the same model costs, and on a GPU what
compile="auto" and CUDA graphs buy against a plain eager loop.

    python benchmarks/compile_auto.py            # the cache case (+ the GPU cases when CUDA is there)

cache       a notebook cell that defines a model class and trains it with compile=True, run
            twice in one process (the class defined anew, as re-running the cell does): the
            compile's cost each time (fit time minus an eager fit's). Goal: second <= 1/4 of first.
digits      (GPU) the launch-bound digits CNN at batch 64, data on the GPU, bf16: a plain eager
            loop, gpunb with compile="step-graph" (the whole step as one CUDA graph), with
            compile="reduce-overhead" (torch.compile's CUDA graphs of forward and backward) and
            with the default compile="auto"; step-time ratios. Goal: >= 1.8x faster than the plain loop.
gpt2        (GPU) GPT-2 124M in nanoGPT's shape under compile="auto" for --gpt-steps steps:
            when it compiled, what the compile cost and the measured speed-up.
lm          a language model trained with a separate loss_fn (cross-entropy over its logits),
            compiled from the first step: a plain loop compiling the model alone (the loss
            eager), the plain loop compiling the loss too, and gpunb's compile=True (which
            compiles both); median step times after the compile, and ratios to the first. On
            a GPU GPT-2 124M in bf16 (16 x 1,024 tokens); on a CPU a small one in fp32 (4
            layers, 256 wide, vocabulary 16,384, 8 x 128 tokens).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
from torch import nn

from gpunb import Trainer
from gpunb.demo import digits_cnn, digits_data

CELL = """
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.LayerNorm(256), nn.Linear(256, 256),
                                  nn.GELU(), nn.LayerNorm(256), nn.Linear(256, 10))

    def forward(self, x):
        return self.body(x)
"""


def cache_case(device) -> None:
    g = torch.Generator().manual_seed(0)
    data = (torch.randn(2048, 64, generator=g), torch.randint(0, 10, (2048,), generator=g))

    def fit_seconds(compile) -> float:
        namespace = {"nn": nn}
        exec(CELL, namespace)  # the cell defines its class anew each time it runs
        torch.manual_seed(0)
        begin = time.perf_counter()
        Trainer(max_steps=5, batch_size=128, compile=compile, track=False, precision="32",
                accelerator=device.type).fit(namespace["Net"](), data, loss_fn=nn.CrossEntropyLoss())
        return time.perf_counter() - begin

    fit_seconds(False)  # torch's own first-use costs, paid once by any loop
    eager = statistics.median(fit_seconds(False) for _ in range(3))
    first, second = fit_seconds(True) - eager, fit_seconds(True) - eager
    print(f"cache     eager fit {eager:.2f} s; compile: first {first:.2f} s, same cell again {second:.2f} s, "
          f"ratio {second / first:.3f} (goal <= 0.25)")


def digits_case(device, steps: int) -> None:
    from overhead import StepTimer, plain_loop  # noqa: PLC0415 (benchmarks/ is on sys.path)

    (x, y), _ = digits_data()
    data = (x.to(device), y.to(device))
    plain = plain_loop(digits_cnn, data, 64, nn.CrossEntropyLoss(), "bf16-mixed", device, steps)
    rows = {"plain eager loop": (plain, None)}
    for label, compile in (("gpunb step-graph", "step-graph"), ("gpunb reduce-overhead", "reduce-overhead"),
                           ("gpunb auto", "auto")):
        torch.manual_seed(0)
        timer = StepTimer(device)
        result = Trainer(max_steps=steps, epochs=10**6, batch_size=64, precision="bf16-mixed", log_every=50,
                         track=False, compile=compile).fit(digits_cnn(), data, loss_fn=nn.CrossEntropyLoss(),
                                                           callbacks=[timer])
        rows[label] = (timer.times, result)
    base = statistics.median(plain[steps // 2:])
    for label, (times, result) in rows.items():
        step = statistics.median(times[steps // 2:])  # after any compile
        line = f"digits    {label:<24}{1000 * step:8.3f} ms  {base / step:5.2f}x the plain loop"
        if result is not None:
            info = result.compilation
            line += f"  [{info['mode'] or 'eager'} from step {info['at_step']}; {info['reason'][:90]}]"
        print(line)


def gpt2_case(device, steps: int) -> None:
    from overhead import GPT, StepTimer, next_token_loss  # noqa: PLC0415

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 50304, (256, 1025), generator=g)
    torch.manual_seed(0)
    timer = StepTimer(device)
    result = Trainer(max_steps=steps, epochs=10**6, batch_size=16, precision="bf16-mixed", track=False,
                     compile="auto").fit(GPT(), (tokens[:, :-1], tokens[:, 1:]), loss_fn=next_token_loss,
                                         callbacks=[timer])
    info = result.compilation
    print(f"gpt2      compile='auto' over {steps} steps: {info['mode'] or 'eager'} from step {info['at_step']}, "
          f"compile {info['compile_s'] or 0:.1f} s, speed-up {info['speedup'] or 1:.2f}x "
          f"({info['eager_step_ms'] or 0:.1f} -> {info['compiled_step_ms'] or 0:.1f} ms), "
          f"MFU {100 * (result.mfu or 0):.1f}% over the run; {info['reason']}")


def lm_case(device, steps: int) -> None:
    from overhead import GPT, StepTimer, next_token_loss  # noqa: PLC0415

    if device.type == "cuda":
        make_model, vocab, rows, length, batch, precision = GPT, 50304, 256, 1024, 16, "bf16-mixed"
    else:
        make_model = functools.partial(GPT, vocab=16384, width=256, layers=4, heads=4, context=128)
        vocab, rows, length, batch, precision = 16384, 64, 128, 8, "32"
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (rows, length + 1), generator=g)
    data = (tokens[:, :-1].to(device), tokens[:, 1:].to(device))

    def plain(compile_loss: bool) -> list:
        torch.manual_seed(0)
        model = torch.compile(make_model().to(device))
        loss_fn = torch.compile(next_token_loss) if compile_loss else next_token_loss
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        timer = StepTimer(device)
        timer.on_fit_start(None)
        for step in range(steps):
            begin = (step * batch) % (rows - batch + 1)
            x, y = data[0][begin:begin + batch], data[1][begin:begin + batch]
            with torch.autocast(device.type, torch.bfloat16, enabled=precision == "bf16-mixed"):
                loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            timer.on_step_end(None)
        return timer.times

    def gpunb() -> list:
        torch.manual_seed(0)
        timer = StepTimer(device)
        Trainer(max_steps=steps, epochs=10**6, batch_size=batch, precision=precision, compile=True, track=False,
                log_every=50, accelerator=device.type).fit(make_model(), data, loss_fn=next_token_loss,
                                                           callbacks=[timer])
        return timer.times

    step_times = {"plain, model compiled": plain(False), "plain, model and loss compiled": plain(True),
                  "gpunb compile=True": gpunb()}
    base = statistics.median(step_times["plain, model compiled"][steps // 2:])
    for label, times in step_times.items():
        step = statistics.median(times[steps // 2:])
        print(f"lm        {label:<32}{1000 * step:9.2f} ms  {step / base:6.3f} of the model-only compile")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--digits-steps", type=int, default=3000)
    parser.add_argument("--gpt-steps", type=int, default=6000)
    parser.add_argument("--lm-steps", type=int, default=60)
    parser.add_argument("--cases", nargs="+", choices=("cache", "digits", "gpt2", "lm"),
                        default=("cache", "digits", "gpt2", "lm"))
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"device: {name}, torch {torch.__version__}")
    if "cache" in args.cases:
        cache_case(device)
    if "lm" in args.cases:
        lm_case(device, args.lm_steps)
    if device.type != "cuda":
        print("skipped: digits, gpt2 (they need a CUDA GPU)")
        return
    if "digits" in args.cases:
        digits_case(device, args.digits_steps)
    if "gpt2" in args.cases:
        gpt2_case(device, args.gpt_steps)


if __name__ == "__main__":
    main()
