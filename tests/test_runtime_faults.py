"""Damaged checkpoints, a run resumed at its end, a continued fit whose model changed, the frozen
base's fingerprint and the host out of memory: each met before it costs trained weights, with one
clear message."""

import os
import warnings

import pytest
import torch
from conftest import classification_data
from test_checkpoint import StopAt, assert_same_state, dropout_mlp, train
from torch import nn

from gpunb import Trainer
from gpunb.errors import GpunbError
from gpunb.runtime.state.checkpoint_files import list_checkpoints, load_checkpoint

DAMAGES = {
    "truncated": lambda data: data[: len(data) // 2],
    "empty": lambda data: b"",
    "random bytes": lambda data: os.urandom(len(data)),
}


def two_checkpoints(tmp_path):
    """A run stopped at step 20 (checkpoints at 10 and 20), and the straight run it is part of."""
    straight = dropout_mlp()
    _, opt_straight = train(straight, epochs=2)
    train(dropout_mlp(), epochs=2, checkpoint_dir=tmp_path, checkpoint_every=10, callbacks=[StopAt(20)])
    older, newest = list_checkpoints(tmp_path)
    assert (older.name, newest.name) == ("step-000000010.pt", "step-000000020.pt")
    return straight, opt_straight, older, newest


def resumed_with_warnings(**options):
    model = dropout_mlp(seed=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result, optimizer = train(model, **options)
    said = [str(w.message) for w in caught if "cannot be read" in str(w.message)]
    return model, optimizer, result, said


@pytest.mark.parametrize("damage", DAMAGES)
def test_an_unreadable_newest_checkpoint_gives_way_to_the_newest_readable_one(tmp_path, damage):
    straight, opt_straight, older, newest = two_checkpoints(tmp_path)
    newest.write_bytes(DAMAGES[damage](newest.read_bytes()))
    model, optimizer, result, said = resumed_with_warnings(epochs=2, checkpoint_dir=tmp_path, resume="last")
    assert result.resumed_from["step"] == 10 and result.resumed_from["path"] == str(older)
    assert len(said) == 1 and str(newest) in said[0] and str(older) in said[0], said
    assert "could run code" not in said[0]
    assert_same_state(straight, opt_straight, model, optimizer)  # exact from step 10 on
    assert newest.exists()  # the damaged file is left as it is


def test_a_directory_given_as_resume_falls_back_too(tmp_path):
    _, _, older, newest = two_checkpoints(tmp_path)
    newest.write_bytes(b"")
    _, _, result, said = resumed_with_warnings(epochs=2, checkpoint_dir=tmp_path, resume=str(older.parent))
    assert result.resumed_from["step"] == 10 and len(said) == 1


def test_an_unreadable_checkpoint_named_by_its_path_is_refused_not_swapped(tmp_path):
    _, _, older, newest = two_checkpoints(tmp_path)
    newest.write_bytes(os.urandom(4096))
    with pytest.raises(GpunbError) as error:
        train(dropout_mlp(), epochs=2, checkpoint_dir=tmp_path, resume=str(newest))
    message = str(error.value)
    assert f"Cannot read the checkpoint {newest}: it is corrupt or not a torch file (4,096 bytes; " in message
    assert "could run code" not in message and "HINT" in message


def test_random_bytes_are_called_unreadable_not_code(tmp_path):
    noise = tmp_path / "noise.pt"
    for seed in range(20):  # whatever opcode the first random byte happens to be
        noise.write_bytes(torch.randint(0, 256, (4096,), dtype=torch.uint8,
                                        generator=torch.Generator().manual_seed(seed)).numpy().tobytes())
        with pytest.raises(GpunbError, match="corrupt or not a torch file") as error:
            load_checkpoint(noise)
        assert "could run code" not in str(error.value), seed


def test_when_no_checkpoint_can_be_read_resume_says_so_and_names_each(tmp_path):
    _, _, older, newest = two_checkpoints(tmp_path)
    older.write_bytes(b"")
    newest.write_bytes(b"\x00not a zip file")
    with pytest.raises(GpunbError) as error:
        train(dropout_mlp(), epochs=2, checkpoint_dir=tmp_path, resume="last")
    message = str(error.value)
    assert "cannot read any of the 2 checkpoints" in message and "corrupt" in message
    assert "step-000000010.pt (0 bytes; EOFError)" in message and "step-000000020.pt (15 bytes;" in message
    assert "HINT: start fresh without `resume`" in message


# ---------------------------------------------------------------- a run resumed at its end
class EpochEnds:
    def __init__(self):
        self.heard = 0

    def on_epoch_end(self, state, row):
        self.heard += 1


@pytest.mark.parametrize("checkpoint_every", [None, 5])  # saved at the epoch's end / at the last step
def test_a_max_steps_run_resumed_at_its_end_trains_no_step(tmp_path, checkpoint_every):
    x, y = classification_data(n=200)  # 13 batches an epoch: step 10 ends the run mid-epoch

    def fit(**options):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3))
        ends = EpochEnds()
        result = Trainer(max_steps=10, batch_size=16, log_every=5, track=False, checkpoint_dir=tmp_path,
                         checkpoint_every=checkpoint_every, **options).fit(
            model, (x, y), (x[:64], y[:64]), loss_fn=nn.CrossEntropyLoss(), callbacks=[ends])
        return model, result, ends.heard

    done, first, heard_first = fit()
    again, resumed, heard_resumed = fit(resume="last")
    assert resumed.resumed_from["step"] == 10 and resumed.steps == 10
    # the epoch's end comes once in all: in the resumed run only when the checkpoint was saved before it
    assert (heard_first, heard_resumed) == (1, 0 if checkpoint_every is None else 1)
    assert all(torch.equal(a, b) for a, b in zip(done.state_dict().values(), again.state_dict().values()))
    assert [row["val_loss"] for row in resumed.epochs] == [row["val_loss"] for row in first.epochs]
    assert len(resumed.validations) == len(first.validations) == 1
    assert load_checkpoint(list_checkpoints(tmp_path)[-1])["step"] == 10


