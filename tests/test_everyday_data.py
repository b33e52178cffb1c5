"""Everyday data and models that used to be refused or unexplained: lists of samples, ragged
text, a `label` column, nanoGPT with `loss_fn`, the EmbeddingBag tutorial's batch order, a
wrong input shape, int32 labels. Each gets training or one message that leads with the fix."""

import warnings

import pytest
import torch
from conftest import classification_data, mlp
from torch import nn
from torch.utils.data import DataLoader, Dataset

from gpunb import Trainer
from gpunb.errors import GpunbError


def fit(model, data, val_data=None, **options):
    loss_fn = options.pop("loss_fn", None)
    options.setdefault("max_steps", 2)
    options.setdefault("batch_size", 16)
    return Trainer(track=False, **options).fit(model, data, val_data, loss_fn=loss_fn)


# -- (a) a Python list of samples ----------------------------------------------------------------

def test_a_list_of_pairs_trains_as_a_dataloader_would_batch_it():
    x, y = classification_data()
    pairs = [(x[i], y[i]) for i in range(len(x))]
    torch.manual_seed(0)
    result = fit(mlp(), pairs, pairs[:64], loss_fn=nn.CrossEntropyLoss(), epochs=1, max_steps=None)
    assert result.steps == -(-len(x) // 16) and "val_loss" in result.final_metrics


def test_a_list_of_dict_samples_trains():
    x, y = classification_data()

    class OwnLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(10, 3)

        def forward(self, features, labels):
            return nn.functional.cross_entropy(self.fc(features), labels)

    samples = [{"features": x[i], "labels": y[i]} for i in range(len(x))]
    assert fit(OwnLoss(), samples).steps == 2


def test_a_list_of_samples_holding_python_lists_is_refused_with_the_fix():
    samples = [{"input_ids": [1, 2, 3], "labels": 0}, {"input_ids": [4, 5, 6], "labels": 1}]
    with pytest.raises(GpunbError, match=r"rows of train_data hold Python lists") as error:
        fit(nn.Linear(3, 2), samples)
    assert "make each sample's values tensors (e.g. `torch.tensor(values)`)" in str(error.value)


def test_a_tuple_of_python_lists_stays_columns():
    with pytest.raises(GpunbError, match=r"train_data\[0\] holds a list"):
        fit(mlp(), ([[0.0] * 10] * 4, [0, 1, 0, 1]), loss_fn=nn.CrossEntropyLoss())


# -- (b) ragged text -----------------------------------------------------------------------------

def test_a_ragged_torch_format_dataset_names_the_padding_collator():
    datasets = pytest.importorskip("datasets")
    ids = [list(range(1, 4 + i % 5)) for i in range(32)]
    ds = datasets.Dataset.from_dict({"input_ids": ids, "labels": [i % 2 for i in range(32)]}).with_format("torch")
    with pytest.raises(GpunbError) as error:
        fit(nn.Linear(4, 2), ds)
    text = str(error.value)
    assert "differ in length (ragged)" in text and "stack expects each tensor to be equal size" in text
    assert "collate_fn=transformers.DataCollatorWithPadding(tokenizer)" in text
    assert "train_data = DataLoader(ds, batch_size=16" in text
    assert isinstance(error.value.__cause__, RuntimeError)


def test_ragged_tuples_in_a_dataloader_name_pad_sequence():
    class Tokens(Dataset):
        def __len__(self):
            return 32

        def __getitem__(self, i):
            return torch.arange(3 + i % 4), i % 2

    with pytest.raises(GpunbError) as error:
        fit(nn.Linear(4, 2), DataLoader(Tokens(), batch_size=8), loss_fn=nn.CrossEntropyLoss())
    text = str(error.value)
    assert "differ in length (ragged)" in text and "batch_size=8, shuffle=True, collate_fn=pad)" in text
    assert "torch.nn.utils.rnn.pad_sequence" in text


def test_a_ragged_stream_names_the_padding_fix_too():
    class Stream(torch.utils.data.IterableDataset):  # inherits a __getitem__ that raises
        def __iter__(self):
            for i in range(32):
                yield torch.arange(3 + i % 4), i % 2

    with pytest.raises(GpunbError) as error:
        fit(nn.Linear(4, 2), DataLoader(Stream(), batch_size=8), loss_fn=nn.CrossEntropyLoss(), max_steps=2)
    assert "differ in length (ragged)" in str(error.value) and "pad_sequence" in str(error.value)


def test_a_layer_given_a_scalar_is_explained():
    from gpunb.runtime.probes.explain import layer_hint

    hint = layer_hint("0", nn.Linear(4, 2), (torch.tensor(1.0),))
    assert "`0` (Linear) cannot take" in hint


# -- (c) Hugging Face labels under another key, or none ---------------------------------------------

def _bert():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16, num_labels=2)
    return transformers.BertForSequenceClassification(config)


