"""The run summary before the first step: parameters, FLOPs, memory; dry runs that change nothing."""

import io

import pytest
import torch
from conftest import TinyGPT, classification_data, mlp
from torch import nn

from gpunb import Trainer
from gpunb.config import TrainConfig
from gpunb.render import ProgressPrinter, format_bytes, free_memory_text
from gpunb.runtime.events import FitState
from gpunb.runtime.probes.summary import RunSummary, optimizer_state_bytes, summarize
from gpunb.runtime.step.objective import Objective
from gpunb.runtime.step.precision import Precision

CPU = torch.device("cpu")


def summary_of(model, data, batch_size=8, optimizer=None, loss_fn=nn.CrossEntropyLoss(), step=None):
    optimizer = optimizer or torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    return summarize(model, optimizer, Objective(loss_fn, step), Precision("32", CPU), data, CPU,
                     batch_size, TrainConfig())


def test_parameters_are_counted_exactly_trainable_and_frozen():
    model = mlp(features=10, hidden=32, classes=3)
    model[0].requires_grad_(False)
    summary = summary_of(model, classification_data(n=32))
    assert (summary.trainable_params, summary.frozen_params) == (32 * 3 + 3, 10 * 32 + 32)
    assert summary.params == 451 and summary.model == "Sequential"
    assert summary.weights_bytes == 4 * 451 and summary.gradients_bytes == 4 * 99


@pytest.mark.parametrize("batch", [4, 8])
def test_flops_of_a_linear_layer_are_two_in_out_per_sample_forward_and_as_much_again_backward(batch):
    inputs, outputs = 12, 5
    model = nn.Linear(inputs, outputs, bias=False)
    x = torch.randn(32, inputs)
    summary = summary_of(model, (x, torch.randn(32, outputs)), batch_size=batch, loss_fn=nn.MSELoss())
    assert summary.forward_flops == 2 * inputs * outputs  # the per-sample share of 2*in*out*batch
    # backward: the weight's gradient only (the inputs need none)
    assert summary.train_flops == 4 * inputs * outputs


def test_optimizer_state_from_its_type_and_from_its_tensors_once_it_has_some():
    model = mlp()
    size = 4 * sum(p.numel() for p in model.parameters())
    assert optimizer_state_bytes(torch.optim.AdamW(model.parameters()))[0] == 2 * size
    assert optimizer_state_bytes(torch.optim.Adam(model.parameters(), amsgrad=True))[0] == 3 * size
    assert optimizer_state_bytes(torch.optim.SGD(model.parameters(), lr=0.1))[0] == 0
    assert optimizer_state_bytes(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))[0] == size

    class Mine(torch.optim.SGD):
        pass

    assert optimizer_state_bytes(Mine(model.parameters(), lr=0.1)) == (None, "Mine: unknown until its first step")
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 10)).sum().backward()
    optimizer.step()
    measured, note = optimizer_state_bytes(optimizer)
    assert measured == 2 * size and note == "AdamW: measured from its state"


def test_activations_are_the_tensors_saved_for_backward_and_grow_with_the_batch():
    data = classification_data(n=64)
    sizes = [summary_of(mlp(), data, batch_size=b).activations_bytes for b in (4, 8, 16)]
    assert sizes[0] > 4 * 10 * 4  # at least the inputs the first Linear saves
    assert sizes[2] - sizes[1] == 2 * (sizes[1] - sizes[0])  # linear in the batch size
    summary = summary_of(mlp(), data)
    assert summary.estimated_bytes == (summary.weights_bytes + summary.gradients_bytes
                                       + summary.optimizer_bytes + summary.activations_bytes)
    assert summary.memory_kind == "system" and summary.free_bytes > 0 and summary.fits


def test_measuring_changes_nothing_weights_grads_buffers_modes_rng():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.BatchNorm1d(16), nn.Dropout(0.3), nn.Linear(16, 3))
    model.eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    summary_of(model, classification_data(n=32))
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert not any(m.training for m in model.modules())
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_custom_step_is_not_run_ahead_of_time():
    calls = []
    summary = summary_of(mlp(), classification_data(n=32), loss_fn=None,
                         step=lambda model, batch: calls.append(1))
    assert calls == [] and summary.train_flops is None and summary.activations_bytes is None
    assert "FLOPs per sample: not counted (not measured: a custom step" in repr(summary)


