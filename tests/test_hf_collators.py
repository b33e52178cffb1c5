"""Hugging Face collators: their batches are `BatchEncoding`s, a `UserDict` (a Mapping, not a dict).

The tokenizer is a WordPiece trained in memory on the test's own sentences and wrapped in
`PreTrainedTokenizerFast`; the models are tiny BERT and GPT-2 built from configs. Nothing is
downloaded. Each run is compared with a plain PyTorch loop over the same DataLoader, on the CPU
(where the plain loop is deterministic). The GPU path of such batches: test_batch_layouts.py.
"""

import random

import pytest
import torch
from torch.utils.data import DataLoader

from gpunb import Trainer

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
datasets = pytest.importorskip("datasets")
transformers.logging.set_verbosity_error()  # the tiny configs' token ids draw config warnings

COLOURS = ["red", "green", "blue", "yellow"]
WORDS = ["the", "a", "cat", "dog", "sat", "ran", "on", "under", "mat", "table", "quickly", "slowly",
         "big", "small", "house", "garden", "and", "then", "jumped", "slept"]


def sentences(n, seed):
    """Ragged sentences (3 to 12 words), labelled 1 when they name a colour."""
    rng = random.Random(seed)
    texts, labels = [], []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 12))]
        label = rng.random() < 0.5
        if label:
            words.insert(rng.randrange(len(words)), rng.choice(COLOURS))
        texts.append(" ".join(words))
        labels.append(int(label))
    return texts, labels


@pytest.fixture(scope="module")
def tokenizer():
    return trained_tokenizer()


def trained_tokenizer():
    """A WordPiece tokenizer trained in memory on the test's sentences, as `transformers` wraps it."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(sentences(200, seed=99)[0], trainers.WordPieceTrainer(vocab_size=120,
                                                                                  special_tokens=special))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[(t, tok.token_to_id(t)) for t in ("[CLS]", "[SEP]")])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                                cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")


def tokenized(tokenizer, n, seed):
    """A `datasets.Dataset` of ragged rows (Python lists), as `.map(tokenize)` leaves it."""
    texts, labels = sentences(n, seed)
    data = datasets.Dataset.from_dict({"text": texts, "label": labels})
    return data.map(lambda rows: tokenizer(rows["text"], truncation=True, max_length=16), batched=True,
                    remove_columns=["text"])


def tiny_bert(tokenizer, cls=None, dropout=0.1):
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64, max_position_embeddings=32,
                                     num_labels=2, pad_token_id=tokenizer.pad_token_id,
                                     hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    return (cls or transformers.BertForSequenceClassification)(config)


def tiny_gpt2(tokenizer):
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=len(tokenizer), n_positions=32,
                                     pad_token_id=tokenizer.pad_token_id)
    return transformers.GPT2LMHeadModel(config)


def loaders(tokenizer, collator, batch_size=8):
    """Training (shuffled by its own generator) and validation loaders over ragged rows."""
    train = DataLoader(tokenized(tokenizer, 48, seed=0), batch_size=batch_size, shuffle=True, collate_fn=collator,
                       generator=torch.Generator().manual_seed(0))
    val = DataLoader(tokenized(tokenizer, 20, seed=1), batch_size=batch_size, collate_fn=collator)
    return train, val


def setups(tokenizer):
    return {
        "bert-padding": (lambda: tiny_bert(tokenizer), transformers.DataCollatorWithPadding(tokenizer)),
        "gpt2-causal-lm": (lambda: tiny_gpt2(tokenizer),
                           transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)),
    }


def plain_loop(model, train, val, epochs, lr=1e-3):
    """What a user writes by hand: model(**batch).loss, AdamW, a validation pass after each epoch
    (weighted by batch size); returns the last pass's loss and accuracy."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    torch.manual_seed(0)  # gpunb's seed=0: the dropout masks are drawn from the same stream
    for _ in range(epochs):
        model.train()
        for batch in train:
            model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        model.eval()
        loss, correct, n = 0.0, 0, 0
        with torch.no_grad():
            for batch in val:  # iter() of a loader without a generator draws from torch's RNG
                output = model(**batch)
                loss += output.loss.item() * len(batch["labels"])
                correct += (output.logits.argmax(-1) == batch["labels"]).sum().item()
                n += len(batch["labels"])
    return loss / n, correct / n


