"""The memory plan: the planner's choices against hand-computed estimates, each measure against
the plain computation, and the plan in fit (none when it fits, the user's kept, off, too large,
and the next measure after an OOM the micro-batch split cannot fix)."""

import copy
from dataclasses import replace

import pytest
import torch
from torch import nn

from gpunb import Trainer
from gpunb.errors import GpunbError
from gpunb.runtime.memory.blocks import checkpoint_blocks, repeated_blocks
from gpunb.runtime.memory.in_backward import OptimizerInBackward
from gpunb.runtime.memory.measures import Measure
from gpunb.runtime.memory.plan import Footprint, estimate, plan_memory, split_micro_batch

MiB = 2**20
# Hand-made parts (MiB): 100 weights + 100 gradients + 200 AdamW states + 180 activations = 580,
# of which 10 blocks save 15 each and keep an input of 1 when checkpointed (saving 14 each, less
# the 15 of the block being recomputed); the chunked loss leaves 2.5 of 20 MiB of logits.
PARTS = Footprint(weights=100 * MiB, gradients=100 * MiB, optimizer=200 * MiB, activations=180 * MiB,
                  blocks=10, block_class="Layer", block_saved=150 * MiB, block_inputs=10 * MiB, logits=20 * MiB,
                  largest_gradient=10 * MiB, float_weights=100 * MiB, float_gradients=100 * MiB)


@pytest.mark.parametrize("budget, measures, blocks", [
    (700, (), 0),  # 580 <= 0.9 x 700
    (600, ("optimizer_in_backward",), 0),  # gradients 100 -> 10: 490 <= 540
    (500, ("states_8bit",), 0),  # states 200 -> 50.8: 430.8 <= 450, cheaper (5%) than any checkpointing
    (400, ("optimizer_in_backward", "states_8bit"), 0),  # 340.8 <= 360
    # 340.8 - 17.5 (chunked) - 5 x 14 + 15 = 268.3 <= 270; 4 blocks leave 282.3
    (300, ("chunked_loss", "optimizer_in_backward", "states_8bit", "checkpointing"), 5),
    # only the host takes states and gradients away: 290 - 17.5 - 8 x 14 + 15 = 175.5 <= 180
    (200, ("chunked_loss", "checkpointing", "states_cpu"), 8),
])
def test_the_planner_takes_the_cheapest_set_that_fits(budget, measures, blocks):
    plan = plan_memory(PARTS, budget * MiB)
    assert plan.fits and set(plan.names) == set(measures) and plan.checkpointed_blocks == blocks
    assert plan.before == 580 * MiB and plan.after == estimate(PARTS, measures, blocks) <= 0.9 * budget * MiB
    assert [m.bytes_after for m in plan.measures] == sorted((m.bytes_after for m in plan.measures), reverse=True)


def test_when_nothing_fits_the_plan_holds_what_saves_most_and_says_so():
    plan = plan_memory(PARTS, 100 * MiB)
    # bf16: weights 50, gradients 10, states on the host; activations 180 - 17.5 - 140 + 15 = 37.5
    assert not plan.fits and set(plan.names) == {"bf16_weights", "states_cpu", "chunked_loss", "checkpointing"}
    assert plan.checkpointed_blocks == 10 and plan.fixed_after == 60 * MiB
    assert "over the budget" in plan.text()


def test_unavailable_measures_are_left_out_and_the_users_own_kept():
    plan = plan_memory(PARTS, 500 * MiB, unavailable={"states_8bit": "no torchao"})
    # 472.5 - 3 x 14 + 15 = 445.5 <= 450 (2 blocks leave 459.5), cheaper than 4 blocks without the chunks
    assert set(plan.names) == {"chunked_loss", "optimizer_in_backward", "checkpointing"}
    assert plan.checkpointed_blocks == 3 and plan.unavailable == {"states_8bit": "no torchao", "fsdp": "one device"}
    kept = plan_memory(PARTS, 700 * MiB, kept=("checkpointing",))
    assert kept.names == ("checkpointing",) and kept.checkpointed_blocks == 10 and kept.kept == ("checkpointing",)
    assert kept.text().startswith("plan: activation checkpointing on 10 Layer blocks: ")
    assert "checkpointing" not in plan_memory(PARTS.__class__(**{**PARTS.__dict__, "blocks": 0}), 300 * MiB).names


NONE = {m: "ruled out here" for m in ("chunked_loss", "checkpointing", "optimizer_in_backward", "states_8bit",
                                       "states_cpu", "bf16_weights")}