# ---------------------------------------------------------------- a continued fit whose model changed
def fit_for(model, continue_from=None, optimizer=None):
    x, y = classification_data(n=96)
    return Trainer(epochs=1, batch_size=16, track=False, accelerator="cpu").fit(
        model, (x, y), loss_fn=nn.CrossEntropyLoss(), optimizer=optimizer, continue_from=continue_from)


def changed_head(model):
    model[3] = nn.Linear(32, 3)  # a new last layer, of the same shape


def added_layer(model):
    model.append(nn.Linear(3, 3))


def reshaped_in_place(model):
    model[3].weight.data = torch.zeros(5, 32)  # the same Parameter object, now (5, 32)
    model[3].bias.data = torch.zeros(5)


@pytest.mark.parametrize("change, named", [
    (changed_head, "3.weight (replaced), 3.bias (replaced)"),
    (added_layer, "4.weight (new), 4.bias (new)"),
    (reshaped_in_place, "3.weight (reshaped (3, 32) -> (5, 32)), 3.bias (reshaped (3,) -> (5,))"),
])
def test_continuing_a_model_whose_parameters_changed_is_refused_naming_them(change, named):
    model = dropout_mlp()
    first = fit_for(model)
    change(model)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    with pytest.raises(GpunbError) as error:
        fit_for(model, continue_from=first)
    message = str(error.value)
    assert f"The model's parameters changed since the fit to continue: {named}." in message
    assert "HINT: drop `continue_from` (`%%gputrain` without `--continue`)" in message
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())


@pytest.mark.filterwarnings("ignore:The optimizer holds only some")
def test_continuing_with_an_optimizer_over_part_of_the_model_is_no_change():
    model = dropout_mlp()
    head_only = torch.optim.SGD(model[3].parameters(), lr=0.1)  # the first layer trains in no fit, by choice
    first = fit_for(model, optimizer=head_only)
    first_layer = model[0].weight.clone()
    more = fit_for(model, continue_from=first)
    assert more.steps == 12 and torch.equal(model[0].weight, first_layer)


# ---------------------------------------------------------------- the frozen base's fingerprint
def test_the_fingerprint_tells_apart_tensors_that_differ_in_one_value_anywhere():
    from gpunb.runtime.trainable import fingerprint

    generator = torch.Generator().manual_seed(0)
    for tensor in (torch.randn(48, 33, generator=generator),  # 16-bit words
                   torch.randn(40, 30, generator=generator).to(torch.bfloat16),
                   torch.randint(-128, 127, (7, 9), generator=generator, dtype=torch.int8)):  # 63 bytes: 8-bit words
        digest = fingerprint({"w": tensor})["w"][2]
        bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.int8: torch.int8}[tensor.dtype]
        for index in torch.randint(0, tensor.numel(), (40,), generator=generator).tolist():
            changed = tensor.clone()
            changed.view(bits).view(-1)[index] ^= 1  # the value's lowest bit: the smallest change there is
            assert fingerprint({"w": changed})["w"][2] != digest, (tensor.dtype, index)
        assert fingerprint({"w": tensor.t().contiguous().t()})["w"][2] == digest  # values, not their layout
        column = tensor[:, 1]  # a strided view
        assert fingerprint({"w": column})["w"][2] == fingerprint({"w": column.clone()})["w"][2]


