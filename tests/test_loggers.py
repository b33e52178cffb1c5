"""Loggers against the real packages: the CSV file, the TensorBoard event file, the MLflow
run in its file store, the W&B offline run; chosen by name, as objects or in the magic."""

import csv
import glob
import json
import os
import struct
import sys

import pytest
import torch
from conftest import classification_data, mlp
from torch import nn

from gpunb import TrainConfig, Trainer
from gpunb.errors import GpunbError
from gpunb.loggers import CSVLogger, MLflowLogger, WandbLogger
from gpunb.runtime.events import FitState

FIT = dict(epochs=2, batch_size=32, log_every=2, track=False, accelerator="cpu")


@pytest.fixture(autouse=True)
def quiet_offline_wandb(monkeypatch, tmp_path):
    """No network, no console capture, no code or git scan; runs write under tmp_path."""
    for name, value in dict(WANDB_SILENT="true", WANDB_DISABLE_CODE="true", WANDB_DISABLE_GIT="true",
                            WANDB_CONSOLE="off", WANDB_DIR=str(tmp_path)).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)


def fit(tmp_path, loggers, callbacks=(), **overrides):
    x, y = classification_data(200)
    options = {**FIT, "log_dir": str(tmp_path / "logs"), "loggers": loggers, **overrides}
    return Trainer(**options).fit(mlp(), (x[:150], y[:150]), (x[150:], y[150:]),
                                  loss_fn=nn.CrossEntropyLoss(), callbacks=callbacks)


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# --- choosing loggers


def test_names_in_one_string_or_a_list_are_made_canonical():
    assert TrainConfig(loggers="tensorboard, csv").loggers == ("tensorboard", "csv")
    assert TrainConfig(loggers=["TB", "w&b", "csv", "csv"]).loggers == ("tensorboard", "wandb", "csv")
    logger = CSVLogger()
    config = TrainConfig(loggers=["mlflow", logger])
    assert config.loggers == ("mlflow", logger)
    assert config.to_dict()["loggers"] == ["mlflow", "CSVLogger"]


@pytest.mark.parametrize("value, message", [
    ("tensorbored", "Unknown logger 'tensorbored'"),
    ([42], "neither a logger name nor a logger"),
])
def test_a_wrong_logger_is_refused_with_the_names_that_work(value, message):
    with pytest.raises(GpunbError, match=message) as error:
        TrainConfig(loggers=value)
    assert "`csv`, `tensorboard`, `mlflow`, `wandb`" in str(error.value)


@pytest.mark.parametrize("module, make", [
    ("mlflow", "mlflow"), ("wandb", "wandb"), ("tensorboard", "tensorboard"),
])
def test_a_missing_package_is_an_error_before_training(monkeypatch, tmp_path, module, make):
    monkeypatch.setitem(sys.modules, module, None)  # `import module` raises ImportError
    model = mlp()
    before = [p.clone() for p in model.parameters()]
    x, y = classification_data(64)
    with pytest.raises(GpunbError, match=rf"`pip install gpunb\[loggers\]` \(or `pip install {module}`\)"):
        Trainer(**FIT, loggers=make).fit(model, (x, y), loss_fn=nn.CrossEntropyLoss())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # not one step taken
    assert not (tmp_path / "gpunb_logs").exists()


def test_a_logger_writes_only_on_rank_0(tmp_path):
    logger = CSVLogger(tmp_path / "rank1")
    state = FitState(config=TrainConfig(), model=None, optimizer=None, device="cpu", rank=1, world_size=2)
    logger.on_fit_start(state)
    logger.on_log(state, {"step": 1, "epoch": 0, "loss": 1.0})
    logger.on_fit_end(state)
    assert not (tmp_path / "rank1").exists()


# --- CSV


