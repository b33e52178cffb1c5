"""Roles an earlier cell left in the namespace (val_data, loss_fn, optimizer, ...) are used by a
later %%gputrain only when they match what it trains, and named in a note when they do not."""

import warnings

import IPython
import pytest
import torch
from IPython.testing.globalipapp import get_ipython

pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

SETUP = """
import torch, transformers, datasets
from torch import nn
transformers.logging.set_verbosity_error()
g = torch.Generator().manual_seed(0)

def tiny_bert():
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32, num_labels=2)
    return transformers.BertForSequenceClassification(config)

def text(n, seed):
    ids = torch.randint(1, 100, (n, 16), generator=torch.Generator().manual_seed(seed))
    return datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": (ids[:, 0] >= 50).long().tolist()}
                                      ).with_format("torch")
"""

BERT_CELL = """
model = tiny_bert()
train_data, val_data = text(64, 0), text(32, 1)
"""

CNN_CELL = """
torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))
train_data = (torch.randn(64, 1, 8, 8, generator=g), torch.randint(0, 3, (64,), generator=g))
loss_fn = nn.CrossEntropyLoss()
"""

LINE = "--max-steps 2 --batch-size 16 --quiet --no-track"


@pytest.fixture
def ip():
    shell = get_ipython() or IPython.get_ipython()
    shell.run_line_magic("load_ext", "gpunb")
    shell.user_ns.clear()
    shell.run_cell(SETUP)
    yield shell
    shell.user_ns.clear()


def notes(record) -> str:
    return "\n".join(str(w.message) for w in record if "earlier cell" in str(w.message))


def test_a_cnn_cell_after_a_bert_cell_trains_without_the_bert_val_data(ip):
    ip.run_cell_magic("gputrain", LINE, BERT_CELL)
    assert "val_loss" in ip.user_ns["gputrain_result"].final_metrics
    with pytest.warns(UserWarning) as record:
        ip.run_cell_magic("gputrain", LINE, CNN_CELL)
    result = ip.user_ns["gputrain_result"]
    assert result.steps == 2 and "val_loss" not in result.final_metrics
    text = notes(record)
    assert "`val_data` is from an earlier cell" in text and "dicts (keys 'input_ids', 'labels')" in text
    assert "`--val-data val_data`" in text


def test_an_earlier_val_data_that_matches_is_still_used(ip):
    ip.run_cell("val_data = (torch.randn(32, 1, 8, 8, generator=g), torch.randint(0, 3, (32,), generator=g))")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no note: nothing was left out
        ip.run_cell_magic("gputrain", LINE, CNN_CELL)
    assert "val_loss" in ip.user_ns["gputrain_result"].final_metrics


def test_an_earlier_val_data_of_other_features_is_left_out(ip):
    ip.run_cell("val_data = (torch.randn(32, 1, 9, 9), torch.randint(0, 3, (32,)))")
    with pytest.warns(UserWarning, match="`val_data` is from an earlier cell"):
        ip.run_cell_magic("gputrain", LINE, CNN_CELL)
    assert ip.user_ns["gputrain_result"].steps == 2


def test_an_earlier_loss_fn_gives_way_to_a_hugging_face_models_own_loss(ip):
    ip.run_cell_magic("gputrain", LINE, CNN_CELL)  # binds loss_fn
    with pytest.warns(UserWarning) as record:
        ip.run_cell_magic("gputrain", LINE + " --epochs 1", BERT_CELL)
    result = ip.user_ns["gputrain_result"]
    assert result.steps == 2 and "val_loss" in result.final_metrics
    text = notes(record)
    assert "`loss_fn` is from an earlier cell" in text and "computes its own loss" in text
    assert "`labels`" in text
    # the same training as with no loss_fn at all: the model's own loss
    trained = {k: v.clone() for k, v in ip.user_ns["model"].state_dict().items()}
    ip.run_cell("del loss_fn")
    ip.run_cell_magic("gputrain", LINE + " --epochs 1", BERT_CELL)
    again = ip.user_ns["model"].state_dict()
    assert ip.user_ns["gputrain_result"].steps == 2 and all(torch.equal(trained[k], again[k]) for k in trained)


