"""`activation_checkpointing=True` checkpoints the model's repeated blocks, as the memory plan does:
a Llama's decoder layers (not `LlamaModel` and `lm_head` whole), a PEFT model's decoder layers
inside it (not the whole `LoraModel`).

What a step keeps for backward is counted with `saved_tensors_hooks` (deterministic on the CPU):
a non-reentrant checkpoint saves its region's tensors under hooks of its own, so the count is
what is kept outside the checkpointed regions. It must equal the count with each decoder layer
checkpointed by hand, and be well under the count without checkpointing."""

import functools

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from gpunb import Trainer

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
VOCAB, LENGTH, LAYERS = 96, 32, 4


def tiny_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=LENGTH)
    return transformers.LlamaForCausalLM(config)


def lora(model):
    peft = pytest.importorskip("peft")
    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))


def tokens(n=8):
    ids = torch.randint(0, VOCAB, (n, LENGTH), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row, "labels": row} for row in ids]


class SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """Bytes of the distinct storages autograd saves for backward, parameters excepted."""

    def __init__(self, model):
        self.bytes, self.seen = 0, {p.untyped_storage().data_ptr() for p in model.parameters()}
        super().__init__(self.pack, lambda tensor: tensor)

    def pack(self, tensor):
        pointer = tensor.untyped_storage().data_ptr()
        if pointer not in self.seen:
            self.seen.add(pointer)
            self.bytes += tensor.untyped_storage().nbytes()
        return tensor


def saved_bytes(model) -> int:
    """One forward + backward in training mode; the gradients are dropped."""
    batch = {k: torch.stack([row[k] for row in tokens(4)]) for k in ("input_ids", "labels")}
    model.train()
    counter = SavedBytes(model)
    with counter:
        loss = model(**batch).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return counter.bytes


class Measure:
    """Counts what the model gpunb trains keeps for backward, with gpunb's checkpointing in place."""

    def on_fit_start(self, state):
        self.bytes = saved_bytes(state.model)


def decoder_layers(model):
    return [m for m in model.modules() if type(m).__name__ == "LlamaDecoderLayer"]


def by_hand(model):
    """The reference: each decoder layer's forward checkpointed by hand, nothing else."""
    for layer in decoder_layers(model):
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)
    return model


@pytest.mark.parametrize("make", [tiny_llama, lambda: lora(tiny_llama())], ids=["llama", "peft-lora"])
def test_checkpointing_wraps_the_decoder_layers_and_keeps_what_the_per_layer_reference_keeps(make):
    plain, reference = saved_bytes(make()), saved_bytes(by_hand(make()))
    measure, model = Measure(), make()
    result = Trainer(max_steps=1, batch_size=4, accelerator="cpu", track=False,
                     activation_checkpointing=True).fit(model, tokens(), callbacks=[measure])
    assert measure.bytes == reference < plain / 2
    assert (result.summary.blocks, result.summary.block_class) == (LAYERS, "LlamaDecoderLayer")
    assert f"{LAYERS} LlamaDecoderLayer" in str(result.summary)
    # undone at the end: the layers no longer checkpoint, the model's forward is its own
    assert not any(layer.__dict__.get("gradient_checkpointing") for layer in decoder_layers(model))
    assert saved_bytes(model) == plain