def test_a_forward_that_fails_is_left_to_the_first_step_and_the_summary_says_so():
    class OutOfMemory(nn.Module):
        def forward(self, x):
            raise torch.OutOfMemoryError("CUDA out of memory.")

    class Broken(nn.Linear):
        def forward(self, x):
            raise RuntimeError("user bug")

    data = classification_data(n=32)
    tight = summary_of(nn.Sequential(nn.Linear(10, 3), OutOfMemory()), data, batch_size=16)
    assert tight.activations_bytes is None and tight.activations_note == "not measured: out of memory at batch 16"
    model = Broken(10, 3)
    broken = summary_of(model, data)
    assert broken.train_flops is None and "not measured: RuntimeError" in repr(broken)
    assert all(p.grad is None for p in model.parameters())


def test_a_named_runs_summary_and_result_name_the_run_alike():
    x, y = classification_data(n=64)
    result = Trainer(epochs=1, batch_size=16, track=False, name="digits-cnn").fit(
        mlp(), (x, y), loss_fn=nn.CrossEntropyLoss())
    assert repr(result).startswith("TrainResult('digits-cnn': ")
    assert repr(result.summary).startswith("RunSummary('digits-cnn': Sequential, 451 parameters")
    assert ">run</th><td style='text-align:left;padding:0 .8em 0 0'>digits-cnn</td>" in result.summary._repr_html_()
    unnamed = Trainer(epochs=1, batch_size=16, track=False).fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss())
    assert repr(unnamed).startswith("TrainResult('Sequential': ")
    assert repr(unnamed.summary).startswith("RunSummary('Sequential': 451 parameters")


def test_the_text_is_deterministic_and_leaves_the_machine_out():
    summary = summary_of(nn.Linear(10, 2), classification_data(n=32, classes=2), batch_size=8)
    assert repr(summary) == (
        "RunSummary('Linear': 22 parameters (22 trainable, 0 frozen), batch 8, device=cpu, precision=32)\n"
        "  FLOPs per sample: 40 forward, 80 forward + backward\n"
        "  memory: weights 88 B + gradients 88 B + optimizer 176 B (AdamW: 2 tensors per parameter) + "
        f"activations {summary.activations_bytes} B (tensors saved for backward in one step) = "
        f"{summary.estimated_bytes} B")
    assert "free" not in repr(summary) and "free system memory (fits)" in summary._repr_html_()
    tight = RunSummary("M", 1, 0, 1, "cuda", "32", weights_bytes=2**31, free_bytes=2**30, memory_kind="GPU")
    assert free_memory_text(tight) == "2.0 GiB of 1.0 GiB free GPU memory (does NOT fit: lower the batch " \
                                      "size or use bf16 / activation checkpointing)"


def test_fit_records_the_summary_in_the_result_and_prints_it_first():
    x, y = classification_data(n=64)
    stream = io.StringIO()
    result = Trainer(max_steps=2, batch_size=16, track=False).fit(
        mlp(), (x, y), loss_fn=nn.CrossEntropyLoss(), callbacks=[ProgressPrinter(stream)])
    assert isinstance(result.summary, RunSummary) and result.summary.batch_size == 16
    assert result.summary.params == sum(p.numel() for p in mlp().parameters())
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("RunSummary('Sequential': 451 parameters")
    assert "free system memory" in lines[3] and lines[4].startswith("step ")


def test_the_dashboard_header_shows_the_summary():
    from gpunb.notebook.dashboard import _header_html

    summary = summary_of(mlp(), classification_data(n=32))
    state = FitState(config=TrainConfig(batch_size=8, precision="32"), model=None, optimizer=None, device=CPU,
                     summary=summary.as_plain())
    header = _header_html(state)
    assert "451 parameters (451 trainable, 0 frozen)" in header and "free system memory (fits)" in header
    assert RunSummary.from_plain(summary.as_plain()) == summary


@pytest.mark.parametrize("batch_size", [16, "auto"])
def test_a_dry_run_leaves_model_optimizer_and_rng_as_they_were_and_records_nothing(tmp_path, gpunb_home,
                                                                                     batch_size):
    x, y = classification_data(n=128)
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters())
    model(x[:4]).sum().backward()
    optimizer.step()  # an optimizer with state, as a run that continues has
    optimizer.zero_grad()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    saved = optimizer.state_dict()
    moments = [t.clone() for s in saved["state"].values() for t in s.values()]
    rng = torch.get_rng_state()
    summary = Trainer(batch_size=batch_size, checkpoint_dir=str(tmp_path / "ckpt")).dry_run(
        model, (x, y), optimizer=optimizer, loss_fn=nn.CrossEntropyLoss())
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    after = [t for s in optimizer.state_dict()["state"].values() for t in s.values()]
    assert all(torch.equal(a, b) for a, b in zip(after, moments)) and len(after) == len(moments)
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    assert not (tmp_path / "ckpt").exists()  # no checkpoint
    assert not gpunb_home.exists() or not any(gpunb_home.rglob("*")), "a dry run records no run"
    assert summary.optimizer_note == "AdamW: measured from its state"
    assert summary.train_flops > 0 and (batch_size == "auto" or summary.batch_size == 16)


