"""Hugging Face models and datasets, and dict batches, with no adapter in between.

The models are built from tiny configs (nothing is downloaded); the data is a
`datasets.Dataset` built in memory with the torch format, whose rows are dicts.
"""

import pytest
import torch
from conftest import classification_data, mlp
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

from gpunb import Trainer
from gpunb.errors import GpunbError

datasets = pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()  # the tiny configs' token ids draw config warnings

VOCAB, LENGTH = 100, 16


def tiny_gpt2(seed=0, dropout=0.1):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
                                     resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
    return transformers.GPT2LMHeadModel(config)


def tiny_bert(seed=0):
    torch.manual_seed(seed)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64,
                                     max_position_embeddings=32, num_labels=2)
    return transformers.BertForSequenceClassification(config)


def counting_text(n=128, seed=0):
    """Token sequences that count up from a random start: learnable next-token targets."""
    starts = torch.randint(0, VOCAB, (n, 1), generator=torch.Generator().manual_seed(seed))
    ids = (starts + torch.arange(LENGTH)) % VOCAB
    return datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()}).with_format("torch")


def labelled_text(n=128, seed=0):
    """Sequences labelled by whether token 50 or above is in the first position."""
    ids = torch.randint(1, VOCAB, (n, LENGTH), generator=torch.Generator().manual_seed(seed))
    labels = (ids[:, 0] >= 50).long()
    return datasets.Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist(),
                                       "labels": labels.tolist()}).with_format("torch")


def test_a_tiny_gpt2_learns_from_a_datasets_dataset_with_dict_batches():
    data = counting_text()
    assert isinstance(data[0], dict)
    model = tiny_gpt2()
    result = Trainer(epochs=3, batch_size=16, lr=3e-3, log_every=1, track=False).fit(
        model, data, counting_text(n=32, seed=1))
    losses = [h["loss"] for h in result.history]
    assert losses[-1] < 0.8 * losses[0]
    assert result.samples == 3 * 128
    assert result.final_metrics["val_loss"] < losses[0]


def test_a_tiny_bert_classifier_trains_and_validates_on_dict_batches():
    model = tiny_bert()
    train, val = labelled_text(), labelled_text(n=32, seed=1)
    with torch.no_grad():
        before = model(**val[:32]).loss.item()
    result = Trainer(epochs=4, batch_size=16, lr=3e-3, track=False).fit(model, train, val)
    assert result.history[-1]["loss"] < result.history[0]["loss"]
    # validation means each dict batch's `.loss` (two batches of 16: the mean over the 32)
    model.eval()
    with torch.no_grad():
        after = model(**val[:32]).loss.item()
    assert result.final_metrics["val_loss"] == pytest.approx(after, rel=1e-4)
    assert after < before
    # classification logits and integer labels: accuracy for free, from `.logits` and batch["labels"]
    with torch.no_grad():
        accuracy = (model(**val[:32]).logits.argmax(-1) == val[:32]["labels"]).float().mean().item()
    assert result.final_metrics["val_acc"] == pytest.approx(accuracy)


def test_metrics_of_a_model_that_computes_its_own_loss_take_its_logits_and_the_labels():
    seen = []

    def top_logit(logits, labels):
        seen.append((tuple(logits.shape), tuple(labels.shape)))
        return logits.max()

    data = counting_text(n=32)
    result = Trainer(epochs=1, batch_size=16, track=False).fit(tiny_gpt2(), data, data, metrics={"top": top_logit})
    assert "val_top" in result.final_metrics and "val_acc" not in result.final_metrics
    # a causal LM scores logits[:, t] against labels[:, t + 1]: its metrics see those same pairs
    assert seen[-1] == ((16, LENGTH - 1, VOCAB), (16, LENGTH - 1))