def test_csv_rows_grow_a_column_for_each_new_metric_and_match_the_result(tmp_path):
    result = fit(tmp_path, "csv")
    folder = tmp_path / "logs" / "Sequential-1"
    assert result.log_dir == str(folder)
    rows = read_csv(folder / "metrics.csv")
    header = list(rows[0])
    assert header[:3] == ["step", "epoch", "loss"] and {"lr", "samples_per_s", "train_loss", "val_loss",
                                                        "val_acc"} <= set(header)
    log_rows = [r for r in rows if r["loss"]]
    assert [(int(r["step"]), float(r["loss"])) for r in log_rows] == [(h["step"], h["loss"])
                                                                      for h in result.history]
    epoch_rows = [r for r in rows if r["val_acc"]]
    assert [(int(r["step"]), int(r["epoch"]), float(r["val_acc"])) for r in epoch_rows] == [
        (e["step"], e["epoch"], e["val_acc"]) for e in result.epochs]
    assert all(r["val_acc"] == "" for r in log_rows)  # a row leaves the metrics it has not empty
    config = json.loads((folder / "config.json").read_text())
    assert config["batch_size"] == 32 and config["run_name"] == "Sequential" and config["loggers"] == ["csv"]
    final = json.loads((folder / "result.json").read_text())
    assert final["status"] == "completed" and final["steps"] == result.steps
    assert final["val_acc"] == pytest.approx(result.final_metrics["val_acc"])


def test_each_fit_gets_its_own_numbered_directory_and_a_logger_object_its_given_one(tmp_path):
    fit(tmp_path, "csv", name="exp")
    fit(tmp_path, "csv", name="exp")
    assert sorted(os.listdir(tmp_path / "logs")) == ["exp-1", "exp-2"]
    result = fit(tmp_path, [CSVLogger(tmp_path / "mine")])
    assert read_csv(tmp_path / "mine" / "metrics.csv") and result.log_dir is None


def test_the_log_root_defaults_under_checkpoint_dir_then_gpunb_logs(tmp_path):
    x, y = classification_data(64)
    Trainer(**FIT, loggers="csv", checkpoint_dir=str(tmp_path / "ckpt")).fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss())
    assert (tmp_path / "ckpt" / "logs" / "Sequential-1" / "metrics.csv").exists()
    Trainer(**FIT, loggers="csv").fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss())
    assert (tmp_path / "gpunb_logs" / "Sequential-1" / "metrics.csv").exists()  # cwd is tmp_path


class Boom:
    def __init__(self, error, at=3):
        self.error, self.at = error, at

    def on_step_end(self, state):
        if state.step == self.at:
            raise self.error


def test_a_failed_run_is_recorded_as_failed(tmp_path):
    with pytest.raises(ValueError):
        fit(tmp_path, "csv", callbacks=[Boom(ValueError("boom"))])
    final = json.loads((tmp_path / "logs" / "Sequential-1" / "result.json").read_text())
    assert final == {"status": "failed"}


# --- TensorBoard