def test_a_plan_over_the_budget_by_its_activations_cuts_the_batch_into_micro_batches_and_says_so():
    plan = plan_memory(PARTS, 500 * MiB, NONE)  # 400 fixed + 180 of activations at batch 8; 450 usable
    assert not plan.fits and plan.fixed_after == 400 * MiB
    split = split_micro_batch(plan, 8)  # micro-batch 3 leaves 467.5; 2 leaves 445
    assert split.fits and (split.micro_batches, split.micro_batch, split.after) == (4, 2, 445 * MiB)
    assert split.text() == ("plan: micro-batches of 2 (4 a step of 8, the gradients accumulated): 445.0 MiB of "
                            "500.0 MiB; expected step time +0%")
    assert split_micro_batch(plan_memory(PARTS, 700 * MiB, NONE), 8).micro_batches == 1  # fits as it is


def test_a_plan_that_no_micro_batch_can_fit_says_so_plainly():
    plan = split_micro_batch(plan_memory(PARTS, 460 * MiB, NONE), 8)  # 414 usable: 1 sample leaves 422.5
    assert not plan.fits and plan.micro_batches == 1
    assert "over the budget by the activations even at a micro-batch of 1 sample: it trains at micro-batch 8 " \
           "as asked, and may run out of memory" in plan.text()
    assert "follow" not in plan.text()


def test_the_expected_cost_is_priced_for_the_device_and_the_measured_one_said_beside_it():
    cpu = plan_memory(replace(PARTS, device="cpu"), 500 * MiB)
    cuda = plan_memory(PARTS, 500 * MiB)
    assert cuda.names == ("states_8bit",)  # +5% on a GPU: cheaper than any checkpointing
    assert "states_8bit" not in cpu.names  # on a CPU 8-bit states cost most of a step
    cpu.measured, cpu.measured_note = 0.5, "3 steps with and 2 x 3 without, before the first step"
    assert cpu.text().endswith(f"expected step time +{100 * cpu.slowdown:.0f}%, measured +50% "
                               "(3 steps with and 2 x 3 without, before the first step)")


def test_the_plan_text_names_each_measure_and_the_expected_cost():
    plan = plan_memory(PARTS, 300 * MiB)
    assert plan.text() == ("plan: chunked cross-entropy + optimizer step fused into backward + 8-bit AdamW states "
                           "+ activation checkpointing on 5 of 10 Layer blocks: 268.3 MiB of 300.0 MiB; "
                           "expected step time +26%")


# ---------------------------------------------------------------- each measure against the plain computation
class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    """Six identical blocks; `limit`: a fake allocator that runs out above that many bytes saved for backward."""

    def __init__(self, width=64, depth=6):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 3)
        self.limit = None

    def forward(self, x):
        with FakeLimit(self.limit) if self.limit else _nothing():
            for block in self.blocks:
                x = block(x)
            return self.head(x)


class FakeLimit(torch.autograd.graph.saved_tensors_hooks):
    """Raises torch.OutOfMemoryError once a forward saves more than `limit` bytes for backward
    (a checkpointed block's own saves go to the checkpoint's hooks, not here)."""

    def __init__(self, limit):
        self.held, self.limit, self.seen = 0, limit, set()
        super().__init__(self.pack, lambda tensor: tensor)

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        if not isinstance(tensor, nn.Parameter) and storage.data_ptr() not in self.seen:
            self.seen.add(storage.data_ptr())
            self.held += storage.nbytes()
            if self.held > self.limit:
                raise torch.OutOfMemoryError(f"fake limit: {self.held} > {self.limit} bytes")
        return tensor


def _nothing():
    import contextlib

    return contextlib.nullcontext()


def tiny_llama(layers=2):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def token_batch(samples=3, length=16):
    ids = torch.randint(0, 96, (samples, length), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, -4:] = -100  # padding the loss leaves out
    return {"input_ids": ids, "labels": labels}


def gradients(model, loss_of):
    model.zero_grad(set_to_none=True)
    loss = loss_of(model)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_the_repeated_blocks_are_the_largest_list_of_one_class():
    assert repeated_blocks(Net())[0] == "blocks" and len(repeated_blocks(Net())[1]) == 6
    name, layers = repeated_blocks(tiny_llama())
    assert name == "model.layers" and [type(b).__name__ for b in layers] == ["LlamaDecoderLayer"] * 2
    assert repeated_blocks(nn.Sequential(nn.Linear(2, 3), nn.ReLU())) == ("", [])


