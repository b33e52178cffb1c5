"""A model's repeated blocks (a transformer's layers), and activation checkpointing of some of them.

The blocks are the largest `ModuleList` (or `Sequential`) whose items are all of one class,
by parameter count: a Llama's 32 `LlamaDecoderLayer`s, a GPT's `h`. Checkpointing the first
`count` of them keeps only each one's input and recomputes the rest in backward.

A Hugging Face layer (`GradientCheckpointingLayer`) checkpoints itself when its
`gradient_checkpointing` flag is set, turning off the KV cache the recompute would update a
second time: the plan sets those flags, per layer, as `gradient_checkpointing_enable()` does
for all. Older Hugging Face models are switched whole by that method; other models have the
forward of each chosen block wrapped in `torch.utils.checkpoint` (non-reentrant).
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

from gpunb.runtime.step.wrap import model_blocks


def repeated_blocks(model: torch.nn.Module) -> tuple[str, list]:
    """(qualified name, blocks) of the largest list of identical blocks; ("", []) when none."""
    best, best_size = ("", []), 0
    for name, module in model.named_modules():
        if not isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)) or len(module) < 2:
            continue
        items = list(module)
        if len({type(item) for item in items}) != 1:
            continue
        size = sum(p.numel() for p in module.parameters())
        if size > best_size:
            best, best_size = (name, items), size
    return best


def checkpoint_every_block(model: torch.nn.Module):
    """`activation_checkpointing=True`: every repeated block, as the plan checkpoints them (a
    Hugging Face model's layers by their own switch, a PEFT model's decoder layers inside it);
    a model without repeated blocks: each direct child with parameters. Returns the undo."""
    _, blocks = repeated_blocks(model)
    blocks = blocks or model_blocks(model)
    return checkpoint_blocks(model, blocks, len(blocks))


def checkpoint_blocks(model: torch.nn.Module, blocks: list, count: int):
    """Checkpoint the first `count` of `blocks`; returns a function that undoes it."""
    chosen = blocks[:count]
    if not chosen:
        return lambda: None
    if all(hasattr(block, "gradient_checkpointing") for block in blocks):
        return _hugging_face_layers(model, chosen)
    whole = _hugging_face_model(model)
    if whole is not None and count == len(blocks):
        whole.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return whole.gradient_checkpointing_disable
    for block in chosen:
        block.forward = functools.partial(_checkpointed, block.forward)

    def restore():
        for block in chosen:
            block.__dict__.pop("forward", None)

    return restore


def _hugging_face_layers(model, chosen):
    """The per-layer switch of transformers' GradientCheckpointingLayer (what its
    `_set_gradient_checkpointing` sets on each layer), for some layers only."""
    config = getattr(model, "config", None)
    use_cache = getattr(config, "use_cache", None)
    if use_cache:
        config.use_cache = False  # a cache written in forward would be written again in the recompute
    saved = [(block, block.__dict__.get("gradient_checkpointing"), block.__dict__.get("_gradient_checkpointing_func"))
             for block in chosen]
    for block in chosen:
        block._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False)
        block.gradient_checkpointing = True

    def restore():
        if use_cache:
            config.use_cache = use_cache
        for block, flag, func in saved:
            for name, value in (("gradient_checkpointing", flag), ("_gradient_checkpointing_func", func)):
                if value is None:
                    block.__dict__.pop(name, None)
                else:
                    setattr(block, name, value)

    return restore


def _hugging_face_model(model):
    """The Hugging Face model inside `model` (itself, or a PEFT wrapper's) that can switch
    checkpointing on for all its layers, or None."""
    for module in model.modules():
        if getattr(module, "supports_gradient_checkpointing", False) and hasattr(module, "gradient_checkpointing_enable"):
            return module
    return None


def _checkpointed(forward, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)  # validation: nothing to save memory on
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)