def test_a_loss_fn_bound_in_the_cell_is_the_users_choice(ip):
    ip.run_cell("loss_fn = nn.CrossEntropyLoss()")
    with pytest.raises(Exception, match="With `loss_fn`, a batch must be"):
        ip.run_cell_magic("gputrain", LINE, BERT_CELL + "loss_fn = nn.CrossEntropyLoss()")


def test_an_earlier_optimizer_over_another_model_is_not_used(ip):
    ip.run_cell("old = nn.Linear(3, 3)\noptimizer = torch.optim.SGD(old.parameters(), lr=0.0)")
    ip.run_cell(CNN_CELL + "first = model[0].weight.detach().clone()")
    with pytest.warns(UserWarning, match="`optimizer` is from an earlier cell and updates another model's"):
        ip.run_cell_magic("gputrain", LINE, "pass")
    # the default AdamW trained the model (the SGD over `old` would have left it as it was)
    assert not torch.equal(ip.user_ns["first"], ip.user_ns["model"][0].weight)


def test_an_earlier_optimizer_over_this_model_is_used(ip):
    ip.run_cell(CNN_CELL + "optimizer = torch.optim.SGD(model.parameters(), lr=0.0)")
    ip.run_cell("first = model[0].weight.detach().clone()")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ip.run_cell_magic("gputrain", LINE, "pass")  # everything from the earlier cell
    assert torch.equal(ip.user_ns["first"], ip.user_ns["model"][0].weight)  # lr=0: its SGD was used


def test_an_earlier_scheduler_on_an_optimizer_that_is_not_trained_is_not_used(ip):
    ip.run_cell("old = nn.Linear(3, 3)\nopt = torch.optim.SGD(old.parameters(), lr=0.1)\n"
                "scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1)")
    with pytest.warns(UserWarning, match="`scheduler` is from an earlier cell and drives another optimizer"):
        ip.run_cell_magic("gputrain", LINE, CNN_CELL)
    assert ip.user_ns["gputrain_result"].steps == 2


def test_an_earlier_step_gives_way_to_a_new_model_that_computes_its_own_loss(ip):
    ip.run_cell("def step(model, batch):\n    x, y = batch\n    return nn.functional.cross_entropy(model(x), y)")
    with pytest.warns(UserWarning, match="`step` is from an earlier cell and the new model computes its own loss"):
        ip.run_cell_magic("gputrain", LINE, BERT_CELL)
    assert ip.user_ns["gputrain_result"].steps == 2


def test_earlier_class_metrics_are_left_out_for_float_targets(ip):
    ip.run_cell("metrics = ['accuracy']")
    cell = ("model = nn.Linear(4, 1)\ntrain_data = (torch.randn(64, 4), torch.randn(64, 1))\n"
            "val_data = train_data\nloss_fn = nn.MSELoss()")
    with pytest.warns(UserWarning, match="`metrics` is from an earlier cell and compares class scores"):
        ip.run_cell_magic("gputrain", LINE, cell)
    assert "val_acc" not in ip.user_ns["gputrain_result"].final_metrics
    ip.run_cell_magic("gputrain", LINE, CNN_CELL + "val_data = train_data")  # integer labels: used
    assert "val_acc" in ip.user_ns["gputrain_result"].final_metrics


def test_a_leftover_named_on_the_line_is_used_as_it_is(ip):
    ip.run_cell_magic("gputrain", LINE, BERT_CELL)
    with pytest.raises(Exception, match="val_data"):  # the user chose it: the check reports the mismatch
        ip.run_cell_magic("gputrain", LINE + " --val-data val_data", CNN_CELL)


def test_eval_judges_leftovers_against_the_data_it_evaluates(ip):
    ip.run_cell(CNN_CELL)  # loss_fn, and train_data of images
    ip.run_cell("model = tiny_bert()\nval_data = text(32, 1)")
    with pytest.warns(UserWarning, match="`loss_fn` is from an earlier cell and the model computes its own loss"):
        ip.run_cell_magic("gputrain", "--eval --batch-size 16 --quiet --out scores", "pass")
    assert set(ip.user_ns["scores"]) >= {"val_loss"}  # BERT's own loss on its val_data, not the images