@pytest.mark.parametrize("count", [3, 6])
def test_checkpointing_some_blocks_gives_the_same_gradients_and_is_undone(count):
    torch.manual_seed(0)
    model, x = Net(), torch.randn(8, 64)
    plain = gradients(model, lambda m: m(x).square().mean())
    undo = checkpoint_blocks(model, model.blocks, count)
    assert sum("forward" in block.__dict__ for block in model.blocks) == count
    checkpointed = gradients(model, lambda m: m(x).square().mean())
    undo()
    assert not any("forward" in block.__dict__ for block in model.blocks)
    assert torch.equal(plain[0], checkpointed[0]) and all(map(torch.equal, plain[1], checkpointed[1]))


@pytest.mark.parametrize("count", [1, 2])
def test_hugging_face_layers_are_checkpointed_one_by_one_with_the_same_gradients(count):
    model, batch = tiny_llama(), token_batch()
    model.train()
    plain = gradients(model, lambda m: m(**batch).loss)
    undo = checkpoint_blocks(model, list(model.model.layers), count)
    assert [layer.gradient_checkpointing for layer in model.model.layers] == [True] * count + [False] * (2 - count)
    assert model.config.use_cache is False
    checkpointed = gradients(model, lambda m: m(**batch).loss)
    undo()
    assert not any(layer.gradient_checkpointing for layer in model.model.layers) and model.config.use_cache
    assert torch.equal(plain[0], checkpointed[0]) and all(map(torch.equal, plain[1], checkpointed[1]))


@pytest.mark.parametrize("lora", [False, True])
def test_the_chunked_loss_equals_the_models_own_loss_and_gradients(lora):
    from gpunb.runtime.memory.chunked_loss import chunked_loss, unsupported_reason

    model, batch = tiny_llama(), token_batch()
    if lora:  # the adapters are in the base model's layers: the chunks go through them
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                           init_lora_weights=False))
    assert unsupported_reason(model) is None and unsupported_reason(Net()) == "not a Hugging Face causal LM"
    own = gradients(model, lambda m: m(**batch).loss)
    chunked = gradients(model, lambda m: chunked_loss(m, batch, chunks=4))
    # the same sums in another order: fp32 rounding only
    assert torch.allclose(own[0], chunked[0], rtol=1e-6, atol=1e-6)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(own[1], chunked[1]))


def test_the_optimizer_in_backward_takes_the_same_steps_and_saves_a_plain_state():
    torch.manual_seed(0)
    model, x = Net(), torch.randn(16, 64)
    fused = copy.deepcopy(model)
    plain = torch.optim.AdamW(model.parameters(), lr=1e-2)
    in_backward = OptimizerInBackward(torch.optim.AdamW(fused.parameters(), lr=1e-2).param_groups,
                                      lambda groups: torch.optim.AdamW(groups))
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1 / (step + 1)) for o in (plain, in_backward)]
    for _ in range(4):
        model(x).square().mean().backward()
        plain.step()
        plain.zero_grad()
        fused(x).square().mean().backward()
        assert all(p.grad is None for p in fused.parameters())  # freed as they were used
        in_backward.step()
        for schedule in schedules:
            schedule.step()
    assert all(map(torch.equal, model.parameters(), fused.parameters()))
    reloaded = torch.optim.AdamW(model.parameters())
    reloaded.load_state_dict(in_backward.state_dict())  # a checkpoint loads into the optimizer it replaces
    assert reloaded.param_groups[0]["lr"] == plain.param_groups[0]["lr"]
    assert all(torch.equal(reloaded.state[p]["exp_avg"], plain.state[p]["exp_avg"]) for p in model.parameters())
    in_backward.close()
    fused(x).sum().backward()
    assert all(p.grad is not None for p in fused.parameters())  # no hook steps any more


