"""torchmetrics in `metrics=`: computed over the whole validation set (not averaged per batch),
named after their keys or classes, on the run's device, and over every rank; each
validation sample counted once when the shares of several ranks are evened out."""

import pytest
import torch
from conftest import classification_data, mlp
from sklearn.metrics import f1_score, roc_auc_score
from torch import nn
from torchmetrics import MetricCollection
from torchmetrics.classification import BinaryAUROC, MulticlassAccuracy, MulticlassF1Score

from gpunb import Trainer
from gpunb.errors import GpunbError
from gpunb.runtime.feed.feeds import EpochOrder
from gpunb.runtime.step.objective import Objective

FIT = dict(epochs=1, batch_size=16, track=False, accelerator="cpu", log_every=5)


def predictions(model, x):
    with torch.no_grad():
        return model(x)


def data(n=250, classes=3):
    x, y = classification_data(n, classes=classes)
    return (x[:200], y[:200]), (x[200:], y[200:])


def test_f1_over_the_whole_validation_set_equals_sklearns_where_per_batch_means_differ():
    train, val = data()
    model = mlp()
    f1 = MulticlassF1Score(num_classes=3, average="macro")
    per_batch = lambda output, target: MulticlassF1Score(num_classes=3, average="macro")(output, target)  # noqa: E731
    result = Trainer(**FIT).fit(model, train, val, loss_fn=nn.CrossEntropyLoss(),
                                metrics={"f1": f1, "f1_batch_mean": per_batch})
    expected = f1_score(val[1].numpy(), predictions(model, val[0]).argmax(1).numpy(), average="macro")
    assert result.final_metrics["val_f1"] == pytest.approx(expected, abs=1e-6)
    assert abs(result.final_metrics["val_f1_batch_mean"] - expected) > 1e-3  # the mean of batch F1s is not F1


def test_auroc_equals_sklearns():
    x, y = classification_data(300, classes=2)
    model = nn.Sequential(mlp(classes=1), nn.Flatten(0), nn.Sigmoid())  # (N,) scores of class 1

    def loss_fn(output, target):
        return nn.functional.binary_cross_entropy(output, target.float())

    result = Trainer(**FIT).fit(model, (x[:200], y[:200]), (x[200:], y[200:]), loss_fn=loss_fn,
                                metrics=[BinaryAUROC()])
    expected = roc_auc_score(y[200:].numpy(), predictions(model, x[200:]).numpy())
    assert result.final_metrics["val_binaryauroc"] == pytest.approx(expected, abs=1e-6)


def test_a_collection_names_its_metrics_with_its_keys_and_no_accuracy_is_added():
    train, val = data()
    collection = MetricCollection({"f1": MulticlassF1Score(num_classes=3), "acc3": MulticlassAccuracy(num_classes=3)})
    result = Trainer(**{**FIT, "epochs": 2}).fit(mlp(), train, val, loss_fn=nn.CrossEntropyLoss(), metrics=collection)
    assert set(result.final_metrics) == {"train_loss", "val_loss", "val_f1", "val_acc3"}
    assert all({"val_f1", "val_acc3"} <= set(row) for row in result.epochs)  # computed per pass...
    assert result.epochs[0]["val_f1"] != result.epochs[1]["val_f1"]  # ...and reset between passes


def test_a_single_metric_is_named_after_its_class_and_mixes_with_functions():
    train, val = data()
    result = Trainer(**FIT).fit(mlp(), train, val, loss_fn=nn.CrossEntropyLoss(),
                                metrics=[MulticlassAccuracy(num_classes=3, average="micro"), "accuracy"])
    # micro accuracy over the whole set is the per-batch weighted mean of accuracy
    assert result.final_metrics["val_multiclassaccuracy"] == pytest.approx(result.final_metrics["val_acc"], abs=1e-6)


