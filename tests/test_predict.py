"""gpunb.predict / gpunb.evaluate / TrainResult.predict / %%gputrain --eval, on CPU (and 2 gloo ranks)."""

import gc

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import classification_data, mlp
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

import gpunb
from gpunb import Trainer
from gpunb.errors import GpunbError
from gpunb.runtime.predict import concatenate


def expected(model, x):
    with torch.no_grad():
        return model(x)


class DictData(Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"features": self.x[i], "labels": self.y[i]}


class DictModel(nn.Module):
    """A Hugging Face-style model: keyword inputs, a dict of outputs."""

    def __init__(self):
        super().__init__()
        self.net = mlp()

    def forward(self, features, labels=None):
        logits = self.net(features)
        return {"logits": logits, "loss": nn.functional.cross_entropy(logits, labels)}


class Stream(IterableDataset):
    def __init__(self, x):
        self.x = x

    def __iter__(self):
        return iter(self.x)


@pytest.mark.parametrize("form", ["tensor", "x_only", "x_y", "dataset", "loader", "shuffled_loader", "stream"])
def test_outputs_are_the_models_in_the_datas_order_whatever_the_form(form):
    x, y = classification_data(n=50)
    model = mlp()
    data = {"tensor": x, "x_only": (x,), "x_y": (x, y), "dataset": TensorDataset(x, y),
            "loader": DataLoader(TensorDataset(x, y), batch_size=7),
            "shuffled_loader": DataLoader(TensorDataset(x, y), batch_size=7, shuffle=True),
            "stream": Stream(x)}[form]
    out = gpunb.predict(model, data, batch_size=16)
    assert out.shape == (50, 3) and out.device.type == "cpu"
    torch.testing.assert_close(out, expected(model, x))
    assert not out.requires_grad


def test_dict_batches_go_in_as_keywords_and_dict_outputs_are_concatenated():
    x, y = classification_data(n=20)
    model = DictModel()
    out = gpunb.predict(model, DictData(x, y), batch_size=8)
    assert set(out) == {"logits", "loss"}
    torch.testing.assert_close(out["logits"], expected(model.net, x))
    assert out["loss"].shape == (3,)  # one 0-d loss per batch, stacked


def test_tuple_outputs_and_nested_concatenation():
    parts = [(torch.ones(2, 3), {"a": torch.zeros(2)}), (torch.ones(1, 3), {"a": torch.zeros(1)})]
    joined = concatenate(parts)
    assert isinstance(joined, tuple) and joined[0].shape == (3, 3) and joined[1]["a"].shape == (3,)
    assert concatenate([]) == []


def test_the_model_runs_in_eval_mode_and_every_modules_mode_is_put_back():
    x, _ = classification_data(n=40)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.Dropout(0.5), nn.BatchNorm1d(16), nn.Linear(16, 3))
    model.train()
    model[2].eval()  # a module the user froze in eval mode stays so
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = gpunb.predict(model, x, batch_size=8)
    model.eval()
    torch.testing.assert_close(out, expected(model, x))  # dropout off, running statistics used
    model.train()
    model[2].eval()
    assert [m.training for m in model.modules()] == [True, True, True, False, True]
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name  # BatchNorm statistics untouched


def test_float64_data_is_cast_to_the_models_dtype():
    x, _ = classification_data(n=12)
    model = mlp()
    with pytest.warns(UserWarning, match="float64"):
        out = gpunb.predict(model, x.double(), batch_size=5)
    torch.testing.assert_close(out, expected(model, x))


def test_bad_calls_are_refused_with_the_fix():
    x, _ = classification_data(n=12)
    with pytest.raises(GpunbError, match="fixed batch size"):
        gpunb.predict(mlp(), x, batch_size="auto")
    with pytest.raises(GpunbError, match="only inside a process group(.|\n)*HINT: .*torchrun"):
        gpunb.predict(mlp(), x, devices=2)
    with pytest.raises(GpunbError, match="must be a torch.nn.Module"):
        gpunb.predict(lambda t: t, x)
    with pytest.raises(GpunbError, match="Unknown precision"):
        gpunb.predict(mlp(), x, precision="fp8")


def test_evaluate_reports_what_fits_validation_reported():
    x, y = classification_data(n=256)
    model = mlp()
    accuracy = lambda out, target: (out.argmax(1) == target).float().mean()  # noqa: E731
    result = Trainer(epochs=2, batch_size=32, track=False).fit(
        model, (x[:200], y[:200]), (x[200:], y[200:]), loss_fn=nn.CrossEntropyLoss(),
        metrics={"mine": accuracy})
    metrics = gpunb.evaluate(model, (x[200:], y[200:]), loss_fn=nn.CrossEntropyLoss(),
                             metrics={"mine": accuracy}, batch_size=32)
    assert set(metrics) == {"val_loss", "val_mine"}
    for name, value in metrics.items():
        assert value == pytest.approx(result.final_metrics[name], abs=1e-6)
    # The result remembers the run's model, loss and metrics.
    assert result.evaluate((x[200:], y[200:])) == pytest.approx(metrics, abs=1e-6)


def test_evaluate_without_loss_fn_uses_the_models_own_loss():
    x, y = classification_data(n=20)
    model = DictModel()
    metrics = gpunb.evaluate(model, DictData(x, y), batch_size=20)
    with torch.no_grad():
        loss = nn.functional.cross_entropy(model.net(x), y)
    assert metrics == {"val_loss": pytest.approx(loss.item(), abs=1e-6)}


