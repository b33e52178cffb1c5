"""Every bad input gets an error that names the fix."""

import pytest
import torch
from conftest import classification_data, mlp
from torch import nn

from gpunb import Trainer
from gpunb.errors import GpunbError


def fit(model=None, data=None, **kwargs):
    trainer_options = {k: kwargs.pop(k) for k in list(kwargs) if k not in
                       ("loss_fn", "step", "optimizer", "metrics", "val_data")}
    trainer = Trainer(track=False, **trainer_options)
    val = kwargs.pop("val_data", None)
    return trainer.fit(model if model is not None else mlp(),
                       data if data is not None else classification_data(), val, **kwargs)


def test_unsupported_data_type():
    with pytest.raises(GpunbError, match="cannot batch") as error:
        fit(data="not data", loss_fn=nn.CrossEntropyLoss())
    assert "DLPack" in str(error.value)


def test_mismatched_batch_shapes():
    x, y = classification_data(n=64)
    with pytest.raises(GpunbError, match="disagree on the number of samples") as error:
        fit(data=(x, y[:50]), loss_fn=nn.CrossEntropyLoss())
    assert "(64, 10), (50,)" in str(error.value)


def test_non_scalar_loss():
    with pytest.raises(GpunbError, match="not a scalar loss") as error:
        fit(loss_fn=nn.CrossEntropyLoss(reduction="none"))
    assert "reduction='mean'" in str(error.value)


def test_model_output_without_loss_fn():
    with pytest.raises(GpunbError, match="returned a tensor of shape") as error:
        fit(model=nn.Linear(10, 3), data=classification_data()[0])
    assert "loss_fn=" in str(error.value)


def test_unknown_precision_string():
    with pytest.raises(GpunbError, match="Unknown precision 'half'") as error:
        Trainer(precision="half")
    assert "`bf16-mixed`" in str(error.value)


def test_unknown_option():
    with pytest.raises(GpunbError, match="did you mean `epochs`"):
        Trainer(epoch=3)


def test_not_a_module():
    with pytest.raises(GpunbError, match="torch.nn.Module"):
        Trainer(track=False).fit(lambda x: x, classification_data())


def test_stale_optimizer_from_an_older_model():
    old = mlp()
    optimizer = torch.optim.AdamW(old.parameters())
    with pytest.raises(GpunbError, match="none of the model's parameters") as error:
        fit(model=mlp(), optimizer=optimizer, loss_fn=nn.CrossEntropyLoss())
    assert "create the optimizer after the model" in str(error.value)


def test_both_loss_fn_and_step():
    with pytest.raises(GpunbError, match="Both `loss_fn` and `step`"):
        fit(loss_fn=nn.CrossEntropyLoss(), step=lambda m, b: m(b[0]).sum())


def test_schedule_without_a_known_length():
    from torch.utils.data import IterableDataset

    class Stream(IterableDataset):
        def __iter__(self):
            x, y = classification_data(n=32)
            return iter(zip(x, y))

    with pytest.raises(GpunbError, match="set `max_steps`"):
        fit(data=Stream(), loss_fn=nn.CrossEntropyLoss(), lr_schedule="cosine")


def test_cuda_asked_for_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(GpunbError, match="sees no CUDA GPU") as error:
        fit(loss_fn=nn.CrossEntropyLoss(), accelerator="cuda")
    assert "accelerator='auto'" in str(error.value)


def test_loss_fn_with_a_dict_batch():
    from torch.utils.data import Dataset

    class Dicts(Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return {"x": torch.randn(10)}

    with pytest.raises(GpunbError, match=r"must be \(inputs, target\)"):
        fit(data=Dicts(), loss_fn=nn.CrossEntropyLoss())


def test_error_message_itself_renders():
    error = GpunbError("what happened", "the fix")
    assert str(error) == "what happened\nHINT: the fix"


class MoveRecorder(nn.Sequential):
    """Notes every device fit moves it to."""

    def __init__(self):
        super().__init__(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3))
        self.moves = []

    def to(self, *args, **kwargs):
        self.moves.append(torch.device(args[0]))
        return super().to(*args, **kwargs)


def test_a_fit_that_fails_in_set_up_moves_the_model_back_where_it_was():
    model = MoveRecorder()
    stale = torch.optim.AdamW(mlp().parameters())
    with pytest.raises(GpunbError, match="none of the model's parameters"):
        fit(model=model, optimizer=stale, loss_fn=nn.CrossEntropyLoss())
    assert len(model.moves) == 2 and model.moves[-1] == torch.device("cpu")


@pytest.mark.cuda
def test_a_fit_that_fails_in_set_up_leaves_the_model_off_the_gpu():
    model = mlp()
    stale = torch.optim.AdamW(mlp().parameters())
    with pytest.raises(GpunbError, match="none of the model's parameters"):
        fit(model=model, optimizer=stale, loss_fn=nn.CrossEntropyLoss(), accelerator="cuda")
    assert all(p.device.type == "cpu" for p in model.parameters())
