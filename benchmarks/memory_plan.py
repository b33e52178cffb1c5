"""The memory plan on Llama-architecture models: gpunb's default against a plain loop and the same
plan written by hand in plain PyTorch, one model size and one way at a time (each in a process
of its own, so that one's OOM leaves nothing behind for the next).

    python benchmarks/memory_plan.py                        # 1B, 3B, 8B at 2,048 tokens, bf16, one GPU
    python benchmarks/memory_plan.py --budget 24GiB         # a 24 GB card emulated on a larger one
    python benchmarks/memory_plan.py --lora --budget 24GiB  # LoRA adapters on bf16 base weights
    python benchmarks/memory_plan.py --tiny                 # tiny shapes on the CPU: proves it runs

Models are built from transformers.LlamaConfig with random weights (no download). Each way
trains `--steps` steps after `--warmup`, batch `--batch` x `--seq` tokens, and reports its
peak memory (CUDA), the median step time and tokens/s; then the ratios to the hand-written plan.
  plain:   fp32 weights, bf16 autocast, fused AdamW, model(**batch).loss (expect OOM past ~3B on 80 GB)
  gpunb:   Trainer(...).fit with its defaults (the memory plan on), but compile=False: the other two are eager
  by-hand: the measures gpunb's plan chose, written with torch, torchao and transformers directly
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SHAPES = {  # hidden, intermediate, layers, heads, kv heads, vocabulary (Llama 3.2 1B / 3B, Llama 3.1 8B)
    "1b": (2048, 8192, 16, 32, 8, 128256),
    "3b": (3072, 8192, 28, 24, 8, 128256),
    "8b": (4096, 14336, 32, 32, 8, 128256),
    "tiny": (64, 256, 4, 4, 2, 4096),
}


def model_of(size: str, device, lora: bool = False):
    """Random weights, made on `device` (an 8B model's fp32 init on the host takes minutes); with
    `lora`, bf16 base weights frozen under LoRA adapters on the attention projections."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter, layers, heads, kv, vocab = SHAPES[size]
    config = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                         max_position_embeddings=8192, use_cache=False)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    if lora:
        torch.set_default_dtype(torch.bfloat16)
    try:
        with device:
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, task_type="CAUSAL_LM",
                                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
        for p in model.parameters():  # adapters train in fp32 beside the bf16 base
            if p.requires_grad:
                p.data = p.data.float()
    return model