def test_result_predict_uses_the_runs_model_and_batch_size():
    x, y = classification_data(n=64)
    model = mlp()
    result = Trainer(max_steps=2, batch_size=16, track=False).fit(model, (x, y), loss_fn=nn.CrossEntropyLoss())
    seen = []
    model.register_forward_hook(lambda module, inputs, output: seen.append(len(inputs[0])))
    out = result.predict(x[:40])
    torch.testing.assert_close(out, expected(model, x[:40]))
    assert seen[:3] == [16, 16, 8]
    assert len(result.predict(x[:40], batch_size=40)) == 40 and seen[-1] == 40  # overrides win


def test_a_result_without_a_model_says_how_to_predict():
    from gpunb import TrainResult

    with pytest.raises(GpunbError, match="holds no model(.|\n)*HINT: .*gpunb.predict"):
        TrainResult("copy").predict(torch.zeros(2, 10))


def test_a_result_whose_model_was_deleted_says_so():
    x, y = classification_data(n=32)
    result = Trainer(max_steps=1, batch_size=16, track=False).fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss())
    gc.collect()
    with pytest.raises(GpunbError, match="has been deleted(.|\n)*HINT: keep a reference"):
        result.evaluate((x, y))


def test_the_model_stays_out_of_a_pickled_result():
    import pickle

    x, y = classification_data(n=32)
    result = Trainer(max_steps=1, batch_size=16, track=False).fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss())
    assert not hasattr(pickle.loads(pickle.dumps(result)), "_fitted")


# --------------------------------------------------------------------------- 2 gloo ranks


def _rank(rank, port, x, y, path):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.TCPStore("127.0.0.1", port, is_master=False),
                            rank=rank, world_size=2)
    model = mlp()
    out = gpunb.predict(model, x, batch_size=4, devices=2)
    from_loader = gpunb.predict(model, DataLoader(TensorDataset(x, y), batch_size=3, shuffle=True), devices=2)
    metrics = gpunb.evaluate(model, (x, y), loss_fn=nn.CrossEntropyLoss(), batch_size=4, devices=2)
    torch.save({"out": out, "from_loader": from_loader, "metrics": metrics}, f"{path}.{rank}")
    dist.barrier()


def test_two_ranks_share_the_samples_without_duplicates_and_each_returns_all_in_order(tmp_path):
    x, y = classification_data(n=11)  # not a multiple of 2 or of the batch: no padding may show
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    gc.freeze()  # forked processes must not finalise earlier tests' garbage
    try:
        mp.start_processes(_rank, args=(store.port, x, y, str(tmp_path / "out")), nprocs=2, start_method="fork")
    finally:
        gc.unfreeze()
    model = mlp()
    single = gpunb.evaluate(model, (x, y), loss_fn=nn.CrossEntropyLoss(), batch_size=4)
    for rank in (0, 1):
        saved = torch.load(tmp_path / f"out.{rank}")
        torch.testing.assert_close(saved["out"], expected(model, x))
        torch.testing.assert_close(saved["from_loader"], expected(model, x))
        assert saved["metrics"] == pytest.approx(single, abs=1e-6)


# --------------------------------------------------------------------------- %%gputrain --eval


def test_gputrain_eval_evaluates_val_data_without_training(ip, capsys):
    ip.run_cell_magic("gputrain", "--eval --batch-size 16", "model = mlp()\nval_data = (x, y)\n"
                      "loss_fn = nn.CrossEntropyLoss()\nbefore = [p.clone() for p in model.parameters()]")
    metrics = ip.user_ns["gputrain_result"]
    model = ip.user_ns["model"]
    assert metrics == pytest.approx(gpunb.evaluate(model, (ip.user_ns["x"], ip.user_ns["y"]),
                                                   loss_fn=nn.CrossEntropyLoss()), abs=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ip.user_ns["before"]))
    printed = capsys.readouterr().out
    assert printed.startswith("evaluated val_data (96 samples): val_acc=") and "val_loss=" in printed


def test_gputrain_eval_falls_back_to_train_data_and_needs_some_data(ip, capsys):
    ip.run_cell_magic("gputrain", "--eval --out scores", "model = mlp()\ntrain_data = (x, y)\n"
                      "loss_fn = nn.CrossEntropyLoss()")
    assert set(ip.user_ns["scores"]) == {"val_loss", "val_acc"}
    assert capsys.readouterr().out.startswith("evaluated train_data (96 samples)")
    ip.run_cell_magic("gputrain", "--eval --quiet", "model = mlp()\ntrain_data = (x, y)")
    assert capsys.readouterr().out == "" and "val_loss" in ip.user_ns["gputrain_result"]
    ip.user_ns.pop("train_data")
    from IPython.core.error import UsageError

    with pytest.raises(UsageError, match="needs data to evaluate on(.|\n)*HINT: define `val_data"):
        ip.run_cell_magic("gputrain", "--eval", "model = mlp()")



def test_outputs_ragged_beyond_the_sample_dimension_come_back_per_batch_and_per_sample_across_ranks():
    from gpunb.runtime.predict import Ragged, _interleave

    short, long = torch.zeros(2, 3, 5), torch.ones(1, 4, 5)
    joined = concatenate([short, long])
    assert isinstance(joined, Ragged) and [t.shape for t in joined] == [(2, 3, 5), (1, 4, 5)]
    # two ranks: rank 0 had samples 0 and 2 (one batch of length 3), rank 1 sample 1 (length 4)
    rank0 = Ragged([torch.stack([torch.full((3,), 0.0), torch.full((3,), 2.0)])])
    rank1 = Ragged([torch.full((1, 4), 1.0)])
    whole = _interleave([rank0, rank1], 3)
    assert [t[0].item() for t in whole] == [0, 1, 2] and [len(t) for t in whole] == [3, 4, 3]
