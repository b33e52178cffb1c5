"""What each memory-plan measure costs in step time, alone and in the plans gpunb takes: the
priors of gpunb/runtime/memory/measures.py (each measure's `slowdowns`) come from here.

    python benchmarks/plan_costs.py              # on the CPU (or the GPU when there is one)
    python benchmarks/plan_costs.py --steps 12   # timed steps per arm

Each row times the same batch A/B/A: without measures, with them, without again (so that a
machine that slows down midway counts against neither), `--steps` steps each after 2 untimed,
through gpunb's own step (the Stepper) and gpunb's own measures (apply_plan); the model, the
optimizer and the RNGs are put back between arms. On the CPU a step is timed in the process's
CPU time (`time.process_time`), which other work on a shared machine disturbs far less than
the wall clock, with torch on `--threads` threads (default 1: steadier). Models: a 4-layer Llama (hidden 64, vocabulary
4,096, batch 8 x 64 tokens; its own loss) and an MLP of 6 residual blocks (width 256, batch 64).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

ROWS = {  # label: the measures
    "chunked cross-entropy": ("chunked_loss",),
    "checkpointing, all blocks": ("checkpointing",),
    "optimizer step in backward": ("optimizer_in_backward",),
    "8-bit AdamW states": ("states_8bit",),
    "chunked + in backward + checkpointing": ("chunked_loss", "optimizer_in_backward", "checkpointing"),
    "chunked + in backward + 8-bit + checkpointing": ("chunked_loss", "optimizer_in_backward", "states_8bit",
                                                      "checkpointing"),
}


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Residual(nn.Module):
    def __init__(self, width=256, blocks=6):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=4096, max_position_embeddings=256, use_cache=False)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, 4096, (8, 64), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids}, None


def residual():
    torch.manual_seed(0)
    return Residual(), (torch.randn(64, 256), torch.randint(0, 10, (64,))), nn.CrossEntropyLoss()


def seconds(model, optimizer, objective, batch, device, steps, names=(), blocks=0) -> float:
    """Median seconds of `steps` steps after 2 untimed, with `names` in place; all put back after."""
    from gpunb.config import TrainConfig
    from gpunb.runtime.memory.measures import measures_of
    from gpunb.runtime.memory.plan import MemoryPlan, Taken
    from gpunb.runtime.memory.planning import apply_plan
    from gpunb.runtime.state import rewind
    from gpunb.runtime.step.precision import Precision
    from gpunb.runtime.step.stepper import Stepper

    saved = rewind.capture(model, optimizer, device)
    plan = MemoryPlan(0, 0, 0, True, tuple(Taken(m, m.name, 0, 0.0) for m in measures_of(names)),
                      checkpointed_blocks=blocks)
    trained, undo = apply_plan(plan, model, optimizer, objective)
    stepper = Stepper(model, trained, objective, Precision("32", device), None, TrainConfig())
    times = []
    try:
        for _ in range(2 + steps):
            clock = time.perf_counter if device.type == "cuda" else time.process_time
            begin = clock()
            stepper.accumulate(batch, last_in_step=True)
            stepper.update()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(clock() - begin)
    finally:
        undo()
        rewind.restore(saved, model, optimizer, device)
    return statistics.median(times[2:])


def main():
    from gpunb.runtime.memory.blocks import repeated_blocks
    from gpunb.runtime.step.objective import Objective

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"device: {device}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    for label, make in (("Llama 4 x 64, vocabulary 4,096, batch 8 x 64", llama), ("MLP, 6 blocks", residual)):
        model, batch, loss_fn = make()
        model.to(device)
        batch = {k: v.to(device) for k, v in batch.items()} if isinstance(batch, dict) else \
            tuple(t.to(device) for t in batch)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        blocks = len(repeated_blocks(model)[1])
        print(f"\n{label}: {blocks} blocks")
        for row, names in ROWS.items():
            if "chunked_loss" in names and loss_fn is not None:
                continue  # the chunked loss is for a causal LM's own loss
            objective = Objective(loss_fn)
            plain = seconds(model, optimizer, objective, batch, device, args.steps)
            measured = seconds(model, optimizer, objective, batch, device, args.steps, names, blocks)
            again = seconds(model, optimizer, objective, batch, device, args.steps)
            base = statistics.mean((plain, again))
            print(f"  {row:48s} {1000 * base:8.2f} ms -> {1000 * measured:8.2f} ms  {100 * (measured / base - 1):+5.0f}%"
                  f"  (A/B/A: {1000 * plain:.2f} / {1000 * measured:.2f} / {1000 * again:.2f} ms)")


if __name__ == "__main__":
    main()