def event_file(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


def test_tensorboard_has_every_metric_by_step_the_config_and_the_final_hparams(tmp_path):
    result = fit(tmp_path, "tensorboard")
    events = event_file(result.log_dir)
    tags = events.Tags()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [
        (h["step"], pytest.approx(h["loss"])) for h in result.history]
    assert [(e.step, e.value) for e in events.Scalars("val_acc")] == [
        (row["step"], pytest.approx(row["val_acc"])) for row in result.epochs]
    assert {"lr", "samples_per_s", "train_loss", "val_loss", "epoch"} <= set(tags["scalars"])
    assert events.Scalars("hparam/val_acc")[0].value == pytest.approx(result.final_metrics["val_acc"])
    config_text = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "batch_size: 32" in config_text
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    hparams = events.PluginTagToContent("hparams")
    experiment = HParamsPluginData.FromString(hparams["_hparams_/experiment"]).experiment
    assert {"hparam/val_acc", "hparam/train_loss"} <= {m.name.tag for m in experiment.metric_infos}
    session = HParamsPluginData.FromString(hparams["_hparams_/session_start_info"]).session_start_info
    assert session.hparams["batch_size"].number_value == 32
    assert not glob.glob(os.path.join(result.log_dir, "plugins", "profile", "*"))  # no profile taken


def test_tensorboard_gets_the_profile_trace_in_the_profiler_plugins_layout(tmp_path):
    from gpunb.profiling import ProfilerCallback

    profiler = ProfilerCallback(steps=2, warmup=0, stop=False)
    result = fit(tmp_path, ["tensorboard"], callbacks=[profiler])
    traces = glob.glob(os.path.join(result.log_dir, "plugins", "profile", "*", "*.pt.trace.json"))
    assert len(traces) == 1
    assert "traceEvents" in json.loads(open(traces[0]).read())
    assert profiler.result().steps == 2  # the profiler's own temporary trace is still there for it


def test_tensorboard_records_a_failed_run_and_closes_its_file(tmp_path):
    with pytest.raises(ValueError):
        fit(tmp_path, "tensorboard", callbacks=[Boom(ValueError("boom"))])
    events = event_file(tmp_path / "logs" / "Sequential-1")
    assert events.Tensors("status/text_summary")[0].tensor_proto.string_val[0] == b"failed"
    assert [e.step for e in events.Scalars("loss")] == [2]  # what was logged before the error stays


# --- MLflow


def mlflow_run(tmp_path):
    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3's file store, read here
    client = MlflowClient(tracking_uri=(tmp_path / "logs" / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("gpunb")
    runs = client.search_runs([experiment.experiment_id])
    return client, runs


def test_mlflow_run_has_params_metrics_by_step_and_final_metrics(tmp_path, monkeypatch):
    result = fit(tmp_path, "mlflow")
    assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ  # only while gpunb opened the store
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client, runs = mlflow_run(tmp_path)
    [run] = runs
    assert run.info.status == "FINISHED" and run.info.run_name == "Sequential"
    assert run.data.params["batch_size"] == "32" and run.data.params["lr_schedule"] == "none"
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == [(h["step"], pytest.approx(h["loss"]))
                                                          for h in result.history]
    val = client.get_metric_history(run.info.run_id, "val_acc")
    assert sorted(m.step for m in val) == [row["step"] for row in result.epochs]
    assert run.data.metrics["final/val_acc"] == pytest.approx(result.final_metrics["val_acc"])
    assert run.data.metrics["final/steps"] == result.steps


@pytest.mark.parametrize("error, status", [(ValueError("boom"), "FAILED"), (KeyboardInterrupt(), "KILLED")])
def test_mlflow_run_ends_failed_or_killed(tmp_path, monkeypatch, error, status):
    if isinstance(error, KeyboardInterrupt):
        result = fit(tmp_path, "mlflow", callbacks=[Boom(error)])  # the loop stops cleanly
        assert result.interrupted
    else:
        with pytest.raises(ValueError):
            fit(tmp_path, "mlflow", callbacks=[Boom(error)])
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    _client, [run] = mlflow_run(tmp_path)
    assert run.info.status == status


def test_a_logger_that_cannot_start_raises_its_own_error_and_is_not_finished(tmp_path):
    from mlflow.exceptions import MlflowException

    with pytest.raises(MlflowException):
        fit(tmp_path, [MLflowLogger(tracking_uri="nosuchscheme://here")])


# --- Weights & Biases


def wandb_records(folder, teardown=True):
    """The records of an offline run's .wandb file (LevelDB log blocks of protobuf Records)."""
    import wandb
    from wandb.proto import wandb_internal_pb2 as pb

    if teardown:
        wandb.teardown()  # the service process writes the file; it has flushed it once it has exited
    [path] = glob.glob(os.path.join(folder, "wandb", "offline-run-*", "*.wandb"))
    data, position, pending, block = open(path, "rb").read(), 7, b"", 32768
    assert data[:4] == b":W&B"
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:  # a block's tail too short for a header is padding
            position += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if kind == 0:
            position += left
            continue
        chunk = data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # full, or the last part of a split record
            record = pb.Record()
            record.ParseFromString(pending + chunk)
            pending = b""
            yield record
        else:
            pending += chunk


def items(update):
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in update}


def test_wandb_offline_run_has_config_history_summary_and_exit_code(tmp_path):
    result = fit(tmp_path, "wandb")
    records = list(wandb_records(tmp_path / "logs"))
    [run] = [r.run for r in records if r.HasField("run")]
    config = items(run.config.update)
    assert run.display_name == "Sequential" and run.project == "gpunb"
    assert config["batch_size"] == 32 and config["loggers"] == '["wandb"]'
    history = [items(r.history.item) for r in records if r.HasField("history")]
    losses = [(row["_step"], row["loss"]) for row in history if "loss" in row]
    assert losses == [(h["step"], pytest.approx(h["loss"])) for h in result.history]
    assert [row["val_acc"] for row in history if "val_acc" in row] == pytest.approx(
        [row["val_acc"] for row in result.epochs])
    summary = {}
    for record in records:
        if record.HasField("summary"):
            summary.update(items(record.summary.update))
    assert summary["status"] == "completed" and summary["steps"] == result.steps
    assert summary["val_acc"] == pytest.approx(result.final_metrics["val_acc"])
    [exit_record] = [r.exit for r in records if r.HasField("exit")]
    assert exit_record.exit_code == 0


def test_wandb_mode_from_the_environment_wins_over_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    fit(tmp_path, [WandbLogger()])
    assert not glob.glob(str(tmp_path / "logs" / "wandb" / "offline-run-*"))


def test_wandb_failed_run_finishes_with_a_nonzero_exit_code(tmp_path):
    with pytest.raises(ValueError):
        fit(tmp_path, "wandb", callbacks=[Boom(ValueError("boom"))])
    [exit_record] = [r.exit for r in wandb_records(tmp_path / "logs") if r.HasField("exit")]
    assert exit_record.exit_code == 1


# --- the magic and several processes


def test_gputrain_log_option_writes_csv_and_tensorboard(tmp_path):
    import IPython
    from IPython.testing.globalipapp import get_ipython

    ip = get_ipython() or IPython.get_ipython()
    ip.run_line_magic("load_ext", "gpunb")
    ip.user_ns.clear()
    cell = ("from torch import nn\nimport torch\ng = torch.Generator().manual_seed(0)\n"
            "x = torch.randn(64, 10, generator=g)\nmodel = nn.Linear(10, 2)\n"
            "train_data = (x, (x[:, 0] > 0).long())\nloss_fn = nn.CrossEntropyLoss()\n")
    ip.run_cell_magic("gputrain", f"--max-steps 2 --quiet --no-track --log tensorboard,csv --log-dir {tmp_path}/tb",
                      cell)
    folder = ip.user_ns["gputrain_result"].log_dir
    assert folder == f"{tmp_path}/tb/Linear-1"
    assert read_csv(os.path.join(folder, "metrics.csv")) and event_file(folder).Scalars("loss")
    from IPython.core.error import UsageError

    with pytest.raises(UsageError, match="Unknown logger 'tensorbord'"):
        ip.run_cell_magic("gputrain", "--max-steps 2 --log tensorbord", cell)
    ip.user_ns.clear()


def test_two_processes_write_one_log_from_the_notebooks_side(tmp_path):
    result = fit(tmp_path, "csv", devices=2)
    assert os.listdir(tmp_path / "logs") == ["Sequential-1"]
    rows = read_csv(tmp_path / "logs" / "Sequential-1" / "metrics.csv")
    assert [int(r["step"]) for r in rows if r["loss"]] == [h["step"] for h in result.history]
    config = json.loads((tmp_path / "logs" / "Sequential-1" / "config.json").read_text())
    assert config["world_size"] == 2 and config["loggers"] == ["csv"]