@pytest.mark.parametrize("name", ["bert-padding", "gpt2-causal-lm"])
def test_collator_batches_train_and_validate_like_a_plain_loop(tokenizer, name):
    build, collator = setups(tokenizer)[name]
    train, val = loaders(tokenizer, collator)
    assert type(next(iter(val))).__name__ == "BatchEncoding"  # a UserDict, not a dict
    ours = build()
    result = Trainer(epochs=2, log_every=1, accelerator="cpu", track=False).fit(
        ours, train, val, optimizer=torch.optim.AdamW(ours.parameters(), lr=1e-3))
    theirs = build()
    val_loss, val_acc = plain_loop(theirs, *loaders(tokenizer, collator), epochs=2)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a, b)  # bit for bit
    assert result.samples == 2 * 48 and result.steps == 2 * 6
    assert result.final_metrics["val_loss"] == pytest.approx(val_loss, rel=1e-6)
    if name == "bert-padding":  # (N, C) logits and (N,) labels: accuracy comes for free
        assert result.final_metrics["val_acc"] == pytest.approx(val_acc)


class OutOfMemoryAbove(transformers.BertForSequenceClassification):
    """Raises CUDA's out-of-memory error for batches larger than `limit`, as a GPU would."""

    limit = 4

    def forward(self, input_ids=None, **kwargs):
        if input_ids.shape[0] > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().forward(input_ids=input_ids, **kwargs)


def test_an_oom_splits_a_collator_batch_and_matches_the_same_pieces_by_hand(tokenizer):
    collator = transformers.DataCollatorWithPadding(tokenizer)
    ours = tiny_bert(tokenizer, OutOfMemoryAbove)
    train, _ = loaders(tokenizer, collator)
    result = Trainer(epochs=1, log_every=1, accelerator="cpu", track=False).fit(
        ours, train, optimizer=torch.optim.AdamW(ours.parameters(), lr=1e-3))
    assert result.oom_recoveries == 1 and result.micro_batch_size == 4
    # by hand: each padded batch of 8 cut into two halves, each half's loss weighted by its share
    theirs = tiny_bert(tokenizer, OutOfMemoryAbove)
    optimizer = torch.optim.AdamW(theirs.parameters(), lr=1e-3)
    torch.manual_seed(0)
    for batch in loaders(tokenizer, collator)[0]:
        n = len(batch["labels"])
        for start in range(0, n, 4):
            piece = {key: value[start:start + 4] for key, value in batch.items()}
            (theirs(**piece).loss * (len(piece["labels"]) / n)).backward()
        optimizer.step()
        optimizer.zero_grad()
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a, b)


def test_auto_batch_size_probes_with_the_collator(tokenizer):
    seen = []
    collator = transformers.DataCollatorWithPadding(tokenizer)

    def collate(rows):
        seen.append(len(rows))
        return collator(rows)

    model = tiny_bert(tokenizer, OutOfMemoryAbove)
    model.limit = 16
    data = tokenized(tokenizer, 128, seed=0)
    result = Trainer(epochs=1, batch_size="auto", accelerator="cpu", track=False).fit(
        model, DataLoader(data, batch_size=4, shuffle=True, collate_fn=collate))
    probes = [p["batch_size"] for p in result.batch_probe]
    assert len(set(probes)) > 1 and set(probes) <= set(seen)
    assert result.batch_size in probes and 4 < result.batch_size <= 16
    assert result.oom_recoveries == 0 and result.samples == 128


