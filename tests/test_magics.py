"""%%gputrain and %gpustatus in-process: what the user sees and what lands in the namespace."""

import IPython
import pytest
import torch
from conftest import charts_in
from IPython.core.error import UsageError
from IPython.testing.globalipapp import get_ipython

SETUP = """
import torch
from torch import nn
g = torch.Generator().manual_seed(0)
x = torch.randn(256, 10, generator=g)
y = (x[:, 0] > 0).long()
"""

CELL = """
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 2))
train_data = (x[:200], y[:200])
val_data = (x[200:], y[200:])
loss_fn = nn.CrossEntropyLoss()
"""


@pytest.fixture
def ip():
    shell = get_ipython() or IPython.get_ipython()  # the first call starts it, later ones return None
    shell.run_line_magic("load_ext", "gpunb")
    shell.user_ns.clear()
    shell.run_cell(SETUP)
    yield shell
    shell.user_ns.clear()


def test_trains_the_notebook_model_in_place_and_stores_the_result(ip, capsys):
    ip.run_cell_magic("gputrain", "--epochs 3 --batch-size 20 --lr 0.01 --no-track", CELL)
    result = ip.user_ns["gputrain_result"]
    model = ip.user_ns["model"]
    assert result.steps == 30 and result.batch_size == 20 and len(result.epochs) == 3
    with torch.no_grad():
        accuracy = (model(ip.user_ns["x"][200:]).argmax(1) == ip.user_ns["y"][200:]).float().mean()
    assert accuracy.item() == pytest.approx(result.final_metrics["val_acc"])
    assert "TrainResult(" in capsys.readouterr().out  # no kernel: the summary is printed


def test_options_reach_the_config(ip):
    ip.run_cell_magic("gputrain", "--max-steps 4 --batch-size 8 --grad-accum 2 --clip 1.0 --seed 3 "
                      "--lr-schedule cosine --warmup-steps 1 --log-every 2 --name mine --out res --quiet "
                      "--no-track --precision bf16", CELL)
    config = ip.user_ns["res"].config
    assert (config["max_steps"], config["batch_size"], config["grad_accum"]) == (4, 8, 2)
    assert (config["clip_grad_norm"], config["seed"], config["lr_schedule"]) == (1.0, 3, "cosine")
    assert config["precision"] == "bf16-mixed" and config["name"] == "mine"
    assert ip.user_ns["res"].run_name == "mine"


@pytest.mark.parametrize("option, compile", [("", "auto"), ("--compile", True), ("--compile off", False),
                                             ("--compile reduce-overhead", "reduce-overhead")])
def test_the_compile_option(ip, option, compile):
    from gpunb.notebook.magics import _config
    from IPython.core.magic_arguments import parse_argstring

    magics = ip.find_cell_magic("gputrain").__self__
    assert _config(parse_argstring(magics.gputrain, option)).compile == compile


def test_the_backend_option(ip):
    from gpunb.notebook.magics import _config
    from IPython.core.error import UsageError
    from IPython.core.magic_arguments import parse_argstring

    magics = ip.find_cell_magic("gputrain").__self__
    assert _config(parse_argstring(magics.gputrain, "")).backend == "auto"
    assert _config(parse_argstring(magics.gputrain, "--devices 2 --backend gloo")).backend == "gloo"
    with pytest.raises(UsageError, match="`auto`, `nccl` or `gloo`"):
        ip.run_cell_magic("gputrain", "--backend mpi --quiet --no-track", CELL)


def test_a_bad_compile_value_is_a_usage_error(ip):
    from IPython.core.error import UsageError

    with pytest.raises(UsageError, match="reduce-overhead"):
        ip.run_cell_magic("gputrain", "--compile fast --quiet --no-track", CELL)


def test_other_variable_names(ip):
    cell = CELL.replace("model =", "net =").replace("model.", "net.").replace("train_data =", "data =")
    ip.run_cell_magic("gputrain", "--model net --train-data data --max-steps 2 --quiet --no-track", cell)
    assert ip.user_ns["gputrain_result"].steps == 2


