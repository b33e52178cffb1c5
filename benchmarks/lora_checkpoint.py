"""How large a LoRA checkpoint is next to a full fine-tune's, and what saving it costs.

A Llama-architecture model built from a LlamaConfig (random weights, nothing downloaded)
is trained for one step and checkpointed, once with every parameter training and once
wrapped by peft with LoRA (r=8 on q_proj and v_proj). For each: the checkpoint's size on
disk, and the median time of `Checkpointer.save` (state dicts, the fingerprint of the
frozen base, torch.save, fsync) over a few saves. For Llama-2-7B's shapes the model is
built on the meta device and the sizes are computed from the parameter counts (fp32
adapters and two AdamW moments; the base's bf16 weights).

    python benchmarks/lora_checkpoint.py              # CPU; --device cuda on a GPU
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import peft
import torch
import transformers
from torch.utils.data import Dataset

from gpunb import Trainer
from gpunb.runtime.state.checkpoint_files import list_checkpoints
from gpunb.runtime.state.checkpointer import Checkpointer

VOCAB, LENGTH = 8000, 32


class Tokens(Dataset):
    def __init__(self):
        self.ids = torch.randint(0, VOCAB, (8, LENGTH), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def llama_config(**shape):
    defaults = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                    num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=LENGTH)
    return transformers.LlamaConfig(**{**defaults, **shape})


def with_lora(model):
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    return peft.get_peft_model(model, config)


def timed_saves(seconds: list):
    """Checkpointer.save, timed (its state dicts, the frozen base's fingerprint, torch.save, fsync)."""
    original = Checkpointer.save

    def save(self, state):
        started = time.perf_counter()
        original(self, state)
        seconds.append(time.perf_counter() - started)

    return save


def measure(name, model, device, steps=5):
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    seconds = []
    Checkpointer.save, original = timed_saves(seconds), Checkpointer.save
    try:
        with tempfile.TemporaryDirectory() as directory:
            Trainer(max_steps=steps, batch_size=8, track=False, accelerator=device, checkpoint_dir=directory,
                    checkpoint_every=1, keep_last=1).fit(model, Tokens())
            size = list_checkpoints(directory)[-1].stat().st_size
    finally:
        Checkpointer.save = original
    print(f"| {name} | {params:,} | {trainable:,} | {size / 2**20:,.2f} MiB | "
          f"{1000 * statistics.median(seconds):.1f} ms |")
    return size


def seven_billion():
    with torch.device("meta"):
        model = with_lora(transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
            num_attention_heads=32, num_key_value_heads=32)))
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"Llama-2-7B shapes, LoRA r=8 on q_proj, v_proj: {params:,} parameters, {trainable:,} trainable; "
          f"adapters + AdamW moments (fp32) {3 * 4 * trainable / 2**20:,.1f} MiB, the bf16 base "
          f"{2 * (params - trainable) / 2**30:,.1f} GiB")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    print("| model | parameters | trainable | checkpoint | save (median) |\n|---|---|---|---|---|")
    torch.manual_seed(0)
    full = measure("full fine-tune", transformers.LlamaForCausalLM(llama_config()), args.device)
    torch.manual_seed(0)
    lora = measure("LoRA r=8 (q, v)", with_lora(transformers.LlamaForCausalLM(llama_config())), args.device)
    print(f"LoRA / full checkpoint size: {lora / full:.4f}")
    seven_billion()


if __name__ == "__main__":
    main()