def test_predict_and_evaluate_take_collator_batches(tokenizer):
    from gpunb import evaluate, predict

    model = tiny_bert(tokenizer)
    _, val = loaders(tokenizer, transformers.DataCollatorWithPadding(tokenizer), batch_size=20)
    batch = next(iter(val))
    model.eval()
    with torch.no_grad():
        expected = model(**batch)
    logits = predict(model, val, accelerator="cpu")["logits"]
    torch.testing.assert_close(logits, expected.logits, rtol=0, atol=1e-6)
    metrics = evaluate(model, val, accelerator="cpu")
    assert metrics["val_loss"] == pytest.approx(expected.loss.item(), rel=1e-6)


def test_profiling_training_on_collator_batches(tokenizer):
    from gpunb.profiling import profile

    train, _ = loaders(tokenizer, transformers.DataCollatorWithPadding(tokenizer))
    report = profile(train=dict(model=tiny_bert(tokenizer), train_data=train), steps=2, warmup=1)
    phases = {p.name: p.ms for p in report.phases}
    assert report.steps == 2 and phases["forward"] > 0 and phases["backward"] > 0


def test_two_ranks_train_on_collator_batches_like_one_process(tokenizer):
    # Rows padded to one length, so that a batch of 16 and each rank's 8 see the same positions;
    # no dropout, as each rank draws its own masks.
    collator = transformers.DataCollatorWithPadding(tokenizer, padding="max_length", max_length=16)
    data = tokenized(tokenizer, 32, seed=0)
    one, two = tiny_bert(tokenizer, dropout=0.0), tiny_bert(tokenizer, dropout=0.0)
    single = Trainer(shuffle=False, log_every=1, accelerator="cpu", track=False).fit(
        one, DataLoader(data, batch_size=16, collate_fn=collator))
    result = Trainer(shuffle=False, log_every=1, devices=2, accelerator="cpu", track=False).fit(
        two, DataLoader(data, batch_size=8, collate_fn=collator))
    assert result.world_size == 2 and result.steps == single.steps == 2 and result.samples == 32
    for a, b in zip(one.parameters(), two.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_transforms_keep_a_batch_encoding():
    from gpunb.runtime.feed.augmenter import apply_transforms

    batch = transformers.BatchEncoding({"pixel_values": torch.ones(2, 3), "labels": torch.tensor([0, 1])})
    out = apply_transforms(batch, [lambda x: x * 2])
    assert type(out) is transformers.BatchEncoding and out.pixel_values.sum() == 12  # attribute access kept
    assert out["labels"] is batch["labels"]


def test_moving_slicing_and_counting_keep_a_batch_encoding():
    from gpunb.runtime.feed.inputs import batch_size_of, move_batch, split_batch

    batch = transformers.BatchEncoding({"input_ids": torch.arange(12).view(4, 3), "labels": torch.arange(4)})
    assert batch_size_of(batch) == 4
    moved = move_batch(batch, torch.device("cpu"))
    assert type(moved) is transformers.BatchEncoding and torch.equal(moved.input_ids, batch["input_ids"])
    first, second = split_batch(batch, 2)
    assert type(first) is transformers.BatchEncoding and torch.equal(second.labels, torch.tensor([2, 3]))


def test_predict_on_batches_padded_each_to_its_own_length_gives_each_batchs_logits(tokenizer):
    """DataCollatorForLanguageModeling pads each batch to its longest row: the logits of the batches
    differ in length, so predict returns them as a list, one tensor per batch, in order."""
    import gpunb

    model = tiny_gpt2(tokenizer)
    rows = tokenized(tokenizer, 20, seed=1).remove_columns(["label"])
    loader = DataLoader(rows, batch_size=8, collate_fn=transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False))
    outputs = gpunb.predict(model, loader, accelerator="cpu")
    batches = list(loader)
    assert isinstance(outputs["logits"], list) and len(outputs["logits"]) == len(batches) == 3
    assert len({b["input_ids"].shape[1] for b in batches}) > 1  # the lengths do differ
    model.eval()
    with torch.no_grad():
        for logits, batch in zip(outputs["logits"], batches):
            assert torch.equal(logits, model(**batch).logits)