def _text(columns):
    datasets = pytest.importorskip("datasets")
    ids = torch.randint(1, 50, (32, 8), generator=torch.Generator().manual_seed(0))
    data = {"input_ids": ids.tolist(), **{name: (ids[:, 0] > 25).long().tolist() for name in columns}}
    return datasets.Dataset.from_dict(data).with_format("torch")


def test_a_label_column_instead_of_labels_says_to_rename_it():
    model = _bert()
    with pytest.raises(GpunbError) as error:
        fit(model, _text(["label"]))
    text = str(error.value)
    assert "computes its loss only when it is given `labels`" in text and "'label'" in text
    assert "ds.rename_column('label', 'labels')" in text
    assert "NoneType" not in text and "pass `loss_fn=`" not in text
    assert fit(model, _text(["labels"])).steps == 2


def test_no_labels_at_all_says_which_key_the_model_wants():
    with pytest.raises(GpunbError) as error:
        fit(_bert(), _text([]))
    text = str(error.value)
    assert "have no 'labels' (keys: 'input_ids')" in text and "ds.add_column('labels', labels)" in text


# -- (d) nanoGPT with loss_fn ---------------------------------------------------------------------

class TinyGPT(nn.Module):
    """nanoGPT's interface: forward(idx, targets=None) -> (logits, loss)."""

    def __init__(self, vocab=20):
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, 8), nn.Linear(8, vocab)

    def forward(self, idx, targets=None):
        logits = self.head(self.emb(idx))
        if targets is None:
            return logits[:, [-1], :], None  # inference: the last position only, no loss
        loss = nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def test_nanogpt_with_loss_fn_is_told_to_drop_it():
    tokens = torch.randint(0, 20, (64, 9), generator=torch.Generator().manual_seed(0))
    data = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    with pytest.raises(GpunbError) as error:
        fit(TinyGPT(), data, loss_fn=nn.CrossEntropyLoss())
    text = str(error.value)
    assert "HINT: drop `loss_fn`: the model computes its loss (its forward takes `targets`)" in text
    assert "model(x)[0]" not in text
    assert fit(TinyGPT(), data).steps == 2  # the fix works


# -- (e) the EmbeddingBag tutorial's (label, text, offsets) ---------------------------------------

class TextClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding, self.fc = nn.EmbeddingBag(100, 8), nn.Linear(8, 4)

    def forward(self, text, offsets):
        return self.fc(self.embedding(text, offsets))


