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

The digest reads every value, so a base that differs in one row, or in one value, is told
apart: it is computed once a fit (the frozen weights never change in one), on the device
where the weights live, in exact integer arithmetic (the same digest on every device), and
never copies the weights to the host (see _digest). Checkpoints written before it hold a
digest of 16 sampled values, which is still compared, as it was.
"""

from __future__ import annotations

import hashlib

import torch

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


def split_state(model: torch.nn.Module, state: dict, known: dict | None = None) -> tuple[dict, dict | None]:
    """(what trains, the fingerprint of the rest) of `state`, the model's state_dict; a model
    without frozen parameters: (`state` whole, None). `known`: the fingerprint of the model's
    frozen tensors, already computed in this fit (frozen_fingerprint)."""
    kept = trainable_part(model, state)
    if kept is state:
        return state, None
    if known is not None:
        return kept, known
    return kept, fingerprint({name: value for name, value in state.items() if name not in kept})


def frozen_fingerprint(model: torch.nn.Module) -> dict:
    """The fingerprint of `model`'s frozen tensors, as split_state writes it into a checkpoint."""
    state = model.state_dict()
    return fingerprint({name: state[name] for name in frozen_keys(model)})


def trainable_part(model: torch.nn.Module, state: dict) -> dict:
    """`state` less the frozen entries (the whole of it for a model without frozen parameters)."""
    if not has_frozen(model):
        return state
    frozen = set(frozen_keys(model))
    return {name: value for name, value in state.items() if name not in frozen}


def fingerprint(tensors: dict) -> dict:
    """{name: [shape, dtype, digest]}: plain lists and strings (a weights_only load reads them)."""
    tables = {}  # per device: the powers _digest multiplies by, made once per call
    return {name: [list(t.shape), str(t.dtype).removeprefix("torch."), _digest(t, tables)]
            for name, t in tensors.items()}


# The digest of a tensor: two polynomial hashes of all its bytes, read as 16-bit words (8-bit
# ones when their count is odd), each  sum_j word_j * base**j  modulo a prime below 2**31. Two
# words differ by less than either prime, so tensors that differ in one value never share a
# digest; others do by chance about once in 2**62. The products are summed in rows of _ROW
# words, whose sums stay below 2**62 (a word below 2**15 in size, a power below 2**31), so
# int64 is exact; a chunk of _CHUNK words at a time bounds the temporaries (~96 MiB a chunk).
_SCHEME = "all:"  # digests of every value; older checkpoints hold SAMPLES sampled values without it
_PRIMES = (2_147_483_647, 2_147_483_629)
_BASES = (1_000_003, 911_382_323)
_ROW = 1 << 16
_CHUNK = 1 << 22
SAMPLES = 16  # values per frozen tensor in an older checkpoint's digest