class Tokens:
    """Random token batches as dicts (the model computes its own loss)."""

    def __init__(self, vocab, seq, samples):
        import torch

        self.ids = torch.randint(0, vocab, (samples, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def one(args) -> dict:
    """One size, one way, in this process."""
    import torch

    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    if cuda and args.budget:
        from gpunb.units import parse_bytes

        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, parse_bytes(args.budget) / total))
    out = {"size": args.size, "way": args.way}
    try:
        model = model_of(args.size, device, args.lora)
    except torch.OutOfMemoryError as error:
        out["error"] = f"OutOfMemoryError building the model: {str(error).splitlines()[0][:160]}"
        return out
    steps = args.warmup + args.steps
    data = Tokens(model.config.vocab_size, args.seq, args.batch * steps)
    out["params"] = sum(p.numel() for p in model.parameters())
    try:
        if args.way == "gpunb":
            times, plan = _gpunb(model, data, args, steps)
            out["plan"] = plan
        else:
            model.to(device)
            plan = json.loads(args.plan) if args.plan else {}
            times = _plain(model, data, args, device, steps, plan if args.way == "by-hand" else {})
    except (torch.OutOfMemoryError, RuntimeError, Exception) as error:  # noqa: BLE001 - reported, not raised
        out["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
        return out
    measured = times[args.warmup:]
    out["step_s"] = statistics.median(measured)
    out["tokens_per_s"] = args.batch * args.seq / out["step_s"]
    out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    return out


def _gpunb(model, data, args, steps):
    from gpunb import Trainer

    options = {"memory_budget": args.budget} if args.budget else {}
    if args.tiny:
        options = {"memory_budget": args.budget or "12MiB", "accelerator": "cpu"}
    result = Trainer(max_steps=steps, batch_size=args.batch, log_every=1, track=False, compile=False,
                     shuffle=False, **options).fit(model, data)
    times = [row["step_time_ms"] / 1000 for row in result.history]
    return times, {"text": result.memory_plan, "measures": _measures_of(result)}


def _measures_of(result):
    """The plan's measures as the by-hand loop reads them."""
    text = result.memory_plan
    blocks = None
    if "activation checkpointing on " in text:
        words = text.split("activation checkpointing on ")[1].split()
        blocks = int(words[0])
    return {"chunked_loss": "chunked cross-entropy" in text, "checkpoint_blocks": blocks,
            "in_backward": "fused into backward" in text, "states_8bit": "8-bit" in text,
            "states_cpu": "states on the host" in text, "bf16_weights": "bf16 weights" in text}


def _plain(model, data, args, device, steps, plan):
    """A plain loop; with `plan`, the plan's measures written by hand."""
    import torch
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    if plan.get("bf16_weights"):
        model.to(torch.bfloat16)
    if plan.get("checkpoint_blocks"):
        lm = model.get_base_model() if hasattr(model, "get_base_model") else model
        for layer in lm.model.layers[:plan["checkpoint_blocks"]]:
            layer.gradient_checkpointing = True
            layer._gradient_checkpointing_func = lambda f, *a, **k: checkpoint(f, *a, use_reentrant=False, **k)
    params = [p for p in model.parameters() if p.requires_grad]
    make = _optimizer_maker(plan, device)
    if plan.get("in_backward"):
        per_param = {p: make([p]) for p in params}

        def step_now(p):
            per_param[p].step()
            p.grad = None

        for p in params:
            p.register_post_accumulate_grad_hook(step_now)
        optimizer = None
    else:
        optimizer = make(params)

    def loss_of(batch):
        if not plan.get("chunked_loss"):
            return model(**batch).loss
        lm = model.get_base_model() if hasattr(model, "get_base_model") else model
        hidden = lm.model(input_ids=batch["input_ids"]).last_hidden_state
        targets = F.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
        total = 0.0
        for h, y in zip(hidden.chunk(8, dim=1), targets.chunk(8, dim=1)):
            total = total + checkpoint(lambda h, y: F.cross_entropy(lm.lm_head(h).float().flatten(0, 1),
                                                                    y.flatten(), ignore_index=-100, reduction="sum"),
                                       h, y, use_reentrant=False)
        return total / (targets != -100).sum()

    model.train()
    times = []
    for i in range(steps):
        rows = [data[j] for j in range(i * args.batch, (i + 1) * args.batch)]
        batch = {k: torch.stack([r[k] for r in rows]).to(device) for k in rows[0]}
        _sync(device)
        begin = time.perf_counter()
        with autocast:
            loss = loss_of(batch)
        loss.backward()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        _sync(device)
        times.append(time.perf_counter() - begin)
    return times


def _optimizer_maker(plan, device):
    import torch

    if plan.get("states_8bit") or plan.get("states_cpu") or plan.get("bf16_weights"):
        from torchao import optim

        sr = {"bf16_stochastic_round": bool(plan.get("bf16_weights"))}
        if plan.get("states_cpu"):
            return lambda ps: optim.CPUOffloadOptimizer(ps, optim._AdamW, offload_gradients=True, lr=1e-5, **sr)
        if plan.get("states_8bit"):
            return lambda ps: optim.AdamW8bit(ps, lr=1e-5, **sr)
        return lambda ps: optim._AdamW(ps, lr=1e-5, **sr)
    fused = {"fused": True} if device.type in ("cuda", "cpu") else {}
    return lambda ps: torch.optim.AdamW(ps, lr=1e-5, **fused)


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1b,3b,8b")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--budget", default=None, help="e.g. 24GiB: a smaller card, emulated")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--lora", action="store_true", help="LoRA adapters on bf16 base weights")
    parser.add_argument("--size", help=argparse.SUPPRESS)
    parser.add_argument("--way", help=argparse.SUPPRESS)
    parser.add_argument("--plan", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.way:
        print(json.dumps(one(args)))
        return
    if args.tiny:
        args.sizes, args.seq, args.batch = "tiny", 64, 4
    rows = []
    for size in args.sizes.split(","):
        found = {}
        for way in ("plain", "gpunb", "by-hand"):
            plan = found.get("gpunb", {}).get("plan", {}).get("measures") if way == "by-hand" else None
            row = _child(args, size, way, plan)
            found[way] = row
            rows.append(row)
            print(_line(row), flush=True)
        hand, ours = found["by-hand"], found["gpunb"]
        if "tokens_per_s" in hand and "tokens_per_s" in ours:
            print(f"  {size}: gpunb / by-hand tokens/s = {ours['tokens_per_s'] / hand['tokens_per_s']:.3f}", flush=True)
        if "tokens_per_s" in found["plain"] and "tokens_per_s" in ours:
            print(f"  {size}: gpunb / plain tokens/s = {ours['tokens_per_s'] / found['plain']['tokens_per_s']:.3f}")
    return rows


def _child(args, size, way, plan):
    command = [sys.executable, __file__, "--size", size, "--way", way, "--seq", str(args.seq),
               "--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    command += ["--budget", args.budget] if args.budget else []
    command += ["--tiny"] if args.tiny else []
    command += ["--lora"] if args.lora else []
    command += ["--plan", json.dumps(plan)] if plan else []
    done = subprocess.run(command, capture_output=True, text=True, env=os.environ)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"size": size, "way": way, "error": (done.stderr.strip().splitlines() or ["no output"])[-1][:200]}
    return json.loads(lines[-1])


def _line(row) -> str:
    if "error" in row:
        return f"{row['size']:>4} {row['way']:<8} {row['error']}"
    peak = f"{row['peak_gib']:.1f} GiB" if row.get("peak_gib") is not None else "-"
    plan = f"  [{row['plan']['text'] or 'no measure'}]" if "plan" in row else ""
    return (f"{row['size']:>4} {row['way']:<8} peak {peak:>9}  step {1000 * row['step_s']:8.1f} ms  "
            f"{row['tokens_per_s']:10,.0f} tokens/s{plan}")


if __name__ == "__main__":
    main()
