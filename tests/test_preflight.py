"""Before the first step: empty data refused, one train and one val batch checked, nothing changed."""

import warnings

import numpy as np
import pytest
import torch
from conftest import classification_data, mlp
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from gpunb import Trainer
from gpunb.errors import GpunbError
from gpunb.runtime import prepare


def fit(model=None, data=None, val_data=None, *, loss_fn=nn.CrossEntropyLoss(), optimizer=None,
        callbacks=(), **options):
    options.setdefault("max_steps", 2)
    options.setdefault("batch_size", 32)
    return Trainer(track=False, **options).fit(
        model if model is not None else mlp(), data if data is not None else classification_data(),
        val_data, loss_fn=loss_fn, optimizer=optimizer, callbacks=callbacks)


class Items(Dataset):
    """A map-style dataset of (x, y) or dict items, as a user writes one."""

    def __init__(self, x, y, as_dict=False):
        self.x, self.y, self.as_dict = x, y, as_dict

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]} if self.as_dict else (self.x[i], self.y[i])


# -- float64 inputs -------------------------------------------------------------------------------

def test_float64_arrays_are_cast_to_the_model_dtype_once_and_train_like_float32():
    x, y = classification_data()
    with pytest.warns(UserWarning, match="train_data holds float64 tensors; gpunb casts them to float32"):
        cast = fit(mlp(), (x.double().numpy(), y.numpy()), max_steps=4)
    same = fit(mlp(), (x, y), max_steps=4)
    assert [r["loss"] for r in cast.history] == [r["loss"] for r in same.history]


def test_float64_items_of_a_dataset_name_the_cast():
    x, y = classification_data()
    with pytest.raises(GpunbError) as error:
        fit(data=Items(x.double(), y))
    text = str(error.value)
    assert "One batch of train_data failed" in text and "(float64 (32, 10), int64 (32,))" in text
    assert "first layer Linear(in_features=10), float32 weights" in text and "`x.float()`" in text


# -- labels for classification losses -------------------------------------------------------------

@pytest.mark.parametrize("labels,fix", [
    (lambda y: y.float(), "`y.long()`"),
    (lambda y: y[:, None], "`y.squeeze(1)`"),
    (lambda y: y[:, None].float(), "`y.squeeze(1).long()`"),
])
def test_wrong_labels_for_cross_entropy_name_the_fix(labels, fix):
    x, y = classification_data()
    with pytest.raises(GpunbError) as error:
        fit(data=(x, labels(y)))
    assert fix in str(error.value) and "CrossEntropyLoss" in str(error.value)


# -- shapes ---------------------------------------------------------------------------------------

def test_features_that_do_not_fit_the_first_layer_show_the_batch_and_the_model():
    x, y = classification_data(features=5)
    seen = []

    class Spy:
        def on_fit_start(self, state):
            seen.append("started")

    with pytest.raises(GpunbError) as error:
        fit(data=(x, y), callbacks=[Spy()])
    text = str(error.value)
    assert "mat1 and mat2 shapes cannot be multiplied" in text
    assert "The batch: (float32 (32, 5), int64 (32,))" in text
    assert "first Linear takes 10 features per sample" in text and "nn.Linear(5, ...)" in text
    assert seen == []  # refused before any work


def test_flattened_images_are_not_mistaken_for_a_feature_mismatch():
    x = torch.randn(64, 2, 5)
    model = nn.Sequential(nn.Flatten(), nn.Linear(10, 3))
    assert fit(model, (x, torch.randint(0, 3, (64,)))).steps == 2


def test_images_without_a_channel_dimension_name_unsqueeze():
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten(), nn.LazyLinear(3))
    with pytest.raises(GpunbError, match=r"add the channel dimension with `x.unsqueeze\(1\)`"):
        fit(model, (torch.randn(64, 8, 8), torch.randint(0, 3, (64,))))


def test_channels_last_images_name_permute():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.LazyLinear(3))
    with pytest.raises(GpunbError, match=r"takes 3 channels, and the inputs have 8") as error:
        fit(model, (torch.randn(64, 8, 8, 3), torch.randint(0, 3, (64,))))
    assert "x.permute(0, 3, 1, 2)" in str(error.value)