def _train_linear(make, dtype, steps=30):
    torch.manual_seed(0)
    x = torch.randn(256, 128)
    y = x @ torch.randn(128, 64)
    torch.manual_seed(1)
    model = nn.Linear(128, 64).to(dtype)
    optimizer = make(model.parameters())
    torch.manual_seed(2)
    for _ in range(steps):
        ((model(x.to(dtype)).float() - y) ** 2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.weight.detach().float()


def test_bf16_weights_with_stochastic_rounding_follow_the_fp32_update():
    optim = pytest.importorskip("torchao.optim")
    start = _train_linear(lambda p: torch.optim.AdamW(p, lr=0.0), torch.float32, steps=1)
    fp32 = _train_linear(lambda p: torch.optim.AdamW(p, lr=1e-4), torch.float32)
    rounded = _train_linear(lambda p: optim._AdamW(p, lr=1e-4, bf16_stochastic_round=True), torch.bfloat16)
    nearest = _train_linear(lambda p: torch.optim.AdamW(p, lr=1e-4), torch.bfloat16)
    moved = (fp32 - start).abs().mean()
    # updates far below bf16's spacing are lost when rounded to nearest, and kept on average stochastically
    assert (rounded - fp32).abs().mean() < 0.3 * moved < (nearest - fp32).abs().mean()


def test_8bit_states_follow_the_fp32_update():
    optim = pytest.importorskip("torchao.optim")
    start = _train_linear(lambda p: torch.optim.AdamW(p, lr=0.0), torch.float32, steps=1)
    fp32 = _train_linear(lambda p: torch.optim.AdamW(p, lr=1e-3), torch.float32, steps=5)
    eight = _train_linear(lambda p: optim.AdamW8bit(p, lr=1e-3), torch.float32, steps=5)
    # quantised moments: the weights drift by about 1% of how far they moved (measured: 5.1e-5 of 5.0e-3)
    assert (eight - fp32).abs().mean() < 0.02 * (fp32 - start).abs().mean()


# ---------------------------------------------------------------- the plan in fit
def fit(budget=None, limit=None, batch_size=64, max_steps=3, **options):
    torch.manual_seed(0)
    model = Net()
    model.limit = limit
    x, y = torch.randn(256, 64), torch.randint(0, 3, (256,))
    result = Trainer(max_steps=max_steps, batch_size=batch_size, track=False, memory_budget=budget, **options).fit(
        model, (x, y), loss_fn=nn.CrossEntropyLoss())
    return model, result


def test_a_run_that_fits_gets_no_measure():
    model, result = fit()
    assert result.memory_plan == "" and result.summary.plan == "" and "plan" not in repr(result.summary)
    assert result.summary.blocks == 6 and result.summary.block_class == "Block"
    assert not any("forward" in block.__dict__ for block in model.blocks)


@pytest.fixture
def gpu_prices(monkeypatch):
    """Measures priced as on a GPU, where the step in backward is cheaper than checkpointing 2 of
    Net's 6 blocks (on a CPU it is the other way round)."""
    from gpunb.runtime.memory.measures import MEASURES

    for measure in MEASURES:
        monkeypatch.setattr(measure, "slowdowns", {**measure.slowdowns, "cpu": measure.slowdowns["cuda"]})


def test_a_tight_budget_fuses_the_step_into_backward_with_the_same_training(gpu_prices):
    plain, plain_result = fit(memory_plan=False, budget="3.9MiB")
    fused, result = fit(budget="3.9MiB")  # 4.0 MiB estimated; gradients freed as used: 3.3 MiB
    assert plain_result.memory_plan == ""
    assert result.memory_plan.startswith("plan: optimizer step fused into backward: ")
    assert result.summary.plan == result.memory_plan and "  plan: optimizer step" in repr(result.summary)
    assert all(map(torch.equal, plain.parameters(), fused.parameters()))
    assert [row["loss"] for row in plain_result.history] == [row["loss"] for row in result.history]
    fused(torch.randn(2, 64)).sum().backward()  # the hooks are gone with the run
    assert all(p.grad is not None for p in fused.parameters())


def test_a_run_over_the_budget_by_its_activations_trains_on_the_micro_batches_its_plan_says():
    def run(**options):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 3))  # no blocks to checkpoint
        x, y = torch.randn(256, 64), torch.randint(0, 3, (256,))
        return model, Trainer(max_steps=3, batch_size=64, track=False, optimizer_states="full", **options).fit(
            model, (x, y), loss_fn=nn.CrossEntropyLoss())

    plain, _ = run()
    split, result = run(memory_budget="700KiB")  # 689.4 KiB estimated, 630 usable; at 32 samples 616.7
    assert result.memory_plan.startswith("plan: micro-batches of 32 (2 a step of 64, the gradients accumulated): "
                                         "616.7 KiB of 700.0 KiB; expected step time +0%, measured ")
    assert result.micro_batch_size == 32 and result.effective_batch_size == 64 and result.oom_recoveries == 0
    assert "(3 steps with and 2 x 3 without, before the first step)" in result.memory_plan
    for before, after in zip(plain.parameters(), split.parameters()):  # the same steps, accumulated
        torch.testing.assert_close(before, after)


