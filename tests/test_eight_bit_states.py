"""The plan's 8-bit AdamW states leave embeddings 32-bit (bitsandbytes and torchao advise it): the
embedding rows a tiny Llama trains move as a plain loop moves them, and the plan says so."""

import pytest
import torch

from gpunb import Trainer

transformers = pytest.importorskip("transformers")
pytest.importorskip("torchao")
transformers.logging.set_verbosity_error()
VOCAB, SEEN = 512, 96  # the data uses the first SEEN token ids only


def tiny_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(config)


class States:
    """The optimizer's state as the run ends: the measures' optimizer, not the one given."""

    def on_fit_end(self, state):
        self.by_name = {name: state.optimizer.state[p] for name, p in state.model.named_parameters()
                        if p in state.optimizer.state}


def moved_rows(**options):
    """How far each embedding row moved in 40 steps (L2 norm), and the run's states and result."""
    model, states = tiny_llama(), States()
    before = model.model.embed_tokens.weight.detach().clone()
    ids = torch.randint(0, SEEN, (64, 16), generator=torch.Generator().manual_seed(1))
    result = Trainer(max_steps=40, batch_size=8, accelerator="cpu", track=False, lr=1e-2, **options).fit(
        model, [{"input_ids": row, "labels": row} for row in ids], callbacks=[states])
    return (model.model.embed_tokens.weight.detach() - before).norm(dim=1), states.by_name, result


def test_embeddings_keep_32_bit_states_under_8_bit_adamw_and_move_like_the_plain_loop():
    plain, _, _ = moved_rows(memory_plan=False)
    eight, states, result = moved_rows(optimizer_states="8bit")
    assert "8-bit AdamW states except embeddings (32,768 params, 32-bit)" in result.memory_plan
    embedding = states["model.embed_tokens.weight"]["exp_avg"]
    assert type(embedding) is torch.Tensor and embedding.dtype == torch.float32  # not torchao's 8-bit subclass
    mlp = states["model.layers.0.mlp.up_proj.weight"]["exp_avg"]  # 8,192 values: 8-bit by torchao's rule
    assert type(mlp).__name__ == "OptimState8bit"
    # the other parameters' 8-bit states change the gradients a little (each row within 0.3 of the
    # plain loop's, of about 0.7 moved); the embeddings' own updates are AdamW's (with 8-bit
    # embedding states, rows moved by up to thousands here)
    assert eight.max() < 1.5 * plain.max() and abs(eight[:SEEN].mean() / plain[:SEEN].mean() - 1) < 0.2
    assert (eight[SEEN:] - plain[SEEN:]).abs().max() < 1e-5  # rows the data never uses: weight decay alone


def test_the_plan_prices_the_embeddings_32_bit_states_under_8_bit_states():
    from gpunb.runtime.memory.plan import Footprint, estimate

    # 1,024 KiB of AdamW states, a quarter of them an embedding's
    states, kept = 1024 * 1024, 256 * 1024
    footprint = Footprint(weights=0, gradients=0, optimizer=states, activations=0, full_states=kept)
    lean = states - kept
    assert estimate(footprint, {"states_8bit"}) == lean // 4 + lean // 256 + kept
    # bf16 weights halve the states that stay in the weights' dtype, not the 8-bit ones
    with_bf16 = Footprint(weights=0, gradients=0, optimizer=states, activations=0, full_states=kept)
    assert estimate(with_bf16, {"states_8bit", "bf16_weights"}) == lean // 4 + lean // 256 + kept // 2


def test_the_footprint_counts_the_embeddings_share_of_the_states():
    from types import SimpleNamespace

    from gpunb.runtime.memory.planning import footprint_of
    from gpunb.runtime.step.objective import Objective

    model = torch.nn.Sequential(torch.nn.Embedding(300, 8), torch.nn.Linear(8, 100))  # 2,400 of 3,300 values
    summary = SimpleNamespace(weights_bytes=13_200, gradients_bytes=13_200, optimizer_bytes=26_400,
                              activations_bytes=0, ema_bytes=0, blocks=0, block_class="", block_saved_bytes=0,
                              block_input_bytes=0, tokens_per_sample=None, batch_size=1, device="cpu")
    objective = Objective(loss_fn=torch.nn.functional.mse_loss)
    footprint = footprint_of(summary, model, objective, 1, torch.optim.AdamW(model.parameters()))
    assert footprint.full_states == 26_400 * 2_400 // 3_300
