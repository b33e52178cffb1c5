"""What trains and what stays frozen, for checkpoints that hold only what trains.

A model with frozen parameters (LoRA adapters on a frozen base, a new head on a frozen
backbone) is checkpointed as its trainable parameters and its buffers, beside a
fingerprint of the frozen rest: each frozen tensor's name, shape, dtype and a digest of a
few of its values. A LoRA checkpoint of a 7B model is then megabytes instead of 14 GB,
and resuming it onto another base model is refused, naming the tensors that differ,
instead of training the adapters on weights they were not made for.

Buffers stay in the checkpoint: they are small (BatchNorm statistics, counters, rotary
tables), and a frozen module in train mode still updates its running statistics, so an
exact resume needs them. Tensors a layer saves beside its weights that are neither
parameters nor buffers (a bitsandbytes layer's quantization scales) belong to the frozen
weight they describe.

The digest samples values instead of reading every byte: computing it for a 7B base
costs a few hundred small copies, not a pass over 14 GB, and two different pretrained
(or fine-tuned) bases differ in nearly every value, so 16 evenly spaced ones tell them
apart. The values are compared exactly, so the fingerprint is the same on any device.
"""

from __future__ import annotations

import hashlib

import torch

_SAMPLES = 16  # values per frozen tensor in its digest
_LISTED = 8  # tensors named per kind of difference


def has_frozen(model: torch.nn.Module) -> bool:
    """Whether any parameter of `model` is frozen (`requires_grad=False`)."""
    return any(not p.requires_grad for p in model.parameters())


def parameter_count(param: torch.Tensor) -> int:
    """The weights a parameter stands for: a bitsandbytes 4-bit parameter packs two in each byte
    of its storage (peft's count does the same)."""
    if type(param).__name__ == "Params4bit":
        return param.numel() * 2 * param.element_size()
    return param.numel()


def frozen_keys(model: torch.nn.Module) -> list[str]:
    """The state_dict keys of what does not train, in state_dict order: frozen parameters and
    the tensors saved beside them that are not buffers (a quantized layer's scales)."""
    buffers = {id(b) for b in model.buffers()}
    frozen = []
    for name, value in model.state_dict(keep_vars=True).items():
        if isinstance(value, torch.nn.Parameter):
            if not value.requires_grad:
                frozen.append(name)
        elif torch.is_tensor(value) and id(value) not in buffers:
            frozen.append(name)
    return frozen


def split_state(model: torch.nn.Module, state: dict) -> tuple[dict, dict | None]:
    """(what trains, the fingerprint of the rest) of `state`, the model's state_dict; a model
    without frozen parameters: (`state` whole, None)."""
    kept = trainable_part(model, state)
    if kept is state:
        return state, None
    return kept, fingerprint({name: value for name, value in state.items() if name not in kept})


def trainable_part(model: torch.nn.Module, state: dict) -> dict:
    """`state` less the frozen entries (the whole of it for a model without frozen parameters)."""
    if not has_frozen(model):
        return state
    frozen = set(frozen_keys(model))
    return {name: value for name, value in state.items() if name not in frozen}


def fingerprint(tensors: dict) -> dict:
    """{name: [shape, dtype, digest]}: plain lists and strings (a weights_only load reads them)."""
    return {name: [list(t.shape), str(t.dtype).removeprefix("torch."), _digest(t)] for name, t in tensors.items()}


def _digest(tensor: torch.Tensor) -> str:
    """A digest of up to _SAMPLES evenly spaced values of `tensor` (its bytes, exactly)."""
    tensor = tensor.detach()
    if tensor.is_meta:
        return "meta"
    count = tensor.numel()
    if count == 0:
        return "empty"
    if tensor.dim() == 0:
        values = tensor.reshape(1)
    else:  # picked by their positions: no flattened copy of a non-contiguous tensor
        index = torch.linspace(0, count - 1, min(count, _SAMPLES), device=tensor.device).round().long()
        values = tensor[torch.unravel_index(index, tensor.shape)]
    values = values.to("cpu").contiguous()
    if values.dtype.is_complex:
        values = torch.view_as_real(values).reshape(-1)
    raw = values.view(torch.uint8) if values.element_size() > 1 or values.dtype == torch.bool else values
    return hashlib.blake2b(raw.numpy().tobytes(), digest_size=8).hexdigest()


def base_problems(model: torch.nn.Module, saved: dict) -> list[str]:
    """How `model`'s frozen tensors differ from the fingerprint `saved` of a checkpoint's base."""
    current = model.state_dict()
    absent = [name for name in saved if name not in current]
    here = fingerprint({name: current[name] for name in saved if name in current})
    layout = [f"{name}: checkpoint {tuple(saved[name][0])} {saved[name][1]}, model {tuple(shape)} {dtype}"
              for name, (shape, dtype, _) in here.items() if [shape, dtype] != list(saved[name][:2])]
    values = [name for name, entry in here.items() if list(saved[name][:2]) == entry[:2] and saved[name][2] != entry[2]]
    problems = []
    if absent:
        problems.append("frozen tensors of the checkpoint's base that this model lacks: " + _names(absent))
    problems += [f"shape or dtype differs {line}" for line in layout[:_LISTED]]
    if len(layout) > _LISTED:
        problems.append(f"... and {len(layout) - _LISTED} more shape or dtype differences")
    if values:
        problems.append(f"other values in {len(values)} of {len(saved)} frozen tensors: " + _names(values))
    return problems


def load_weights(model: torch.nn.Module, state: dict) -> None:
    """`model.load_state_dict(state)`, where `state` may leave out the frozen tensors (a
    checkpoint that holds only what trains); anything else missing or unexpected raises
    RuntimeError, as a strict load does."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    if not missing and not unexpected:
        return
    frozen = set(frozen_keys(model)) if missing else set()
    missing = [name for name in missing if name not in frozen]
    if missing or unexpected:
        parts = ([f"Missing key(s): {_names(missing)}"] if missing else []) + \
                ([f"Unexpected key(s): {_names(unexpected)}"] if unexpected else [])
        raise RuntimeError(f"Error(s) in loading state_dict for {type(model).__name__}: " + "; ".join(parts))


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:_LISTED])
    return shown + (f" and {len(names) - _LISTED} more" if len(names) > _LISTED else "")