def test_measures_set_by_hand_are_kept_when_the_run_fits():
    pytest.importorskip("torchao")
    _, result = fit(optimizer_states="8bit", activation_checkpointing=True)
    assert "8-bit AdamW states" in result.memory_plan and "activation checkpointing on 6 Block blocks" in result.memory_plan


class WrappedBlocks:
    """At the fit's start: which blocks the plan wrapped in a checkpoint, and how many it planned."""

    def on_fit_start(self, state):
        self.wrapped = [i for i, block in enumerate(state.model.blocks) if "forward" in block.__dict__]
        self.planned = state.stepper.memory_fallback.plan.checkpointed_blocks


def test_a_plan_that_checkpoints_k_of_n_blocks_wraps_exactly_the_first_k():
    torch.manual_seed(0)
    model, seen = Net(), WrappedBlocks()
    # no 8-bit states, no step in backward (clipping needs every gradient): only checkpointing is left
    Trainer(max_steps=1, batch_size=64, track=False, memory_budget="3900KiB", optimizer_states="full",
            clip_grad_norm=1.0).fit(model, (torch.randn(256, 64), torch.randint(0, 3, (256,))),
                                    loss_fn=nn.CrossEntropyLoss(), callbacks=[seen])
    assert 0 < seen.planned < len(model.blocks)  # k of n: 3 of 6 blocks
    assert seen.wrapped == list(range(seen.planned))
    assert not any("forward" in block.__dict__ for block in model.blocks)  # undone at the end


def test_a_run_that_cannot_fit_stops_before_the_first_step_with_the_numbers():
    torch.manual_seed(0)
    model = Net()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(GpunbError) as error:
        Trainer(max_steps=3, batch_size=64, track=False, memory_budget="600KiB").fit(
            model, (torch.randn(256, 64), torch.randint(0, 3, (256,))), loss_fn=nn.CrossEntropyLoss())
    text = str(error.value)
    assert "does not fit in memory" in text and "540.0 KiB usable of a 600.0 KiB budget" in text
    assert "LoRA" in text and "strategy='fsdp'" in text
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_an_oom_the_split_cannot_fix_takes_the_next_measure_and_says_so():
    # a sample saves 6 x 1,280 + 256 bytes; checkpointed blocks keep their 256-byte input only
    with pytest.warns(UserWarning, match="added activation checkpointing on all 6 Block blocks"):
        model, result = fit(limit=7500, batch_size=4)
    assert result.steps == 3 and result.oom_recoveries == 3  # 4 -> 2 -> 1 samples, then the measure
    assert result.memory_plan == "out of memory at step 1 though the estimate fit: added activation checkpointing on all 6 Block blocks"
    assert not any("forward" in block.__dict__ for block in model.blocks)  # undone at the end
    with pytest.raises(GpunbError, match="micro-batch of 1 sample"):
        fit(limit=7500, batch_size=4, memory_plan=False)


# ---------------------------------------------------------------- the options
def test_the_budget_reads_sizes_and_the_options_refuse_what_they_cannot_take():
    from gpunb.config import TrainConfig

    assert TrainConfig(memory_budget="24GiB").memory_budget == 24 * 2**30
    assert TrainConfig(memory_budget="80 GB").memory_budget == 80 * 10**9
    assert TrainConfig(memory_budget=1000).memory_budget == 1000
    assert TrainConfig(optimizer_states="8-bit").optimizer_states == "8bit"
    with pytest.raises(GpunbError, match="memory_budget must be a number of bytes or a size such as '24GiB'"):
        TrainConfig(memory_budget="24 gigs")
    with pytest.raises(GpunbError, match="Unknown optimizer_states 'half'"):
        TrainConfig(optimizer_states="half")


def test_the_magic_takes_the_memory_options():
    from gpunb.notebook.magics import GpuMagics, _config

    args = GpuMagics.gputrain.parser.parse_args(
        ["--memory-budget", "24GiB", "--no-memory-plan", "--optimizer-states", "cpu"])
    config = _config(args)
    assert (config.memory_budget, config.memory_plan, config.optimizer_states) == (24 * 2**30, False, "cpu")