def test_custom_step_optimizer_metrics_and_callbacks_are_collected(ip):
    cell = CELL + """
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
def step(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)
del loss_fn
seen = []
class Spy:
    def on_fit_end(self, state):
        seen.append(state.step)
callbacks = [Spy()]
"""
    ip.run_cell_magic("gputrain", "--max-steps 3 --quiet --no-track", cell)
    assert ip.user_ns["seen"] == [3]
    assert ip.user_ns["optimizer"].state_dict()["param_groups"][0]["lr"] == 0.1


@pytest.mark.parametrize("line,cell,message", [
    ("--precision fp8", CELL, "Unknown precision 'fp8'"),
    ("--batch-size 0", CELL, "--batch-size 64"),
    ("--epochs two", CELL, "invalid int value"),
    ("--no-such-option", CELL, "unrecognized arguments"),
    ("--epoch 3", CELL, "did you mean `--epochs` (for `--epoch`)?"),
    ("--num-epochs 3", CELL, "did you mean `--epochs` (for `--num-epochs`)?"),
    ("--epoch=3", CELL, "did you mean `--epochs`"),
    ("--batch 8", CELL, "unrecognized arguments: --batch 8"),
    ("", "train_data = (x, y)\nnet = nn.Linear(10, 2)", "needs a variable `model`"),
    ("", "model = nn.Linear(10, 2)", "needs a variable `train_data`"),
    ("", "model = 'a string'\ntrain_data = (x, y)", "not a torch.nn.Module"),
    ("", CELL + "optimizer = 3", "not a torch.optim.Optimizer"),
    ("", CELL + "loss_fn = 3", "not callable"),
    ("", CELL + "train_data = 'text'", "cannot batch"),
])
def test_misuse_is_a_usage_error_that_names_the_fix(ip, line, cell, message):
    with pytest.raises(UsageError) as error:
        ip.run_cell_magic("gputrain", line + " --no-track --quiet", cell)
    assert message in str(error.value)


def test_missing_model_lists_what_the_cell_defined(ip):
    with pytest.raises(UsageError) as error:
        ip.run_cell_magic("gputrain", "--no-track", "train_data = (x, y)\nnet = nn.Linear(10, 2)")
    text = str(error.value)
    assert "net (Linear)" in text and "--model <variable>" in text


def test_an_error_in_the_cell_shows_the_users_traceback_and_trains_nothing(ip, capsys):
    ip.run_cell_magic("gputrain", "--no-track", "model = nn.Linear(10, 2)\n1 / 0")
    out = capsys.readouterr()
    assert "ZeroDivisionError" in out.out + out.err
    assert "gpunb/runtime" not in out.out + out.err
    assert "gputrain_result" not in ip.user_ns


def test_find_lr_suggests_a_rate_and_restores_the_model(ip):
    ip.run_cell(CELL)
    before = [p.clone() for p in ip.user_ns["model"].parameters()]
    # The model comes from the earlier cell; the sweep must hand it back untouched.
    finder = ip.run_cell_magic("gputrain", "--find-lr --batch-size 32 --no-track", "loss_fn = nn.CrossEntropyLoss()")
    assert finder.suggestion is not None and 1e-5 < finder.suggestion < 10
    assert "--lr" in repr(finder) and charts_in(finder._repr_html_())
    for a, b in zip(before, ip.user_ns["model"].parameters()):
        assert torch.equal(a, b)


def test_gpustatus_without_a_gpu_says_so_and_shows_the_host(ip):
    status = ip.run_line_magic("gpustatus", "")
    text, page = repr(status), status._repr_html_()
    if not status.snapshot["nvidia"]:
        assert "No NVIDIA GPU" in page and "NVIDIA" in text
    assert "RAM" in text and "RAM" in page
    assert not torch.cuda.is_initialized()  # always true on CPU torch: test_cuda_untouched.py checks it on a GPU


