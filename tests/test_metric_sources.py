"""Validation metrics wherever the output and target are known: language models (shifted pairs,
labels of -100 left out), models returning `(logits, loss)`, `step` functions; a warning otherwise."""

import warnings

import pytest
import torch
from conftest import TinyGPT, classification_data, mlp
from torch import nn
from torch.utils.data import Dataset

import gpunb
from gpunb import Trainer
from gpunb.runtime.step.metrics import accuracy, divide_counted

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

VOCAB, LENGTH = 60, 12


def trainer(**options):
    """On the CPU wherever the tests run: the values are compared with float32 ones computed here."""
    return Trainer(accelerator="cpu", track=False, **options)


class Rows(Dataset):
    """Dict samples, as a tokenizer and a padding collator leave them."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def padded_counting_text(n, seed):
    """Sequences counting up from a random start, of random lengths, padded on the right: labels
    of -100 where there is no token (as DataCollatorForLanguageModeling(mlm=False) pads them)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(3, LENGTH + 1, (), generator=g))
        ids = (torch.randint(0, VOCAB, (1,), generator=g) + torch.arange(LENGTH)) % VOCAB
        real = torch.arange(LENGTH) < length
        rows.append({"input_ids": ids.where(real, 0), "attention_mask": real.long(),
                     "labels": ids.where(real, -100)})
    return Rows(rows)


def stacked(rows):
    return {key: torch.stack([row[key] for row in rows.rows]) for key in rows.rows[0]}


def tiny_gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def test_a_causal_lms_accuracy_is_next_token_accuracy_over_real_tokens():
    train, val = padded_counting_text(96, seed=0), padded_counting_text(40, seed=1)
    model = tiny_gpt2()
    result = trainer(epochs=3, batch_size=16, lr=3e-3).fit(model, train, val, metrics=["accuracy"])
    batch = stacked(val)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    predicted, next_tokens = logits[:, :-1].argmax(-1), batch["labels"][:, 1:]
    real = next_tokens != -100
    expected = (predicted == next_tokens)[real].float().mean().item()
    # batches of 16, 16 and 8 rows hold different numbers of real tokens: counted per token
    assert result.final_metrics["val_acc"] == pytest.approx(expected, abs=1e-6)
    unshifted = (logits.argmax(-1) == batch["labels"]).float().mean().item()
    assert abs(expected - unshifted) > 0.05  # the number a comparison without the shift gives
    assert gpunb.evaluate(model, val, metrics=["accuracy"], batch_size=16,
                          accelerator="cpu")["val_acc"] == pytest.approx(expected, abs=1e-6)


def test_a_masked_lm_is_scored_where_labelled_without_a_shift():
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32)
    model = transformers.BertForMaskedLM(config)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(5, VOCAB, (40, LENGTH), generator=g)
    masked = torch.rand(ids.shape, generator=g) < 0.25
    rows = Rows([{"input_ids": i.masked_fill(m, 4), "labels": i.where(m, -100)} for i, m in zip(ids, masked)])
    result = trainer(max_steps=4, batch_size=16).fit(model, rows, rows, metrics=["accuracy"])
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=stacked(rows)["input_ids"]).logits
    expected = (logits.argmax(-1) == ids)[masked].float().mean().item()
    assert result.final_metrics["val_acc"] == pytest.approx(expected, abs=1e-6)



def test_a_model_returning_logits_and_loss_is_scored_on_its_logits():
    tokens = (torch.arange(400) * 7) % VOCAB
    x = torch.stack([tokens[i:i + LENGTH] for i in range(0, 380, 5)])
    y = torch.stack([tokens[i + 1:i + 1 + LENGTH] for i in range(0, 380, 5)])
    model = TinyGPT(VOCAB)
    seen = []

    def shapes(output, target):
        seen.append((tuple(output.shape), tuple(target.shape)))
        return output.new_zeros(())

    result = trainer(max_steps=20, batch_size=16, lr=1e-2).fit(
        model, (x, y), (x, y), metrics={"acc": "accuracy", "shapes": shapes})
    with torch.no_grad():
        expected = (model(x, y)[0].argmax(-1) == y).float().mean().item()
    assert result.final_metrics["val_acc"] == pytest.approx(expected, abs=1e-6)
    # its own targets: no shift (the check before training scores a sample of the batch, then whole batches)
    assert {output[1:] for output, _ in seen} == {(LENGTH, VOCAB)} and all(t == o[:2] for o, t in seen)
    assert ((16, LENGTH, VOCAB), (16, LENGTH)) in seen


def classify(model, batch):
    x, y = batch
    output = model(x)
    return nn.functional.cross_entropy(output, y), output


def hand_accuracy(model, x, y):
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


