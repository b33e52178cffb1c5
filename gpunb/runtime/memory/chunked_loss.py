"""Cross-entropy of a Hugging Face causal LM, a chunk of the sequence at a time.

The model's own loss materialises the logits of the whole batch in fp32 (B x T x V x 4 bytes;
a 128k vocabulary at 2,048 tokens: 1 GiB a sample) and keeps them for backward. Here the
base model gives the hidden states, and each chunk of positions goes through the LM head and
the loss under activation checkpointing: only the hidden states are kept, one chunk's logits
exist at a time, in backward too. The value is the model's own (labels shifted inside, -100
ignored, the mean over the counted labels), up to the order of the sums.

Only architectures whose loss is exactly that (no logit soft-capping or scaling, no auxiliary
loss) take this path; `unsupported_reason` says why another does not. A compiled model's
wrapper is passed over here (the base model and the head are called as they are), so under
`compile` the chunked loss runs eagerly.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100
# model_type values whose causal LM computes its loss as plain cross-entropy of lm_head(hidden)
PLAIN_HEADS = ("llama", "mistral", "qwen2", "qwen3", "phi3", "olmo", "olmo2", "smollm3")


def causal_lm(model):
    """The Hugging Face causal LM in `model` (itself, or a PEFT model's base with its adapters)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def unsupported_reason(model) -> str | None:
    """None when `chunked_loss` computes this model's own loss; else why not."""
    lm = causal_lm(model)
    config = getattr(lm, "config", None)
    if config is None or not type(lm).__name__.endswith("ForCausalLM"):
        return "not a Hugging Face causal LM"
    if getattr(config, "model_type", None) not in PLAIN_HEADS:
        return f"its loss may not be plain cross-entropy ({getattr(config, 'model_type', None)!r} architecture)"
    head = lm.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or _decoder(lm) is None:
        return "its LM head or base model is not where Hugging Face puts them"
    return None


def vocabulary(model) -> int:
    return causal_lm(model).get_output_embeddings().out_features


def chunked_loss(model, batch, chunks: int) -> torch.Tensor:
    """The model's own loss for a dict batch with `labels`, the LM head applied per chunk."""
    lm = causal_lm(model)
    inputs = {key: value for key, value in batch.items() if key != "labels"}
    hidden = _decoder(lm)(**inputs).last_hidden_state  # (B, T, H)
    # the label of position t is the token at t + 1: shift left, the last position counts for nothing
    targets = F.pad(batch["labels"], (0, 1), value=IGNORE_INDEX)[:, 1:]
    head = functools.partial(_chunk_loss, lm.get_output_embeddings())
    total = hidden.new_zeros((), dtype=torch.float32)
    for states, labels in zip(hidden.chunk(chunks, dim=1), targets.chunk(chunks, dim=1)):
        total = total + checkpoint(head, states, labels, use_reentrant=False)
    return total / (targets != IGNORE_INDEX).sum()


def _chunk_loss(head, states, labels):
    logits = head(states).float()  # as the model's own loss: fp32 logits
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def _decoder(lm):
    decoder = lm.get_decoder() if hasattr(lm, "get_decoder") else None
    return decoder if decoder is not None else getattr(lm, getattr(lm, "base_model_prefix", "model"), None)