def test_a_val_data_that_does_not_fit_is_found_before_training():
    x, y = classification_data()
    model = mlp()
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(GpunbError) as error:
        fit(model, (x, y), val_data=(x[:, :5], y), epochs=1, max_steps=None)
    assert "One batch of val_data failed" in str(error.value)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_batch_size_auto_gets_the_same_check():
    x, y = classification_data(features=5)
    with pytest.raises(GpunbError, match="first Linear takes 10 features"):
        fit(data=(x, y), batch_size="auto")


def test_a_dataloader_of_dicts_is_checked_with_its_own_collate():
    x, y = classification_data(features=5)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(10, 3)

        def forward(self, x, y):
            return nn.functional.cross_entropy(self.fc(x), y)

    loader = DataLoader(Items(x, y, as_dict=True), batch_size=16)
    with pytest.raises(GpunbError) as error:
        fit(Model(), loader, loss_fn=None)
    assert "{'x': float32 (16, 5), 'y': int64 (16,)}" in str(error.value)
    ok = DataLoader(Items(*classification_data(), as_dict=True), batch_size=16)
    assert fit(Model(), ok, loss_fn=None).steps == 2


def test_a_single_table_with_loss_fn_says_it_holds_no_labels():
    x, _ = classification_data()
    with pytest.raises(GpunbError, match=r"this one is a tuple of 1, so the data holds no labels") as error:
        fit(data=x)
    assert "(df.drop(columns='label'), df['label'])" in str(error.value)


def test_an_error_without_a_known_cause_keeps_its_traceback_and_gains_the_batch():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(10, 3)

        def forward(self, x):
            raise RuntimeError("something of the model's own")

    with pytest.raises(RuntimeError, match="something of the model's own") as error:
        fit(Odd())
    assert "The batch: (float32 (32, 10), int64 (32,))" in "\n".join(error.value.__notes__)


# -- nothing changed -----------------------------------------------------------------------------

def test_the_check_changes_nothing_in_training(monkeypatch):
    def model():
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(10, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 3))

    x, y = classification_data()
    checked_model = model()
    checked = fit(checked_model, (x, y), val_data=(x, y), max_steps=None, epochs=2)
    monkeypatch.setattr(prepare, "preflight", lambda m, t, v, *rest: (t, v))
    plain_model = model()
    plain = fit(plain_model, (x, y), val_data=(x, y), max_steps=None, epochs=2)
    assert [r["loss"] for r in checked.history] == [r["loss"] for r in plain.history]
    assert checked.final_metrics == plain.final_metrics
    for a, b in zip(checked_model.state_dict().values(), plain_model.state_dict().values()):
        assert torch.equal(a, b)


def test_modules_keep_their_own_mode():
    model = mlp()
    model[0].eval()  # e.g. a frozen BatchNorm the user keeps in eval mode
    from gpunb.config import TrainConfig
    from gpunb.runtime.probes.preflight import preflight
    from gpunb.runtime.step.objective import Objective
    from gpunb.runtime.step.precision import Precision

    preflight(model, classification_data(), None, Objective(nn.CrossEntropyLoss()),
              Precision("32-true", torch.device("cpu")), torch.device("cpu"), TrainConfig(batch_size=8))
    assert model.training and not model[0].training


# -- empty and unbounded data ---------------------------------------------------------------------

class Empty(Dataset):
    def __len__(self):
        return 0

    def __getitem__(self, i):
        raise IndexError(i)


@pytest.mark.parametrize("data", [
    (torch.empty(0, 10), torch.empty(0, dtype=torch.long)),
    Empty(),
    DataLoader(Empty(), batch_size=4),
], ids=["tensors", "dataset", "dataloader"])
def test_empty_data_is_refused(data):
    with pytest.raises(GpunbError, match="train_data is empty: it holds 0 samples"):
        fit(data=data)