@pytest.mark.parametrize("step", [
    classify,
    lambda model, batch: dict(zip(("loss", "output"), classify(model, batch))),
    lambda model, batch: {"loss": classify(model, batch)[0], "output": classify(model, batch)[1],
                          "target": batch[1]},
    lambda model, batch: classify(model, batch)[::-1],
], ids=["(loss, output)", "dict without target", "dict with target", "(output, loss)"])
def test_a_step_that_returns_its_output_is_scored(step):
    x, y = classification_data(n=96)
    model = mlp()
    result = trainer(epochs=2, batch_size=32).fit(model, (x, y), (x, y), step=step, metrics=["accuracy"])
    assert result.final_metrics["val_acc"] == pytest.approx(hand_accuracy(model, x, y), abs=1e-6)
    with torch.no_grad():
        loss = nn.functional.cross_entropy(model(x), y).item()
    assert result.final_metrics["val_loss"] == pytest.approx(loss, rel=1e-5)  # the loss it returned


def test_a_steps_own_target_is_scored_as_given():
    x, y = classification_data(n=64)

    def step(model, batch):
        output = model(batch[0])
        return {"loss": nn.functional.cross_entropy(output, batch[1]), "output": output,
                "target": torch.zeros_like(batch[1])}  # scored against class 0, not the batch's labels

    model = mlp()
    result = trainer(max_steps=2, batch_size=32).fit(model, (x, y), (x, y), step=step, metrics=["accuracy"])
    assert result.final_metrics["val_acc"] == pytest.approx(hand_accuracy(model, x, torch.zeros_like(y)), abs=1e-6)


class OwnLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = mlp()

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.net(x), y)


@pytest.mark.parametrize("step, model, missing", [
    (lambda model, batch: nn.functional.cross_entropy(model(batch[0]), batch[1]), mlp,
     "`step(model, batch)` returned the loss alone; return `{'loss': loss, 'output': output, 'target': target}`"),
    (None, OwnLoss, "the model returned a Tensor with no scores beside its loss"),
], ids=["step returns the loss", "model returns the loss"])
def test_metrics_that_cannot_be_computed_are_named_once(step, model, missing):
    x, y = classification_data(n=64)
    with pytest.warns(UserWarning) as caught:
        result = trainer(epochs=3, batch_size=32).fit(model(), (x, y), (x, y), step=step, metrics=["accuracy"])
    said = [str(w.message) for w in caught if "metrics=" in str(w.message)]
    assert len(said) == 1 and said[0].startswith("metrics= (acc) cannot be computed") and missing in said[0]
    assert [name for name in result.final_metrics if name.startswith("val_")] == ["val_loss"]
    assert len(result.validations) == 3


def test_a_torchmetric_that_cannot_be_computed_is_left_out_not_zero():
    torchmetrics = pytest.importorskip("torchmetrics")
    x, y = classification_data(n=64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = trainer(epochs=2, batch_size=32).fit(
            OwnLoss(), (x, y), (x, y), metrics={"acc3": torchmetrics.classification.MulticlassAccuracy(3)})
    assert [name for name in result.final_metrics if name.startswith("val_")] == ["val_loss"]
    assert all("val_acc3" not in row for row in result.epochs)  # never a made-up 0.0
    assert not [w for w in caught if "compute" in str(w.message) and "update" in str(w.message)]


def test_without_metrics_nothing_is_said():
    x, y = classification_data(n=64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer(max_steps=2, batch_size=32).fit(OwnLoss(), (x, y), (x, y))


def test_accuracy_leaves_out_labels_of_minus_100():
    scores = torch.tensor([[[2.0, 0.0], [0.0, 2.0], [2.0, 0.0]], [[0.0, 2.0], [2.0, 0.0], [0.0, 2.0]]])
    labels = torch.tensor([[0, 0, -100], [1, -100, -100]])
    assert accuracy(scores, labels).item() == pytest.approx(2 / 3)
    assert divide_counted({"val_loss": 1.5, "val_acc": 0.25, "val_acc#counted": 0.5}) == {
        "val_loss": 1.5, "val_acc": 0.5}
    assert torch.isnan(accuracy(scores, torch.full_like(labels, -100)))  # nothing to count: not a number


def test_causal_lms_are_told_from_other_hugging_face_heads_through_wrappers_and_subclasses():
    from gpunb.runtime.step.metrics import shifts_labels

    class MyLM(transformers.GPT2LMHeadModel):
        pass

    gpt2 = tiny_gpt2()
    bert = transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                   intermediate_size=16)
    assert shifts_labels(gpt2) and shifts_labels(MyLM(gpt2.config)) and shifts_labels(torch.compile(gpt2))
    assert shifts_labels(transformers.BertLMHeadModel(bert.__class__(**{**bert.to_dict(), "is_decoder": True})))
    assert not shifts_labels(transformers.BertForMaskedLM(bert))
    assert not shifts_labels(transformers.BertForTokenClassification(bert))
    assert not shifts_labels(TinyGPT(VOCAB))  # a model of one's own: its targets as given


def test_accuracy_leaves_out_the_label_the_loss_ignores():
    x, y = classification_data(n=96)
    model = mlp()
    result = trainer(max_steps=3, batch_size=32).fit(model, (x, y), (x, y), metrics=["accuracy"],
                                                     loss_fn=nn.CrossEntropyLoss(ignore_index=2))
    kept = y != 2
    assert 0 < kept.sum() < len(y)
    assert result.final_metrics["val_acc"] == pytest.approx(hand_accuracy(model, x[kept], y[kept]), abs=1e-6)