def test_help_is_useful(ip):
    doc = ip.find_cell_magic("gputrain").__doc__
    assert "train_data" in doc and "--batch-size" in doc and "--find-lr" in doc
    assert "  %%gputrain [--epochs EPOCHS]" in doc  # a cell magic's usage line
    assert "NVML" in ip.find_line_magic("gpustatus").__doc__


def test_last_setup_is_kept_for_gpuprofile_by_name(ip):
    from gpunb.notebook import session

    ip.run_cell_magic("gputrain", "--max-steps 1 --quiet --no-track", CELL)
    assert session.LAST_TRAIN.names == {"model": "model", "train_data": "train_data",
                                        "val_data": "val_data", "loss_fn": "loss_fn"}
    assert session.LAST_TRAIN.config.max_steps == 1


def test_the_last_setup_holds_no_reference_to_the_model(ip):
    import gc
    import weakref

    ip.run_cell_magic("gputrain", "--max-steps 1 --quiet --no-track --model net", CELL.replace("model =", "net ="))
    alive = weakref.ref(ip.user_ns["net"])
    ip.run_cell("del net", store_history=False)
    gc.collect()
    assert alive() is None


def test_a_failed_fit_does_not_replace_the_last_setup(ip, monkeypatch):
    from gpunb.notebook import session

    monkeypatch.setattr(session, "LAST_TRAIN", None)
    cell = CELL + "def step(model, batch):\n    raise RuntimeError('user bug')\nloss_fn = None\n"
    with pytest.raises(RuntimeError, match="user bug"):
        ip.run_cell_magic("gputrain", "--max-steps 1 --quiet --no-track", cell)
    assert session.LAST_TRAIN is None


def test_export_writes_a_script_and_trains_nothing(ip, tmp_path, capsys):
    target = tmp_path / "train.py"
    ip.run_cell(SETUP, store_history=True)  # an earlier cell, as the notebook's history holds it
    ip.run_cell_magic("gputrain", f"--export {target} --epochs 2 --batch-size 16", CELL)
    script = target.read_text()
    assert "TrainConfig(" in script and "epochs=2" in script and "batch_size=16" in script
    assert "nn.Sequential" in script and "torch.randn(256, 10" in script  # the earlier cell's data
    compile(script, str(target), "exec")
    assert "torchrun" in capsys.readouterr().out
    assert "gputrain_result" not in ip.user_ns


def test_a_step_left_from_an_earlier_cell_does_not_clash_with_this_cells_loss_fn(ip):
    ip.run_cell("def step(model, batch):\n    return model(batch[0]).sum()")
    ip.run_cell_magic("gputrain", "--max-steps 2 --quiet --no-track", CELL)  # CELL binds loss_fn
    assert ip.user_ns["gputrain_result"].steps == 2


def test_a_model_bound_under_another_name_is_not_silently_ignored(ip):
    ip.run_cell(CELL)  # model and train_data from an earlier cell
    cell = "class Net(nn.Module):\n    def __init__(self):\n        super().__init__()\n        self.fc = nn.Linear(10, 2)\n" \
           "    def forward(self, x):\n        return self.fc(x)\nnet = Net()\ncriterion = nn.CrossEntropyLoss()"
    with pytest.raises(UsageError) as error:
        ip.run_cell_magic("gputrain", "--max-steps 1 --quiet --no-track", cell)
    text = str(error.value)
    assert "defined net (Net) but model is from an earlier cell" in text
    assert "`--model net`" in text and "gputrain_result" not in ip.user_ns


def test_naming_the_model_on_the_line_keeps_the_earlier_one(ip):
    ip.run_cell(CELL)
    ip.run_cell_magic("gputrain", "--model model --max-steps 1 --quiet --no-track", "net = nn.Linear(10, 2)")
    assert ip.user_ns["gputrain_result"].steps == 1