class Indexed:
    """Not a torch Dataset: only __len__ and __getitem__."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


class DictMLP(nn.Module):
    def __init__(self, limit=None):
        super().__init__()
        self.net, self.limit, self.sizes = mlp(), limit, []

    def forward(self, x, y):
        self.sizes.append(x.shape[0])
        if self.limit is not None and x.shape[0] > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return nn.functional.cross_entropy(self.net(x), y)


def test_a_plain_class_with_len_and_getitem_is_data():
    x, y = classification_data(n=128)
    model = DictMLP()
    result = Trainer(epochs=3, batch_size=16, lr=1e-2, track=False).fit(model, Indexed(x, y), Indexed(x, y))
    assert result.steps == 24 and result.samples == 3 * 128
    assert result.history[-1]["loss"] < result.history[0]["loss"]
    assert "val_loss" in result.final_metrics


def test_a_datasets_dataset_reads_its_batches_in_one_call(monkeypatch):
    data = labelled_text(n=32)
    calls = []
    original = type(data).__getitems__
    monkeypatch.setattr(type(data), "__getitems__", lambda self, keys: calls.append(len(keys)) or original(self, keys))
    Trainer(epochs=1, batch_size=8, track=False).fit(tiny_bert(), data)
    assert 8 in calls  # whole batches, not one row at a time


def test_an_oom_splits_a_dict_batch_and_matches_a_run_started_small():
    x, y = classification_data(n=128)
    recovered, small = DictMLP(limit=8), DictMLP(limit=8)
    result = Trainer(epochs=2, batch_size=32, shuffle=False, track=False).fit(recovered, Indexed(x, y))
    assert result.oom_recoveries == 2 and result.micro_batch_size == 8
    Trainer(epochs=2, batch_size=8, grad_accum=4, shuffle=False, track=False).fit(small, Indexed(x, y))
    for a, b in zip(recovered.parameters(), small.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_auto_batch_size_probes_dict_batches():
    x, y = classification_data(n=1024)
    model = DictMLP(limit=64)
    result = Trainer(epochs=1, batch_size="auto", track=False).fit(model, Indexed(x, y))
    probes = result.batch_probe
    assert max(p["batch_size"] for p in probes) <= 64
    assert result.batch_size in {p["batch_size"] for p in probes}
    assert result.oom_recoveries == 0


def test_auto_batch_size_rebuilds_a_dataloader_at_each_probed_size():
    x, y = classification_data(n=1024)
    seen = []

    def collate(rows):  # the user's own collate_fn must be used at every size
        seen.append(len(rows))
        return {"x": torch.stack([r["x"] for r in rows]), "y": torch.stack([r["y"] for r in rows])}

    loader = DataLoader(Indexed(x, y), batch_size=8, shuffle=True, collate_fn=collate)
    model = DictMLP(limit=64)
    result = Trainer(epochs=1, batch_size="auto", track=False).fit(model, loader)
    probes = [p["batch_size"] for p in result.batch_probe]
    assert len(set(probes)) > 1 and set(probes) <= set(seen)
    assert result.batch_size in probes and result.batch_size != 8
    assert result.steps == -(-1024 // result.batch_size)
    assert loader.batch_size == 8  # the user's loader is left as it was


def test_auto_batch_size_refuses_a_batch_sampler_it_cannot_rebuild():
    x, y = classification_data(n=64)
    data = Indexed(x, y)
    loader = DataLoader(data, batch_sampler=BatchSampler(SequentialSampler(data), 8, drop_last=False))
    with pytest.raises(GpunbError, match="cannot resize this DataLoader: it batches with its own "
                                         "batch_sampler \\(BatchSampler\\)") as error:
        Trainer(batch_size="auto", track=False).fit(DictMLP(), loader)
    assert "`batch_size=`" in str(error.value)


def test_profiling_training_on_dict_batches_splits_the_phases():
    from gpunb.profiling import profile

    report = profile(train=dict(model=tiny_bert(), train_data=labelled_text(n=64),
                                config=dict(batch_size=8)), steps=2, warmup=1)
    phases = {p.name: p.ms for p in report.phases}
    assert report.steps == 2 and phases["forward"] > 0 and phases["backward"] > 0


def test_two_ranks_train_a_tiny_gpt2_on_dict_batches_like_one_process():
    data = counting_text(n=64)
    one = tiny_gpt2(dropout=0.0)  # each rank draws its own dropout masks
    single = Trainer(batch_size=16, shuffle=False, log_every=2, track=False).fit(one, data, data)
    two = tiny_gpt2(dropout=0.0)
    result = Trainer(batch_size=8, shuffle=False, log_every=2, devices=2, accelerator="cpu", track=False).fit(
        two, data, data)
    for a, b in zip(one.parameters(), two.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert result.world_size == 2 and result.steps == single.steps == 4
    assert result.final_metrics["val_loss"] == pytest.approx(single.final_metrics["val_loss"], abs=1e-4)


def test_gpu_transforms_act_on_the_pixel_values_of_a_dict_batch():
    from gpunb.runtime.feed.augmenter import apply_transforms

    batch = {"pixel_values": torch.ones(2, 3), "labels": torch.tensor([0, 1])}
    out = apply_transforms(batch, [lambda x: x * 2])
    assert torch.equal(out["pixel_values"], torch.full((2, 3), 2.0)) and out["labels"] is batch["labels"]
    with pytest.raises(GpunbError, match="no 'pixel_values' \\(its keys: 'input_ids'\\)"):
        apply_transforms({"input_ids": torch.ones(2, 3)}, [lambda x: x])


def test_a_dict_batch_with_a_column_of_strings_counts_and_splits_by_sample():
    from gpunb.runtime.feed.inputs import batch_size_of, split_batch

    batch = {"text": ["a", "b", "c", "d"], "input_ids": torch.arange(8).view(4, 2), "labels": [0, 1, 0, 1]}
    assert batch_size_of(batch) == 4 and batch_size_of((["a", "b", "c"], torch.zeros(3))) == 3
    first, second = split_batch(batch, 2)
    assert first["text"] == ["a", "b"] and second["labels"] == [0, 1]
    assert torch.equal(second["input_ids"], torch.tensor([[4, 5], [6, 7]]))


def test_a_datasets_dataset_without_the_torch_format_is_refused_with_the_fix():
    plain = datasets.Dataset.from_dict({"input_ids": [[1, 2], [3, 4]], "labels": [0, 1]})
    with pytest.raises(GpunbError, match="rows of train_data hold Python lists") as error:
        Trainer(track=False).fit(tiny_bert(), plain)
    assert "`train_data = train_data.with_format('torch')`" in str(error.value)

    class Rows:
        def __len__(self):
            return 2

        def __getitem__(self, i):
            return [1.0, 2.0], 0

    with pytest.raises(GpunbError, match="rows of val_data hold Python lists") as error:
        Trainer(track=False).fit(DictMLP(), Indexed(*classification_data(n=8)), Rows())
    assert "torch.tensor(row)" in str(error.value)