def test_the_digest_is_the_polynomial_of_every_word_in_chunks(monkeypatch):
    from gpunb.runtime import trainable

    monkeypatch.setattr(trainable, "_ROW", 4)  # rows, chunks and the padding of the last, on a small tensor
    monkeypatch.setattr(trainable, "_CHUNK", 16)
    tensor = torch.randn(37, generator=torch.Generator().manual_seed(1))
    words = tensor.view(torch.int16).tolist()  # 74 words: 5 chunks, the last one padded
    expected = "".join(f"{sum(w * pow(base, j, prime) for j, w in enumerate(words)) % prime:08x}"
                       for prime, base in zip(trainable._PRIMES, trainable._BASES))
    assert trainable.fingerprint({"w": tensor})["w"][2] == "all:" + expected


def frozen_first_layer(change=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3))
    model[0].requires_grad_(False)
    if change is not None:
        with torch.no_grad():
            change(model[0].weight)
    return model


def fit_frozen(model, tmp_path, **options):
    x, y = classification_data(n=96)
    return Trainer(epochs=1, batch_size=16, track=False, accelerator="cpu", checkpoint_dir=tmp_path,
                   checkpoint_every=2, **options).fit(model, (x, y), loss_fn=nn.CrossEntropyLoss())


def one_value(weight):
    weight[5, 3] += 1e-3  # index 53 of 320: none of the 16 an older digest sampled (0, 21, 43, 64, ...)


def one_row(weight):
    weight[7] = 0.0


@pytest.mark.parametrize("change", [one_value, one_row])
def test_a_checkpoint_of_what_trains_never_resumes_onto_a_base_that_differs_in_one_value(tmp_path, change):
    fit_frozen(frozen_first_layer(), tmp_path)
    with pytest.raises(GpunbError, match=r"frozen weights are not the ones it was trained on:\n"
                                         r"  - other values in 1 of 2 frozen tensors: 0.weight"):
        fit_frozen(frozen_first_layer(change), tmp_path, resume="last")


def test_the_fingerprint_is_computed_once_a_fit(tmp_path, monkeypatch):
    from gpunb.runtime import trainable

    computed = []
    real = trainable.fingerprint
    monkeypatch.setattr(trainable, "fingerprint", lambda tensors: computed.append(len(tensors)) or real(tensors))
    fit_frozen(frozen_first_layer(), tmp_path)  # 6 steps: 3 checkpoints
    assert computed == [2] and len(list_checkpoints(tmp_path)) == 3
    computed.clear()
    fit_frozen(frozen_first_layer(), tmp_path, resume=str(list_checkpoints(tmp_path)[0]))  # the check, 2 saves
    assert computed == [2]


def test_an_older_checkpoint_with_sampled_digests_still_resumes_and_is_still_checked(tmp_path):
    from gpunb.runtime import trainable
    from gpunb.runtime.state.checkpoint_files import write_atomic

    fit_frozen(frozen_first_layer(), tmp_path)
    path = list_checkpoints(tmp_path)[-2]
    payload = torch.load(path, weights_only=True)
    base = frozen_first_layer()
    payload["frozen"] = {name: [shape, dtype, trainable._sampled_digest(base.state_dict()[name])]
                         for name, (shape, dtype, _) in payload["frozen"].items()}
    payload["version"] = 2  # as written before every value was read
    write_atomic(path.parent, path.name, payload)
    assert fit_frozen(frozen_first_layer(), tmp_path, resume=str(path)).resumed_from["step"] == 4
    sampled = frozen_first_layer(lambda weight: weight[0].add_(1.0))  # index 0: sampled in the old digest
    with pytest.raises(GpunbError, match="other values in 1 of 2 frozen tensors: 0.weight"):
        fit_frozen(sampled, tmp_path, resume=str(path))


# ---------------------------------------------------------------- the host out of memory
class Greedy(nn.Module):
    """A real failed host allocation (4 EiB: more than any address space) for a batch of more than
    `most` samples: torch's CPU allocator raises a plain RuntimeError."""

    def __init__(self, most):
        super().__init__()
        torch.manual_seed(0)
        self.linear, self.most = nn.Linear(10, 3), most

    def forward(self, x):
        if x.shape[0] > self.most:
            torch.empty(2**62, dtype=torch.uint8)
        return self.linear(x)


def fit_greedy(most):
    x, y = classification_data(n=64)
    return Trainer(epochs=1, batch_size=8, track=False, accelerator="cpu").fit(
        Greedy(most), (x, y), loss_fn=nn.CrossEntropyLoss())


def test_a_host_allocation_failure_is_an_out_of_memory_that_smaller_micro_batches_fix():
    result = fit_greedy(most=2)
    assert (result.steps, result.oom_recoveries, result.micro_batch_size) == (8, 2, 2)  # 8 -> 4 -> 2 samples


def test_a_host_allocation_failure_that_no_split_fixes_gets_gpunbs_out_of_memory_message():
    with pytest.raises(GpunbError) as error:
        fit_greedy(most=0)
    assert str(error.value).startswith("Out of memory even with a micro-batch of 1 sample.\nHINT: ")
    assert "DefaultCPUAllocator: can't allocate memory" in str(error.value.__context__)