def test_new_data_bound_under_another_name_is_not_silently_ignored(ip):
    ip.run_cell(CELL)
    cell = CELL.replace("train_data = (x[:200], y[:200])", "data = (x[:100], y[:100])")
    with pytest.raises(UsageError) as error:
        ip.run_cell_magic("gputrain", "--max-steps 1 --quiet --no-track", cell)
    assert "defined data (tuple) but train_data is from an earlier cell" in str(error.value)
    assert "`--train-data data`" in str(error.value)
    arrays = CELL.replace("train_data = (x[:200], y[:200])", "arrays = (x[:100].numpy(), y[:100].numpy())")
    with pytest.raises(UsageError, match="defined arrays \\(tuple\\) but train_data is from an earlier cell"):
        ip.run_cell_magic("gputrain", "--max-steps 1 --quiet --no-track", arrays)


def test_submodules_losses_and_data_parts_bound_in_the_cell_are_not_mistaken_for_new_ones(ip):
    ip.run_cell(CELL)
    cell = "head = nn.Linear(2, 2)\nmodel = nn.Sequential(nn.Linear(10, 2), head)\ncriterion = nn.MSELoss()\n" \
           "xv, yv = x[200:], y[200:]\nval_data = (xv, yv)"
    ip.run_cell_magic("gputrain", "--max-steps 1 --quiet --no-track", cell)
    assert ip.user_ns["gputrain_result"].steps == 1


def test_an_error_in_the_users_forward_shows_their_frames_not_gpunbs(ip, capsys):
    cell = "%%gputrain --max-steps 1 --quiet --no-track\n" + CELL + """
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(10, 2)
    def forward(self, x):
        raise ValueError("a bug in forward")
model = Net()
"""
    ip.run_cell(cell)
    out = capsys.readouterr()
    shown = out.out + out.err
    assert "a bug in forward" in shown and "raise ValueError" in shown
    assert "gpunb/runtime" not in shown and "gpunb/notebook" not in shown
    assert "gputrain_result" not in ip.user_ns


def test_a_data_mistake_is_one_usage_error_with_the_fix(ip):
    cell = CELL.replace("train_data = (x[:200], y[:200])", "train_data = (x[:200], y[:200].float())")
    with pytest.raises(UsageError) as error:
        ip.run_cell_magic("gputrain", "--max-steps 1 --quiet --no-track", cell)
    assert "`y.long()`" in str(error.value) and "float32 (" in str(error.value)


def test_an_option_prefix_is_not_taken_for_the_option(ip):
    with pytest.raises(UsageError, match="unrecognized arguments: --max 3"):
        ip.run_cell_magic("gputrain", "--max 3 --quiet --no-track", CELL)
    assert "gputrain_result" not in ip.user_ns


def test_gpuprofile_and_gpustatus_options_are_strict_too(ip):
    with pytest.raises(UsageError, match="did you mean `--steps`"):
        ip.run_line_magic("gpuprofile", "--step 3 x = 1")
    with pytest.raises(UsageError, match="did you mean `--json`"):
        ip.run_line_magic("gpustatus", "--jsn")
    with pytest.raises(UsageError, match="unrecognized arguments: --warm"):
        ip.run_line_magic("gpuprofile", "--warm 1 x = 1")


def test_log_every_is_auto_by_default_and_takes_a_number_or_auto(ip):
    ip.run_cell_magic("gputrain", "--epochs 2 --batch-size 20 --quiet --no-track --out res", CELL)
    assert ip.user_ns["res"].config["log_every"] == 1  # 20 steps in all: every step
    ip.run_cell_magic("gputrain", "--epochs 2 --batch-size 20 --log-every auto --quiet --no-track --out res", CELL)
    assert ip.user_ns["res"].config["log_every"] == 1
    with pytest.raises(UsageError, match="`--log-every 64`"):
        ip.run_cell_magic("gputrain", "--log-every often --no-track", CELL)
