"""Batches laid out as real workloads lay them out.

- The PyTorch tutorial's EmbeddingBag text classifier: `(flat_tokens, offsets, labels)`, whose
  first tensor holds one row per token, not per sample. Samples are counted from the target.
- A batch that is a Mapping but not a dict, as the `BatchEncoding` of Hugging Face collators
  (test_hf_collators.py has the real ones): on the GPU, moved and graphed as it is.
- nanoGPT fed `(tokens[:, :-1], tokens[:, 1:])`: slices of one tensor, not contiguous, and a
  forward that calls `targets.view(-1)`. The check before training sees the batches training sees.
"""

from collections import UserDict

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gpunb import Trainer
from gpunb.errors import GpunbError

VOCAB, CLASSES = 50, 3


def text_rows(n, seed):
    """(label, tokens) rows of 3 to 30 tokens; the label is the most frequent token's residue mod 3."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        tokens = torch.randint(0, VOCAB, (int(torch.randint(3, 31, (), generator=g)),), generator=g)
        rows.append((int(torch.bincount(tokens % CLASSES, minlength=CLASSES).argmax()), tokens))
    return rows


def collate_batch(rows):
    """The tutorial's collate: the tokens of the batch joined, with each sample's offset."""
    labels = torch.tensor([label for label, _ in rows])
    lengths = torch.tensor([len(tokens) for _, tokens in rows])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
    return torch.cat([tokens for _, tokens in rows]), offsets, labels


class TextClassificationModel(nn.Module):
    def __init__(self, limit=None):
        super().__init__()
        torch.manual_seed(0)
        self.embedding, self.fc, self.limit = nn.EmbeddingBag(VOCAB, 16), nn.Linear(16, CLASSES), limit

    def forward(self, text, offsets):
        if self.limit is not None and len(offsets) > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.fc(self.embedding(text, offsets))


def per_sample(model, rows):
    """The true per-sample accuracy and mean loss, one sample at a time."""
    model.eval()
    with torch.no_grad():
        outputs = [model(tokens, torch.zeros(1, dtype=torch.long)) for _, tokens in rows]
    logits, labels = torch.cat(outputs), torch.tensor([label for label, _ in rows])
    accuracy = (logits.argmax(-1) == labels).float().mean().item()
    return accuracy, nn.functional.cross_entropy(logits, labels).item()


def test_an_embedding_bag_classifier_counts_samples_not_tokens():
    train, val = text_rows(200, seed=0), text_rows(100, seed=1)  # val: 6 batches of 16 and one of 4
    model = TextClassificationModel()
    result = Trainer(epochs=2, lr=1e-2, accelerator="cpu", track=False).fit(
        model, DataLoader(train, batch_size=16, shuffle=True, collate_fn=collate_batch),
        DataLoader(val, batch_size=16, collate_fn=collate_batch), loss_fn=nn.CrossEntropyLoss())
    assert result.samples == 2 * 200 and result.steps == 2 * 13
    accuracy, loss = per_sample(model, val)
    assert result.final_metrics["val_acc"] == pytest.approx(accuracy, abs=1e-6)
    assert result.final_metrics["val_loss"] == pytest.approx(loss, rel=1e-5)


def test_batch_size_fn_counts_the_samples_of_a_layout_nothing_else_tells():
    def offsets_first(rows):  # the tokens last: their count is not the samples'
        text, offsets, labels = collate_batch(rows)
        return offsets, labels, text

    def step(model, batch):
        offsets, labels, text = batch
        return nn.functional.cross_entropy(model(text, offsets), labels)

    train, val = text_rows(64, seed=0), text_rows(100, seed=1)
    model = TextClassificationModel()
    result = Trainer(epochs=1, batch_size_fn=lambda batch: len(batch[1]), accelerator="cpu", track=False).fit(
        model, DataLoader(train, batch_size=16, collate_fn=offsets_first),
        DataLoader(val, batch_size=16, collate_fn=offsets_first), step=step)
    assert result.samples == 64
    assert result.final_metrics["val_loss"] == pytest.approx(per_sample(model, val)[1], rel=1e-5)
    assert result.config["batch_size_fn"] == "<lambda>"


def test_a_batch_size_fn_that_returns_no_count_is_refused():
    with pytest.raises(GpunbError, match="batch_size_fn must be a function of a batch, got a int"):
        Trainer(batch_size_fn=16)
    loader = DataLoader(text_rows(32, seed=0), batch_size=16, collate_fn=collate_batch)
    with pytest.raises(GpunbError, match=r"batch_size_fn\(batch\) returned 'many', not a count of samples"):
        Trainer(batch_size_fn=lambda batch: "many", track=False).fit(
            TextClassificationModel(), loader, loss_fn=nn.CrossEntropyLoss())


def test_an_oom_does_not_cut_a_batch_whose_tensors_are_not_one_row_per_sample():
    # Cutting the flat tokens, offsets and labels at the same rows would pair the wrong rows.
    loader = DataLoader(text_rows(64, seed=0), batch_size=16, collate_fn=collate_batch)
    with pytest.raises(GpunbError, match="do not all hold one row per sample") as error:
        Trainer(epochs=1, track=False).fit(TextClassificationModel(limit=8), loader, loss_fn=nn.CrossEntropyLoss())
    assert "`grad_accum`" in str(error.value)


def test_samples_are_counted_from_the_target_of_each_layout():
    from gpunb.runtime.feed.inputs import batch_size_of

    text, offsets, labels = collate_batch(text_rows(5, seed=0))
    assert len(text) > 5
    assert batch_size_of((text, offsets, labels)) == 5  # the tutorial's layout with loss_fn
    assert batch_size_of([labels, text, offsets]) == 5  # its own order: the offsets, one per sample
    images, boxes = torch.zeros(2, 3, 8, 8), [{"boxes": torch.zeros(7, 4)}, {"boxes": torch.zeros(1, 4)}]
    assert batch_size_of((images, boxes)) == 2  # a detection model's targets: one dict per image
    assert batch_size_of((torch.zeros(4, 3), torch.tensor(1.0))) == 4  # a 0-d part says nothing
    assert batch_size_of({"input_ids": torch.zeros(3, 9), "labels": torch.zeros(3)}) == 3


class NanoGPT(nn.Module):
    """nanoGPT's forward in miniature: `(logits, loss)`, the targets flattened with `.view(-1)`."""

    def __init__(self, vocab=32, block=8, width=16):
        super().__init__()
        torch.manual_seed(0)
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(block, width)
        self.mlp, self.lm_head = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)), \
            nn.Linear(width, vocab)

    def forward(self, idx, targets=None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        logits = self.lm_head(x + self.mlp(x))
        loss = nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


def test_nanogpt_on_shifted_slices_of_one_tensor_trains_like_a_plain_loop():
    tokens = torch.randint(0, 32, (96, 9), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1], tokens[:, 1:]
    assert not y.is_contiguous()  # y.view(-1) of a slice of it raises
    ours = NanoGPT()
    result = Trainer(epochs=2, batch_size=16, shuffle=False, accelerator="cpu", track=False).fit(
        ours, (x, y), optimizer=torch.optim.AdamW(ours.parameters(), lr=1e-3))
    assert result.steps == 12
    theirs = NanoGPT()
    optimizer = torch.optim.AdamW(theirs.parameters(), lr=1e-3)
    for _ in range(2):
        for xb, yb in DataLoader(TensorDataset(x, y), batch_size=16):  # stacked: contiguous
            theirs(xb, yb)[1].backward()
            optimizer.step()
            optimizer.zero_grad()
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a, b)