def test_drop_last_with_a_batch_larger_than_the_data_is_refused():
    x, y = classification_data(n=20)
    with pytest.raises(GpunbError, match="20 samples and the batch size is 32; with `drop_last=True`") as error:
        fit(data=(x, y), drop_last=True)
    assert "`batch_size=20`" in str(error.value)
    with pytest.raises(GpunbError, match="with `drop_last=True`"):
        fit(data=DataLoader(Items(x, y), batch_size=32, drop_last=True))


def test_empty_val_data_is_refused():
    x, y = classification_data()
    with pytest.raises(GpunbError, match="val_data is empty"):
        fit(data=(x, y), val_data=(x[:0], y[:0]))


class Endless(IterableDataset):
    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        while True:
            x = torch.randn(10, generator=g)
            yield x, int(x[0] > 0)


def test_a_stream_without_max_steps_is_told_how_to_bound_it():
    with pytest.warns(UserWarning, match=r"has no length.*Set `max_steps`"):
        with pytest.raises(GpunbError):  # stop it: the same check refuses a bad batch right after
            fit(nn.Linear(5, 2), Endless(), max_steps=None, batch_size=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fit(nn.Linear(10, 2), Endless(), max_steps=3, batch_size=8).steps == 3


# -- optimizers -----------------------------------------------------------------------------------

def test_an_optimizer_of_frozen_parameters_is_refused():
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters())
    model.requires_grad_(False)
    with pytest.raises(GpunbError, match=r"Every parameter the optimizer holds is frozen"):
        fit(model, optimizer=optimizer)


def test_an_optimizer_holding_only_some_parameters_is_warned_about():
    model = mlp()
    with pytest.warns(UserWarning, match=r"only some of the model's trainable parameters: 0.weight, 0.bias get"):
        fit(model, optimizer=torch.optim.SGD(model[2].parameters(), lr=0.1))
    model[0].requires_grad_(False)  # frozen on purpose: nothing to say
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fit(model, optimizer=torch.optim.SGD(model[2].parameters(), lr=0.1))


# -- pandas ---------------------------------------------------------------------------------------

def test_a_dataframe_and_series_train_without_internal_warnings():
    pd = pytest.importorskip("pandas")
    x, y = classification_data()
    frame = pd.DataFrame(x.numpy().astype("float32"), columns=[f"f{i}" for i in range(10)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = fit(data=(frame, pd.Series(y.numpy())))
    assert result.steps == 2


def test_a_float64_dataframe_is_cast_with_one_warning():
    pd = pytest.importorskip("pandas")
    x, y = classification_data()
    frame = pd.DataFrame(x.double().numpy())
    with pytest.warns(UserWarning) as caught:
        fit(data=(frame, pd.Series(y.numpy())))
    assert [str(w.message)[:28] for w in caught] == ["train_data holds float64 ten"]


def test_a_dataframe_with_text_names_the_columns():
    pd = pytest.importorskip("pandas")
    frame = pd.DataFrame({"a": [1.0, 2.0], "city": ["Paris", "Oslo"]})
    with pytest.raises(GpunbError, match=r"train_data\[0\] is a DataFrame whose values are not all "
                                         r"numbers \(non-numeric columns: city\)"):
        fit(data=(frame, pd.Series([0, 1])))


def test_gpunb_never_imports_pandas():
    import subprocess
    import sys

    code = ("import sys, gpunb, gpunb.trainer, gpunb.runtime.probes.preflight; "
            "sys.exit('pandas' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_non_numeric_numpy_arrays_are_refused():
    with pytest.raises(GpunbError, match="dtype <U1, which is not numeric"):
        fit(data=(np.array(["a", "b"]), np.array([0, 1])))


def test_the_checked_batches_see_the_transforms_the_feed_applies():
    from gpunb.runtime.feed.transforms import Normalize

    images = torch.randint(0, 255, (64, 1, 4, 4), dtype=torch.uint8)  # bytes until Normalize makes floats
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 3))
    data = (images, torch.randint(0, 3, (64,)))
    result = fit(model, data, val_data=data, transforms=[Normalize([0.5], [0.2])], max_steps=None, epochs=1)
    assert "val_loss" in result.final_metrics and "val_acc" in result.final_metrics
