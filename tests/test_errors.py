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


class _ImageOnly(nn.Module):
    """A classifier whose forward takes the inputs only, as most do."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(10, 3)

    def forward(self, x):
        return self.fc(x)


def test_no_loss_fn_and_a_forward_that_takes_only_the_inputs():
    with pytest.raises(GpunbError) as error:
        fit(model=_ImageOnly(), max_steps=1)
    text = str(error.value)
    assert "called `model(*batch)` with 2 positional arguments because no `loss_fn` or `step`" in text
    assert "takes 2 positional arguments but 3 were given" in text
    assert "`loss_fn=`" in text and "`step(model, batch)`" in text and "`.loss`" in text


def test_no_loss_fn_and_a_dict_batch_the_forward_does_not_take():
    class Items(torch.utils.data.Dataset):
        def __len__(self):
            return 16

        def __getitem__(self, i):
            return {"image": torch.randn(10), "label": i % 3}

    with pytest.raises(GpunbError) as error:
        fit(model=_ImageOnly(), data=Items(), max_steps=1, batch_size=4)
    assert "`model(**batch)` with keys 'image', 'label'" in str(error.value)
    assert "unexpected keyword argument 'image'" in str(error.value)


def test_a_type_error_inside_forward_is_the_users_own():
    class Buggy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(10, 3)

        def forward(self, x, y):
            return len(5)

    with pytest.raises(TypeError, match="has no len"):
        fit(model=Buggy(), max_steps=1)


class _NanoGPTLike(nn.Module):
    """Returns (logits, loss) like nanoGPT's GPT.forward(idx, targets)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(10, 3)

    def forward(self, x, targets=None):
        logits = self.fc(x)
        loss = None if targets is None else nn.functional.cross_entropy(logits, targets)
        return logits, loss


def test_a_model_returning_logits_and_loss_trains_on_the_loss():
    result = fit(model=_NanoGPTLike(), max_steps=3, batch_size=32)
    assert result.steps == 3 and result.final_metrics["train_loss"] > 0


def test_a_tuple_without_one_scalar_names_the_fix():
    class TwoOutputs(_ImageOnly):
        def forward(self, x, y):
            return self.fc(x), self.fc(x)

    with pytest.raises(GpunbError, match=r"returned a tuple \(\(32, 3\), \(32, 3\)\) holding no scalar") as error:
        fit(model=TwoOutputs(), max_steps=1, batch_size=32)
    assert "step(model, batch)" in str(error.value)


def test_a_tuple_output_with_loss_fn_names_the_fix():
    class TupleOut(_ImageOnly):
        def forward(self, x):
            return self.fc(x), x

    with pytest.raises(GpunbError, match="The model returned a tuple of 2, and `loss_fn` cannot take it") as error:
        fit(model=TupleOut(), loss_fn=nn.CrossEntropyLoss(), max_steps=1)
    assert "model(x)[0]" in str(error.value)


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


def test_bad_metrics_hint_names_only_what_exists():
    import re

    import gpunb

    x, y = classification_data(n=64)
    with pytest.raises(GpunbError, match="`metrics` must be") as error:
        fit(data=(x, y), val_data=(x, y), loss_fn=nn.CrossEntropyLoss(), metrics=3, max_steps=1)
    for name in re.findall(r"gpunb\.(\w+)", str(error.value)):
        assert hasattr(gpunb, name), name  # every gpunb.<name> the hint mentions is there
    suggested = re.search(r"`metrics=(\[.*?\])`", str(error.value)).group(1)
    result = fit(data=(x, y), val_data=(x, y), loss_fn=nn.CrossEntropyLoss(), metrics=eval(suggested),
                 max_steps=1)
    assert "val_acc" in result.final_metrics