def test_a_dry_run_is_fit_stopped_before_it_puts_anything_in_place(tmp_path):
    from gpunb.errors import GpunbError

    def trainer(**options):
        return Trainer(max_steps=3, batch_size=64, track=False, optimizer_states="full", memory_budget="700KiB",
                       **options)

    def data():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 3)), (torch.randn(256, 64),
                                                                                  torch.randint(0, 3, (256,)))

    model, xy = data()
    said = trainer().dry_run(model, xy, loss_fn=nn.CrossEntropyLoss())
    model, xy = data()
    result = trainer().fit(model, xy, loss_fn=nn.CrossEntropyLoss())
    # the plan fit takes, said before its cost is measured (that needs steps)
    assert said.plan == ("plan: micro-batches of 32 (2 a step of 64, the gradients accumulated): 616.7 KiB of "
                         "700.0 KiB; expected step time +0%")
    assert result.summary.plan.startswith(said.plan + ", measured ")
    # fit's checks before any work: a monitor that validation never produces
    with pytest.raises(GpunbError, match="monitors 'val_acc', a validation metric, and the run has no validation"):
        trainer(save_top_k=2, monitor="val_acc", checkpoint_dir=str(tmp_path)).dry_run(
            model, xy, loss_fn=nn.CrossEntropyLoss())
    assert not any(tmp_path.iterdir())


# --------------------------------------------------------------------------- %%gputrain --dry-run


def test_gputrain_dry_run_shows_the_summary_and_trains_nothing(ip, capsys):
    ip.run_cell_magic("gputrain", "--dry-run --batch-size 16", "model = mlp()\ntrain_data = (x, y)\n"
                      "loss_fn = nn.CrossEntropyLoss()\nbefore = [p.clone() for p in model.parameters()]")
    summary = ip.user_ns["gputrain_result"]
    assert isinstance(summary, RunSummary) and summary.batch_size == 16
    assert all(torch.equal(a, b) for a, b in zip(ip.user_ns["model"].parameters(), ip.user_ns["before"]))
    assert capsys.readouterr().out.startswith("RunSummary('Sequential': 451 parameters")


@pytest.mark.cuda
def test_on_a_gpu_activations_come_from_the_peak_and_free_memory_from_the_device():
    device = torch.device("cuda")
    model = mlp().to(device)
    x, y = classification_data(n=64)
    summary = summarize(model, torch.optim.AdamW(model.parameters()), Objective(nn.CrossEntropyLoss()),
                        Precision("32", device), (x, y), device, 64, TrainConfig())
    assert summary.memory_kind == "GPU" and summary.free_bytes > 0
    assert summary.activations_note == "peak of one step above weights and gradients"
    assert summary.activations_bytes is not None and summary.device == "cuda"


def test_the_weight_average_of_ema_counts_in_the_memory_estimate():
    data = classification_data(n=64)
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters())
    plain = summarize(model, optimizer, Objective(nn.CrossEntropyLoss()), Precision("32", CPU), data, CPU,
                      8, TrainConfig())
    averaged = summarize(model, optimizer, Objective(nn.CrossEntropyLoss()), Precision("32", CPU), data, CPU,
                         8, TrainConfig(ema=0.99))
    assert plain.ema_bytes == 0 and "weight average" not in repr(plain)
    assert averaged.ema_bytes == averaged.weights_bytes
    assert averaged.estimated_bytes == plain.estimated_bytes + averaged.weights_bytes
    assert f"weight average {format_bytes(averaged.weights_bytes)}" in repr(averaged)


# -- the measured batch draws from no RNG that training reads ------------------------------------

MASK, VOCAB, LENGTH = 1, 50, 12


def masking_collate(rows):
    """Random masking in the collate function, as a masked-LM collator does: torch's global RNG."""
    ids = torch.stack(rows)
    masked = torch.rand(ids.shape) < 0.3
    return {"input_ids": ids.masked_fill(masked, MASK), "labels": ids.masked_fill(~masked, -100)}


class TinyMaskedLM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.embed, self.head = nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB)

    def forward(self, input_ids, labels):
        logits = self.head(torch.relu(self.embed(input_ids)))
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)