def test_a_metric_used_before_the_fit_starts_from_nothing():
    train, val = data()
    model = mlp()
    f1 = MulticlassF1Score(num_classes=3, average="macro")
    f1.update(torch.randn(50, 3), torch.randint(0, 3, (50,)))  # left over from the user's own use
    result = Trainer(**FIT).fit(model, train, val, loss_fn=nn.CrossEntropyLoss(), metrics={"f1": f1})
    expected = f1_score(val[1].numpy(), predictions(model, val[0]).argmax(1).numpy(), average="macro")
    assert result.final_metrics["val_f1"] == pytest.approx(expected, abs=1e-6)


def test_a_metric_that_is_not_one_number_says_how_to_reduce_it():
    train, val = data()
    with pytest.raises(GpunbError, match=r"(?s)shape \(3,\).*average='macro'"):
        Trainer(**FIT).fit(mlp(), train, val, loss_fn=nn.CrossEntropyLoss(),
                           metrics={"f1": MulticlassF1Score(num_classes=3, average="none")})


def test_the_metric_follows_the_run_to_its_device(monkeypatch):
    moved = []
    f1 = MulticlassF1Score(num_classes=3)
    original = f1.to
    monkeypatch.setattr(f1, "to", lambda device: moved.append(str(device)) or original(device))
    train, val = data()
    Trainer(**FIT).fit(mlp(), train, val, loss_fn=nn.CrossEntropyLoss(), metrics={"f1": f1})
    assert moved == ["cpu"]


def test_bad_metrics_still_name_the_forms_that_work():
    with pytest.raises(GpunbError, match="torchmetrics Metric"):
        Objective(nn.CrossEntropyLoss(), metrics=42)


@pytest.mark.parametrize("n, world", [(5, 2), (7, 3), (6, 4), (4, 2), (1, 3)])
def test_the_shares_repeat_at_most_one_sample_each_and_say_so(n, world):
    orders = [EpochOrder(n, shuffle=True, seed=1, rank=r, world_size=world) for r in range(world)]
    shares = [o.indices(0).tolist() for o in orders]
    unique = [share[:len(share) - o.padding] for share, o in zip(shares, orders)]
    assert sorted(i for share in unique for i in share) == list(range(n))  # each sample once
    assert sum(o.padding for o in orders) == len(orders[0]) * world - n
    assert {len(share) for share in shares} == {len(orders[0])}  # equal shares: the same forward passes


# --- two ranks (gloo): an odd number of validation samples


def test_two_ranks_count_each_validation_sample_once_and_torchmetrics_see_all_ranks():
    x, y = classification_data(229)
    train, val = (x[:200], y[:200]), (x[200:], y[200:])  # 29 samples: rank 1's share repeats one
    f1 = MulticlassF1Score(num_classes=3, average="macro")
    options = dict(FIT, batch_size=8, epochs=1, shuffle=False, lr=1e-9)  # the weights barely move
    one = Trainer(**options).fit(mlp(), train, val, loss_fn=nn.CrossEntropyLoss(),
                                 metrics={"f1": f1, "acc": "accuracy"})
    two = Trainer(**options, devices=2).fit(mlp(), train, val, loss_fn=nn.CrossEntropyLoss(),
                                            metrics={"f1": f1, "acc": "accuracy"})
    for name in ("val_loss", "val_acc"):
        assert two.final_metrics[name] == pytest.approx(one.final_metrics[name], abs=1e-6)
    model = mlp()  # the untrained weights: lr=1e-9 leaves them as they are to 1e-6
    expected = f1_score(val[1].numpy(), predictions(model, val[0]).argmax(1).numpy(), average="macro")
    assert two.final_metrics["val_f1"] == pytest.approx(expected, abs=1e-6)
    assert one.final_metrics["val_f1"] == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("rank, padding", [(0, 0), (1, 1)])
def test_a_users_distributed_sampler_says_which_rank_repeats_a_sample(rank, padding):
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from gpunb import TrainConfig
    from gpunb.runtime.feed.feeds import build_feed

    dataset = TensorDataset(torch.arange(5.0))
    loader = DataLoader(dataset, batch_size=2, sampler=DistributedSampler(dataset, num_replicas=2, rank=rank))
    feed = build_feed(loader, batch_size=2, device=torch.device("cpu"), config=TrainConfig(), train=False)
    assert feed.padding == padding