def _digest(tensor: torch.Tensor, tables: dict) -> str:
    """The digest of every value of `tensor`, on its device; the host receives two numbers a chunk."""
    tensor = tensor.detach()
    if tensor.is_meta:
        return "meta"
    if tensor.numel() == 0:
        return "empty"
    words = _words(tensor)
    if words.device not in tables:
        tables[words.device] = _powers(words.device)
    columns, rows = tables[words.device]
    chunks = torch.stack([_chunk_digest(words[start:start + _CHUNK], columns, rows)
                          for start in range(0, words.numel(), _CHUNK)]).tolist()
    digest = ""
    for k, (prime, base) in enumerate(zip(_PRIMES, _BASES)):
        step, total = pow(base, _CHUNK, prime), 0
        for value in reversed(chunks):  # Horner: chunk c counts base ** (c * _CHUNK) times
            total = (total * step + value[k]) % prime
        digest += f"{total:08x}"
    return _SCHEME + digest


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as one row of 16-bit words (8-bit for an odd count), on its device."""
    if tensor.is_quantized:
        tensor = tensor.int_repr()
    flat = tensor.contiguous().view(-1)  # a copy (on the device) only when the tensor is not contiguous
    raw = flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat
    if raw.numel() % 2:
        return raw
    try:
        return raw.view(torch.int16)
    except RuntimeError:  # bytes that start at an odd address: the same words from an aligned copy
        return raw.clone().view(torch.int16)


def _chunk_digest(words: torch.Tensor, columns: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """(2,) int64: for each prime, sum_j words[j] * base**j over the chunk, modulo the prime."""
    count = words.numel()
    width = min(count, _ROW)  # a small tensor is one short row
    padded = torch.zeros(-(-count // width) * width, dtype=torch.int64, device=words.device)
    padded[:count] = words  # zeros add nothing; the tensor's shape is in the fingerprint beside it
    padded = padded.view(1, -1, width)
    primes = torch.tensor(_PRIMES, dtype=torch.int64, device=words.device).view(2, 1)
    sums = (padded * columns[:, :width].reshape(2, 1, width)).sum(-1).remainder(primes)  # (2, rows)
    return (sums * rows[:, :sums.shape[1]]).remainder(primes).sum(-1).remainder(primes[:, 0])


def _powers(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """base**j for j < _ROW (within a row) and base**(i * _ROW) for the rows of a chunk, per prime."""
    primes = torch.tensor(_PRIMES, dtype=torch.int64).view(2, 1)
    columns = torch.ones(2, 1, dtype=torch.int64)
    while columns.shape[1] < _ROW:  # doubling: the next powers are these times base**(their count)
        times = torch.tensor([pow(b, columns.shape[1], p) for b, p in zip(_BASES, _PRIMES)]).view(2, 1)
        columns = torch.cat([columns, (columns * times).remainder(primes)], dim=1)
    rows = torch.tensor([[pow(b, i * _ROW, p) for i in range(_CHUNK // _ROW)] for b, p in zip(_BASES, _PRIMES)])
    return columns[:, :_ROW].to(device), rows.to(device)


def _sampled_digest(tensor: torch.Tensor) -> str:
    """The digest of older checkpoints: SAMPLES evenly spaced values of `tensor` (its bytes, exactly)."""
    tensor = tensor.detach()
    if tensor.is_meta:
        return "meta"
    count = tensor.numel()
    if count == 0:
        return "empty"
    if tensor.dim() == 0:
        values = tensor.reshape(1)
    else:  # picked by their positions: no flattened copy of a non-contiguous tensor
        index = torch.linspace(0, count - 1, min(count, SAMPLES), device=tensor.device).round().long()
        values = tensor[torch.unravel_index(index, tensor.shape)]
    values = values.to("cpu").contiguous()
    if values.dtype.is_complex:
        values = torch.view_as_real(values).reshape(-1)
    raw = values.view(torch.uint8) if values.element_size() > 1 or values.dtype == torch.bool else values
    return hashlib.blake2b(raw.numpy().tobytes(), digest_size=8).hexdigest()


def base_problems(model: torch.nn.Module, saved: dict, here: dict | None = None) -> list[str]:
    """How `model`'s frozen tensors differ from the fingerprint `saved` of a checkpoint's base;
    `here`: frozen_fingerprint(model), when the caller has it."""
    current = model.state_dict()
    absent = [name for name in saved if name not in current]
    here = dict(here or {})
    others = {name: current[name] for name in saved if name in current and name not in here}
    here.update(fingerprint(others) if others else {})  # tensors the model does not freeze (a mismatch)
    layout = [f"{name}: checkpoint {tuple(saved[name][0])} {saved[name][1]}, model {tuple(here[name][0])} "
              f"{here[name][1]}" for name in saved if name in here and here[name][:2] != list(saved[name][:2])]
    values = [name for name in saved if name in here and here[name][:2] == list(saved[name][:2])
              and saved[name][2] != _digest_like(saved[name][2], here[name][2], current[name])]
    problems = []
    if absent:
        problems.append("frozen tensors of the checkpoint's base that this model lacks: " + _names(absent))
    problems += [f"shape or dtype differs {line}" for line in layout[:_LISTED]]
    if len(layout) > _LISTED:
        problems.append(f"... and {len(layout) - _LISTED} more shape or dtype differences")
    if values:
        problems.append(f"other values in {len(values)} of {len(saved)} frozen tensors: " + _names(values))
    return problems


def _digest_like(saved: str, digest: str, tensor: torch.Tensor) -> str:
    """The model's digest of `tensor` in the scheme of the `saved` one (an older checkpoint sampled)."""
    if saved.startswith(_SCHEME) or saved in ("meta", "empty"):
        return digest
    return _sampled_digest(tensor)


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