def test_a_step_in_backward_is_dropped_when_the_activations_need_smaller_micro_batches():
    from gpunb.config import TrainConfig
    from gpunb.runtime.context import LocalContext
    from gpunb.runtime.memory.planning import plan_run
    from gpunb.runtime.probes.summary import RunSummary
    from gpunb.runtime.step.objective import Objective
    from gpunb.runtime.step.precision import Precision

    # 100 MiB of weights (one tensor a block), 100 of gradients and 200 of states, 500 of activations
    model = nn.Sequential(*(nn.Linear(1024, 1024, bias=False) for _ in range(25)))
    summary = RunSummary("M", 25 * 2**20, 0, 8, "cpu", "32", weights_bytes=100 * MiB, gradients_bytes=100 * MiB,
                         optimizer_bytes=200 * MiB, activations_bytes=500 * MiB, free_bytes=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # no torchao states: in backward is what saves most
    config = TrainConfig(memory_budget=500 * MiB)
    plan = plan_run(summary, model, optimizer, Objective(nn.MSELoss()), Precision("32", torch.device("cpu")),
                    config, LocalContext(), torch.device("cpu"))
    assert not plan.fits and plan.names == () and plan.unavailable["optimizer_in_backward"] == \
        "smaller micro-batches are needed"


def test_a_ddp_run_that_fits_only_sharded_is_told_to_shard():
    from gpunb.config import TrainConfig
    from gpunb.runtime.memory.planning import plan_run
    from gpunb.runtime.probes.summary import RunSummary
    from gpunb.runtime.step.objective import Objective
    from gpunb.runtime.step.precision import Precision

    class FourRanks:  # what plan_run asks of a process group's context
        world_size = 4

        @staticmethod
        def smallest(value):
            return value

    model = nn.Linear(8, 8)
    summary = RunSummary("M", 64, 0, 8, "cpu", "32", weights_bytes=100 * MiB, gradients_bytes=100 * MiB,
                         optimizer_bytes=200 * MiB, activations_bytes=10 * MiB, free_bytes=0)
    with pytest.raises(GpunbError) as error:
        plan_run(summary, model, torch.optim.AdamW(model.parameters()), Objective(nn.MSELoss()),
                 Precision("32", torch.device("cpu")), TrainConfig(memory_budget=200 * MiB, strategy="ddp"),
                 FourRanks(), torch.device("cpu"))
    # 400 MiB whole on each device; a quarter each sharded: 100 + 10 of activations
    assert "Sharded with FSDP the estimate is 110.0 MiB" in str(error.value)
    assert "pass `strategy='fsdp'`" in error.value.hint


class FourRanks:
    """What plan_run asks of a process group's context; `others`: the other ranks' smallest vote (0: shard)."""

    world_size = 4

    def __init__(self, others=1):
        self.others, self.asked = others, []

    def smallest(self, value):
        self.asked.append(value)
        return min(value, self.others) if len(self.asked) > 1 else value  # the first: the budget


def planned(budget, ranks=None, **options):
    """plan_run on 4 ranks, each with 100 MiB of weights, 100 of gradients, 200 of AdamW states and
    10 of activations (no repeated blocks, no other measure: torchao and the rest are one-device)."""
    from gpunb.config import TrainConfig
    from gpunb.runtime.memory.planning import plan_run
    from gpunb.runtime.memory.strategy import run_strategy
    from gpunb.runtime.probes.summary import RunSummary
    from gpunb.runtime.step.objective import Objective
    from gpunb.runtime.step.precision import Precision

    model = nn.Linear(8, 8)
    summary = RunSummary("M", 64, 0, 8, "cpu", "32", weights_bytes=100 * MiB, gradients_bytes=100 * MiB,
                         optimizer_bytes=200 * MiB, activations_bytes=10 * MiB, free_bytes=0)
    config = TrainConfig(memory_budget=budget, batch_size=8, **options)
    plan = plan_run(summary, model, torch.optim.AdamW(model.parameters()), Objective(nn.MSELoss()),
                    Precision("32", torch.device("cpu")), config, ranks or FourRanks(), torch.device("cpu"))
    return plan, run_strategy(config, 4, plan)


def test_auto_shards_when_only_the_sharded_estimate_fits():
    # DDP: 100 + 100 + 200 + 10 = 410 MiB a device, over 0.9 x 200; FSDP: 400 / 4 + 10 = 110 MiB, within
    plan, (strategy, reason) = planned(200 * MiB)
    assert plan.names == ("fsdp",) and plan.fits and plan.after == 110 * MiB
    assert strategy == "fsdp" and reason == "DDP needs 410.0 MiB per device of 200.0 MiB; sharded: 110.0 MiB"
    assert plan.text() == "plan: FSDP sharding over 4 devices: 110.0 MiB of 200.0 MiB; expected step time +10%"


def test_auto_keeps_ddp_when_the_whole_model_fits_on_each_device():
    ranks = FourRanks()
    plan, (strategy, reason) = planned(500 * MiB, ranks)  # 410 MiB within 0.9 x 500 = 450
    assert plan.names == () and plan.fits and plan.after == 410 * MiB
    assert (strategy, reason) == ("ddp", "auto: the whole model fits on each device")
    assert ranks.asked == [500 * MiB, 1]  # the budget, then this rank's vote: no need to shard


def test_auto_shards_on_every_rank_when_another_rank_does_not_fit():
    plan, (strategy, _) = planned(500 * MiB, FourRanks(others=0))  # fits here; another rank voted to shard
    assert plan.has("fsdp") and strategy == "fsdp"


def test_auto_with_no_fit_even_sharded_says_so_and_explicit_ddp_keeps_its_message():
    with pytest.raises(GpunbError, match="does not fit in memory, even with every measure") as error:
        planned(100 * MiB)  # sharded: 110 MiB, over 0.9 x 100
    assert "pass `strategy='fsdp'`" not in error.value.hint
    with pytest.raises(GpunbError, match="under DDP") as error:
        planned(200 * MiB, strategy="ddp")
    assert "pass `strategy='fsdp'` (`--strategy fsdp`)" in error.value.hint


def test_auto_keeps_ddp_without_a_plan_or_where_fsdp_cannot_train():
    from gpunb.config import TrainConfig
    from gpunb.runtime.memory.strategy import run_strategy

    with pytest.raises(GpunbError, match="under DDP"):  # memory_plan=False: DDP, the old message
        planned(200 * MiB, memory_plan=False, activation_checkpointing=True)
    with pytest.raises(GpunbError, match="does not fit in memory, even") as error:  # ema: no FSDP
        planned(200 * MiB, ema=0.99)
    assert "ema keeps whole parameters" not in str(error.value)
    assert run_strategy(TrainConfig(memory_plan=False), 4, None) == ("ddp", "auto: memory_plan=False keeps DDP")
    assert run_strategy(TrainConfig(strategy="fsdp"), 4, None) == ("fsdp", "asked for")
    assert run_strategy(TrainConfig(), 1, None) == (None, "")


def test_a_run_with_the_step_in_backward_resumes_from_its_checkpoint(tmp_path, gpu_prices):
    # its checkpoints hold the state of the AdamW it stands for: a resumed run (planned or not) loads them
    _, planned = fit(budget="3.9MiB", checkpoint_dir=str(tmp_path), checkpoint_every=1)
    assert planned.memory_plan.startswith("plan: optimizer step fused into backward")
    resumed, result = fit(max_steps=4, checkpoint_dir=str(tmp_path), resume="last")
    straight, _ = fit(max_steps=4, memory_plan=False)
    assert result.resumed_from["step"] == 3 and result.steps == 4
    assert all(map(torch.equal, resumed.parameters(), straight.parameters()))


def test_the_step_in_backward_is_not_captured_as_one_cuda_graph():
    from types import SimpleNamespace

    from gpunb.runtime.step.step_graph import blocker

    model = Net()
    optimizer = OptimizerInBackward(torch.optim.AdamW(model.parameters(), capturable=True).param_groups,
                                    lambda groups: torch.optim.AdamW(groups))
    stepper = SimpleNamespace(optimizer=optimizer, precision=SimpleNamespace(device=torch.device("cuda"), scaler=None),
                              config=SimpleNamespace(grad_accum=1), schedule=None)
    assert blocker(stepper, 1) == "the optimizer steps inside backward, one parameter at a time (the memory plan)"
    optimizer.close()


def test_a_run_auto_shards_tells_its_context_and_takes_fsdps_loss_scaler():
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    from gpunb.config import TrainConfig
    from gpunb.runtime.plan import RunPlan
    from gpunb.runtime.prepare import _strategy
    from gpunb.runtime.probes.summary import RunSummary
    from gpunb.runtime.step.precision import Precision

    class TwoRanks:  # the part of a process group's context that _strategy uses
        world_size, strategy = 2, "ddp"

        def use_strategy(self, strategy):
            self.strategy = strategy

        @property
        def grad_scaler(self):
            return ShardedGradScaler if self.strategy == "fsdp" else None

    sharded, _ = planned(200 * MiB)
    cpu = torch.device("cpu")
    summary, dist, plan = RunSummary("M", 64, 0, 8, "cpu", "16-mixed"), TwoRanks(), RunPlan(cpu, "16-mixed", "", 8)
    plan, precision = _strategy(plan, TrainConfig(), dist, sharded, summary, Precision("16-mixed", cpu))
    assert dist.strategy == plan.strategy == "fsdp" and isinstance(precision.scaler, ShardedGradScaler)
    assert plan.strategy_reason == sharded.strategy_reason and plan.settings(TrainConfig())["strategy"] == "fsdp"
    assert summary.strategy == f"strategy: fsdp — {sharded.strategy_reason}"
    assert f"\n  {summary.strategy}" in repr(summary)
    kept, _ = planned(500 * MiB)  # DDP fits: the context and the precision stay as they were
    dist, before = TwoRanks(), Precision("16-mixed", cpu)
    plan, precision = _strategy(RunPlan(cpu, "16-mixed", "", 8), TrainConfig(), dist, kept, RunSummary(
        "M", 64, 0, 8, "cpu", "16-mixed"), before)
    assert (dist.strategy, plan.strategy, precision) == ("ddp", "ddp", before)


# ---------------------------------------------------------------- measures as objects
class HalvedActivations(Measure):
    """A measure the planner has never seen: halves the activations at 1% of a step."""

    name = "halved_activations"
    slowdowns = {"cuda": 0.01, "cpu": 0.01}

    def text(self, footprint, blocks):
        return "activations halved"

    def activations(self, total, footprint, blocks):
        return total // 2


def test_a_new_measure_is_one_object_that_the_planner_prices_with_no_other_edit(monkeypatch):
    from gpunb.runtime.memory import plan as planner
    from gpunb.runtime.memory.measures import MEASURES, measures_of

    halved = HalvedActivations()
    monkeypatch.setattr(planner, "MEASURES", (*MEASURES, halved))
    # 580 MiB; halved activations leave 490 <= 0.9 x 600 at 1%, cheaper than the step in backward (2%)
    plan = plan_memory(PARTS, 600 * MiB)
    assert plan.names == ("halved_activations",) and plan.has(halved) and plan.after == 490 * MiB
    assert plan.text() == "plan: activations halved: 490.0 MiB of 600.0 MiB; expected step time +1%"
    assert estimate(PARTS, [halved, *measures_of(["states_8bit"])]) == estimate(PARTS, ["states_8bit"]) - 90 * MiB


def test_each_measure_says_what_it_saves_costs_and_needs():
    from gpunb.runtime.memory.measures import MEASURES, Parts

    by_name = {m.name: m for m in MEASURES}
    assert list(by_name) == ["chunked_loss", "checkpointing", "optimizer_in_backward", "states_8bit", "states_cpu",
                             "bf16_weights", "fsdp"]
    # the host holds the states and all gradients but the one being applied (the largest: 10 MiB)
    assert by_name["states_cpu"].shrink(Parts(100 * MiB, 100 * MiB, 200 * MiB), PARTS) == Parts(100 * MiB, 10 * MiB, 0)
    assert by_name["bf16_weights"].price("cpu") == 1.0 and by_name["bf16_weights"].price("mps") == 1.0
    assert by_name["states_8bit"].slowdown("cpu") == 1.0 and by_name["states_8bit"].slowdown("xpu") == 0.05
    assert by_name["fsdp"].idle(PARTS) == "one device" and by_name["fsdp"].idle(replace(PARTS, world_size=2)) is None
    assert not by_name["optimizer_in_backward"].micro_batches
    assert set(by_name["states_cpu"].excludes) == {"states_8bit", "optimizer_in_backward"}
    # kept 8-bit states are never joined by states on the host, though that would save more
    assert "states_cpu" not in plan_memory(PARTS, 100 * MiB, kept=("states_8bit",)).names


def test_the_strategy_is_said_in_one_line_only_where_auto_chose_to_shard():
    from gpunb.render import strategy_line
    from gpunb.runtime.memory.strategy import Strategy

    reason = "DDP needs 410.0 MiB per device of 200.0 MiB; sharded: 110.0 MiB"
    assert Strategy("fsdp", reason).line() == f"strategy: fsdp — {reason}" == strategy_line("fsdp", reason)
    assert Strategy("fsdp", "asked for").line() == Strategy("ddp", "auto: no memory budget known").line() == ""
    assert Strategy(None).line() == ""