def test_the_check_before_training_gathers_its_batch_as_training_does():
    from gpunb.runtime.feed.inputs import first_batch

    tokens = torch.arange(40).view(4, 10)
    x, y = first_batch((tokens[:, :-1], tokens[:, 1:]), 2, torch.device("cpu"))
    assert y.is_contiguous() and torch.equal(y, tokens[:2, 1:])
    calls = []

    class Rows(torch.utils.data.Dataset):  # a dataset that reads a batch in one call, as HF datasets do
        def __len__(self):
            return 4

        def __getitem__(self, i):
            raise AssertionError("read one row at a time")

        def __getitems__(self, indices):
            calls.append(list(indices))
            return [tokens[i] for i in indices]

    assert torch.equal(first_batch(Rows(), 3, torch.device("cpu")), tokens[:3]) and calls == [[0, 1, 2]]


class Encoding(UserDict):
    """A Mapping that is not a dict, read by attribute too: the shape of a collator's `BatchEncoding`."""

    def __getattr__(self, name):
        try:
            return self.data[name]
        except KeyError:
            raise AttributeError(name) from None


class MeanTokens(nn.Module):
    """Keyword inputs as a Hugging Face model takes them, no host sync in forward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(VOCAB, 32), nn.Linear(32, CLASSES)
        self.seen = set()

    def forward(self, input_ids, attention_mask, labels):
        self.seen.add(input_ids.device.type)
        mask = attention_mask.unsqueeze(-1).float()
        pooled = (self.embed(input_ids) * mask).sum(1) / mask.sum(1)  # the mean over the real tokens
        return nn.functional.cross_entropy(self.head(pooled), labels)


def pad_to_16(rows):
    """A padding collator that returns an Encoding, as DataCollatorWithPadding returns a BatchEncoding."""
    ids = torch.zeros(len(rows), 16, dtype=torch.long)
    mask = torch.zeros(len(rows), 16, dtype=torch.long)
    for i, (_, tokens) in enumerate(rows):
        ids[i, :len(tokens[:16])], mask[i, :len(tokens[:16])] = tokens[:16], 1
    return Encoding(input_ids=ids, attention_mask=mask, labels=torch.tensor([label for label, _ in rows]))


def test_a_mapping_batch_is_counted_cut_and_moved_keeping_its_type():
    from gpunb.runtime.feed.inputs import batch_size_of, move_batch, split_batch

    batch = pad_to_16(text_rows(6, seed=0))
    assert batch_size_of(batch) == 6
    first, second = split_batch(move_batch(batch, torch.device("cpu")), 2)
    assert type(first) is Encoding and torch.equal(second.labels, batch["labels"][3:])


@pytest.mark.cuda
def test_a_mapping_batch_reaches_the_gpu_eagerly_and_in_a_step_graph():
    for compile in (False, "step-graph"):
        model = MeanTokens()
        loader = DataLoader(text_rows(512, seed=0), batch_size=32, shuffle=True, drop_last=True, collate_fn=pad_to_16)
        result = Trainer(max_steps=20, precision="32", compile=compile, log_every=1, track=False).fit(model, loader)
        assert model.seen == {"cuda"} and result.samples == 20 * 32
        if compile:
            assert result.compilation["mode"] == "step-graph", result.compilation["reason"]
            graphed = [row["loss"] for row in result.history]
        else:
            eager = [row["loss"] for row in result.history]
    torch.testing.assert_close(torch.tensor(graphed), torch.tensor(eager), rtol=1e-3, atol=1e-4)


def test_a_batch_size_fn_that_would_read_the_device_each_step_is_refused():
    from gpunb.runtime.step.objective import _checked_count

    count = _checked_count(lambda batch: torch.tensor(8, device="meta"))
    with pytest.raises(GpunbError, match="reading it waits for the device at every step"):
        count(None)