class GetBatch(torch.utils.data.IterableDataset):
    """nanoGPT's `get_batch`: random windows of a token stream, drawn with torch.randint, forever."""

    def __init__(self, tokens, batch_size=8):
        self.tokens, self.batch_size = tokens, batch_size

    def __iter__(self):
        while True:
            starts = torch.randint(len(self.tokens) - LENGTH - 1, (self.batch_size,))
            x = torch.stack([self.tokens[i:i + LENGTH] for i in starts])
            y = torch.stack([self.tokens[i + 1:i + 1 + LENGTH] for i in starts])
            yield x, y


def _plain_loop(model, loader, steps, call):
    """What a user writes: seed, then step through the loader."""
    torch.manual_seed(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    batches = iter(loader)
    for _ in range(steps):
        loss = call(model, next(batches))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def _gpunb(model, loader, steps):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    Trainer(max_steps=steps, seed=0, track=False, log_every=1, accelerator="cpu").fit(
        model, loader, optimizer=optimizer)


def test_a_collate_that_draws_random_numbers_trains_as_the_plain_loop_bit_for_bit():
    rows = torch.randint(2, VOCAB, (64, LENGTH), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(list(rows), batch_size=8, collate_fn=masking_collate)
    ours, plain = TinyMaskedLM(), TinyMaskedLM()
    _gpunb(ours, loader, steps=6)
    _plain_loop(plain, loader, 6, lambda model, batch: model(**batch))
    for name, value in plain.state_dict().items():
        assert torch.equal(ours.state_dict()[name], value), name


def test_a_get_batch_stream_on_the_global_rng_trains_as_the_plain_loop_bit_for_bit():
    tokens = torch.randint(0, VOCAB, (2000,), generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(GetBatch(tokens), batch_size=None)
    ours, plain = TinyGPT(VOCAB), TinyGPT(VOCAB)
    _gpunb(ours, loader, steps=6)
    _plain_loop(plain, loader, 6, lambda model, batch: model(*batch)[1])
    for name, value in plain.state_dict().items():
        assert torch.equal(ours.state_dict()[name], value), name


class WholeBatchesOnly(nn.Module):
    """Repeated blocks, and a forward that refuses anything but a batch of 8 (the summary's
    2-sample try fails, then its whole-batch try too when the batch is 4)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(10, 10) for _ in range(3))
        self.head = nn.Linear(10, 3)

    def forward(self, x):
        if len(x) != 8:
            raise ValueError("a batch of 8, please")
        for block in self.blocks:
            x = block(x).relu()
        return self.head(x)


@pytest.mark.parametrize("batch_size", [8, 4])
def test_the_summary_leaves_no_hook_on_the_blocks_when_its_forward_fails(batch_size):
    model = WholeBatchesOnly()
    summary_of(model, classification_data(), batch_size=batch_size)
    assert all(not block._forward_pre_hooks and not block._forward_hooks for block in model.blocks)


def test_the_summary_shows_the_batch_of_a_users_dataloader_not_the_default():
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(*classification_data(n=64)), batch_size=8, shuffle=True)
    dry = Trainer(track=False).summary(mlp(), loader, loss_fn=nn.CrossEntropyLoss())
    result = Trainer(max_steps=2, track=False).fit(mlp(), loader, loss_fn=nn.CrossEntropyLoss())
    assert dry.batch_size == result.summary.batch_size == result.batch_size == 8
    assert "batch 8" in str(dry) and "batch 8" in str(result.summary)


class SelfAttention(nn.Module):
    """Query, key and value projections and torch's scaled_dot_product_attention, nothing else."""

    def __init__(self, width, heads):
        super().__init__()
        self.heads, self.qkv = heads, nn.Linear(width, 3 * width, bias=False)

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(x.shape)


def test_flops_count_the_attention_on_the_cpu_as_the_hand_count_says():
    length, width, heads = 16, 32, 4
    x, target = torch.randn(8, length, width), torch.randn(8, length, width)
    summary = summary_of(SelfAttention(width, heads), (x, target), loss_fn=nn.MSELoss())
    projections = 2 * length * width * 3 * width  # per sample, forward
    attention = 2 * 2 * length * length * width  # q @ k^T and the weights @ v, every head together
    assert summary.forward_flops == projections + attention
    # backward: the projection's weight gradient only (the input needs none); attention's four
    # matmuls and the scores recomputed (as torch counts its CUDA kernels' backward)
    assert summary.train_flops == 2 * projections + attention + 5 * attention // 2