class Sentences(Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        return i % 4, torch.arange(1, 3 + i % 5)  # (label, token ids)


def label_first(items):
    """The tutorial's collate_batch: (label, text, offsets)."""
    labels = torch.tensor([label for label, _ in items])
    offsets = torch.tensor([0] + [len(t) for _, t in items[:-1]]).cumsum(0)
    return labels, torch.cat([t for _, t in items]), offsets


def test_the_tutorials_batch_order_names_the_target_gpunb_took():
    loader = DataLoader(Sentences(), batch_size=8, collate_fn=label_first)
    with pytest.raises(GpunbError) as error:
        fit(TextClassifier(), loader, loss_fn=nn.CrossEntropyLoss())
    text = str(error.value)
    assert "`model(batch[0], batch[1])` and `loss_fn(output, batch[2])`" in text
    assert "batch[2] (int64 (8,)), is the target" in text
    assert "return `(text, offsets, label)`" in text
    assert "first layer EmbeddingBag(100, 8)" in text and "It failed in `embedding` (EmbeddingBag)" in text

    def text_first(items):
        labels, text_, offsets = label_first(items)
        return text_, offsets, labels

    fixed = DataLoader(Sentences(), batch_size=8, collate_fn=text_first)
    assert fit(TextClassifier(), fixed, loss_fn=nn.CrossEntropyLoss()).steps == 2


# -- (f) a wrong input shape ----------------------------------------------------------------------

def test_unflattened_images_into_a_linear_name_flatten():
    images = (torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,)))
    with pytest.raises(GpunbError) as error:
        fit(nn.Sequential(nn.Linear(784, 10)), images, loss_fn=nn.CrossEntropyLoss())
    text = str(error.value)
    assert text.startswith("One batch of train_data failed in the model or the loss before training started: "
                           "RuntimeError: mat1 and mat2 shapes cannot be multiplied")
    assert "It failed in `0` (Linear), given float32 (16, 1, 28, 28)" in text
    assert "HINT: flatten the inputs: put `nn.Flatten()` before `0`" in text
    assert isinstance(error.value.__cause__, RuntimeError)  # torch's error stays chained


def test_a_layer_deep_in_the_model_that_does_not_fit_is_named_with_its_fix():
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(100, 10))
    with pytest.raises(GpunbError) as error:
        fit(model, (torch.randn(64, 1, 8, 8), torch.randint(0, 10, (64,))), loss_fn=nn.CrossEntropyLoss())
    text = str(error.value)
    assert "It failed in `3` (Linear), given float32 (16, 144)" in text
    assert "`3` takes 100 features and gets (16, 144): build it with `nn.Linear(144, 10)`" in text


def test_a_wrong_shape_in_a_cell_is_one_usage_error_that_leads_with_the_fix():
    import IPython
    from IPython.core.error import UsageError
    from IPython.testing.globalipapp import get_ipython

    shell = get_ipython() or IPython.get_ipython()
    shell.run_line_magic("load_ext", "gpunb")
    shell.user_ns.clear()
    cell = ("import torch\nfrom torch import nn\nmodel = nn.Sequential(nn.Linear(784, 10))\n"
            "train_data = (torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,)))\nloss_fn = nn.CrossEntropyLoss()")
    try:
        with pytest.raises(UsageError) as error:
            shell.run_cell_magic("gputrain", "--max-steps 1 --quiet --no-track", cell)
    finally:
        shell.user_ns.clear()
    assert "nn.Flatten()" in str(error.value) and len(str(error.value).splitlines()) <= 6


# -- int32 labels ---------------------------------------------------------------------------------

def test_int32_labels_of_tensor_data_are_cast_with_a_note():
    x, y = classification_data()
    with pytest.warns(UserWarning, match=r"labels of train_data are int32, and CrossEntropyLoss takes int64"):
        result = fit(mlp(), (x, y.int()), (x[:32], y[:32].int()), loss_fn=nn.CrossEntropyLoss())
    assert result.steps == 2 and "val_loss" in result.final_metrics


def test_int32_labels_from_a_dataset_name_the_fix():
    x, y = classification_data()
    items = [(x[i], y[i].int()) for i in range(len(x))]
    with pytest.raises(GpunbError) as error:
        fit(mlp(), items, loss_fn=nn.CrossEntropyLoss())
    assert "takes int64 class labels, and the labels are int32: use `y.long()`" in str(error.value)


def test_int64_labels_get_no_note():
    x, y = classification_data()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss()).steps == 2


def test_a_torchscript_model_is_checked_without_hooks():
    scripted = torch.jit.script(nn.Sequential(nn.Linear(784, 10)))  # takes no Python hooks
    with pytest.raises(Exception, match="mat1 and mat2 shapes cannot be multiplied") as error:
        fit(scripted, (torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))), loss_fn=nn.CrossEntropyLoss())
    assert "not supported on ScriptModules" not in str(error.value)
