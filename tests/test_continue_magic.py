"""`%gputrain --continue` as a line magic: no cell to write, the same run going on."""

import pytest
from IPython.core.error import UsageError

CELL = "model = mlp()\ntrain_data = (x, y)\nloss_fn = nn.CrossEntropyLoss()\n"
OPTIONS = "--batch-size 16 --log-every 2 --quiet --no-track"


def test_the_line_magic_continues_the_last_fit(ip):
    ip.run_cell_magic("gputrain", f"--epochs 2 {OPTIONS}", CELL)
    first = ip.user_ns["gputrain_result"]
    ip.run_line_magic("gputrain", f"--continue --epochs 1 {OPTIONS}")
    more = ip.user_ns["gputrain_result"]
    assert more.steps == 18 and [row["epoch"] for row in more.epochs] == [0, 1, 2]
    assert more.history[:len(first.history)] == first.history


def test_an_empty_cell_magic_names_the_line_magic(ip):
    # IPython refuses a cell magic without a body; its message points to the line magic.
    ip.run_cell_magic("gputrain", f"--epochs 1 {OPTIONS}", CELL)
    with pytest.raises(UsageError, match="Did you mean the line magic %gputrain"):
        ip.run_cell_magic("gputrain", f"--continue --epochs 1 {OPTIONS}", "")


def test_the_line_magic_cannot_export_a_cell_it_does_not_have(ip):
    with pytest.raises(UsageError, match="a line magic has no cell"):
        ip.run_line_magic("gputrain", "--export train.py")


def test_a_continued_fit_goes_on_under_its_name_and_counts_its_own_samples(ip):
    ip.run_cell_magic("gputrain", f"--epochs 2 --name digits {OPTIONS}", CELL)
    first = ip.user_ns["gputrain_result"]
    ip.run_line_magic("gputrain", f"--continue --epochs 1 {OPTIONS}")
    more = ip.user_ns["gputrain_result"]
    assert more.run_name == "digits"  # not the model's class, "Sequential"
    # the summary's rate is this fit's samples over this fit's time, not the run's total over it
    assert (more.samples, more.start_samples) == (3 * 96, 2 * 96)
    assert more.samples_per_s == pytest.approx(96 / more.wall_time_s)
    from gpunb.render import summary_rows

    wall = dict(summary_rows(more))["wall time"]
    assert "(96 samples in this fit of 288, " in wall, wall
    assert "(192 samples, " in dict(summary_rows(first))["wall time"]


def test_a_tracked_continuation_goes_on_in_the_same_run_of_the_registry():
    from conftest import classification_data, mlp
    from torch import nn

    from gpunb import Trainer
    from gpunb.runs import Registry

    trainer = Trainer(epochs=1, batch_size=16, log_every=2)
    model, data = mlp(), classification_data(n=96)
    # the recorder writes to the default registry: GPUNB_HOME, a temp dir in the tests
    first = trainer.fit(model, data, loss_fn=nn.CrossEntropyLoss())
    more = trainer.fit(model, data, loss_fn=nn.CrossEntropyLoss(), continue_from=first)
    runs = Registry().list_runs()
    assert len(runs) == 1, [(run["name"], run["status"]) for run in runs]
    (run,) = runs
    assert (run["status"], run["step"]) == ("completed", more.steps) and more.steps == 2 * first.steps
    history = Registry().get_run(run["id"])["history"]
    assert [point["step"] for point in history] == [row["step"] for row in more.history]


def test_a_continuation_keeps_the_objective_of_the_fit_it_continues(ip):
    # A forward that could take the target would make an earlier cell's loss_fn a leftover to drop
    # in a new cell; a continuation trains on what the last fit trained with.
    ip.run_cell("class Net(nn.Module):\n"
                "    def __init__(self):\n"
                "        super().__init__()\n"
                "        self.layer = nn.Linear(10, 3)\n"
                "    def forward(self, x, y=None):\n"
                "        return self.layer(x)\n")
    ip.run_cell_magic("gputrain", f"--epochs 1 {OPTIONS}",
                      "model = Net()\ntrain_data = (x, y)\nloss_fn = nn.CrossEntropyLoss()\n")
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ip.run_line_magic("gputrain", f"--continue --epochs 1 {OPTIONS}")
    assert not [w for w in caught if "loss_fn" in str(w.message)]
    assert ip.user_ns["gputrain_result"].steps == 12
