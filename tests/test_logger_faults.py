"""Loggers are observers: a full disk or a failed write warns once, switches that logger off and
training goes on; a directory a logger cannot write in is named before any work; a killed
process keeps every row up to its last log interval."""

import errno
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from conftest import classification_data, mlp
from test_loggers import event_file, quiet_offline_wandb, read_csv, wandb_records  # noqa: F401 (a fixture)
from torch import nn

from gpunb import Trainer
from gpunb.errors import GpunbError
from gpunb.loggers import CSVLogger

ROOT = Path(__file__).resolve().parent.parent
FIT = dict(epochs=4, batch_size=32, log_every=2, track=False, accelerator="cpu")  # 5 steps an epoch


def fit_under_fault(tmp_path, loggers, **overrides):
    """A fit whose loggers meet a fault; returns the result, the model's starting weights, the warnings."""
    x, y = classification_data(200)
    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = Trainer(**{**FIT, "log_dir": str(tmp_path / "logs"), "loggers": loggers, **overrides}).fit(
            model, (x[:150], y[:150]), (x[150:], y[150:]), loss_fn=nn.CrossEntropyLoss())
    return result, model, before, [w for w in caught if issubclass(w.category, RuntimeWarning)]


def assert_trained_past_one_warning(result, model, before, caught, name):
    """Training went on to its end with its weights, and the logger warned once, with the fix."""
    assert result.steps == 20 and result.stop_reason is None
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    failed = [str(w.message) for w in caught if f"{name} failed at step" in str(w.message)]
    assert len(failed) == 1, [str(w.message) for w in caught]
    assert "is switched off: the disk is full" in failed[0] and "Training goes on" in failed[0]
    assert "HINT: free space there, or pass a `log_dir`" in failed[0]
    return failed[0]


def no_space(what="No space left on device"):
    return OSError(errno.ENOSPC, what)


# --- a full disk


def test_a_full_disk_under_csv_keeps_the_rows_written_and_training_goes_on(tmp_path, monkeypatch):
    """The epoch row adds columns, so the file is written anew: the disk fills during that write."""
    import gpunb.loggers.csv_logger as csv_logger

    class FullDisk:
        def __init__(self, file):
            self.file = file

        def write(self, text):
            raise no_space()

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

    rewrites = []

    def open_on_a_full_disk(path, mode="r", **kwargs):
        file = open(path, mode, **kwargs)
        if Path(path).name.startswith(("metrics.csv", ".metrics.csv")) and "w" in mode:
            rewrites.append(path)
            if len(rewrites) > 1:  # the first creates the file; the wider header's rewrite fails
                return FullDisk(file)
        return file

    monkeypatch.setattr(csv_logger, "open", open_on_a_full_disk, raising=False)
    result, model, before, caught = fit_under_fault(tmp_path, "csv")
    message = assert_trained_past_one_warning(result, model, before, caught, "CSVLogger")
    folder = tmp_path / "logs" / "Sequential-1"
    assert "CSVLogger failed at step 5" in message and str(folder) in message
    rows = read_csv(folder / "metrics.csv")  # the rows before the failed rewrite, whole
    assert [int(r["step"]) for r in rows] == [2, 4, 5]
    assert [float(r["loss"]) for r in rows] == pytest.approx([h["loss"] for h in result.history[:3]])
    assert not list(folder.glob(".metrics.csv*"))  # no half-written file left


def test_a_full_disk_during_an_append_leaves_no_half_row(tmp_path, monkeypatch):
    import gpunb.loggers.csv_logger as csv_logger

    class HalfWritten:
        def __init__(self, file):
            self.file = file

        def write(self, text):
            self.file.write(text[:len(text) // 2])
            self.file.flush()
            raise no_space()

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

    appends = []

    def open_on_a_full_disk(path, mode="r", **kwargs):
        file = open(path, mode, **kwargs)
        if Path(path).name == "metrics.csv" and "a" in mode:
            appends.append(path)
            if len(appends) > 2:
                return HalfWritten(file)
        return file

    monkeypatch.setattr(csv_logger, "open", open_on_a_full_disk, raising=False)
    result, model, before, caught = fit_under_fault(tmp_path, "csv")
    assert_trained_past_one_warning(result, model, before, caught, "CSVLogger")
    text = (tmp_path / "logs" / "Sequential-1" / "metrics.csv").read_text()
    assert text.endswith("\n")
    rows = read_csv(tmp_path / "logs" / "Sequential-1" / "metrics.csv")
    assert all(r["lr"] for r in rows if r["loss"]) and len(rows) >= 3  # every row whole


def test_a_full_disk_under_tensorboard_keeps_the_events_written_and_training_goes_on(tmp_path, monkeypatch):
    from tensorboard.summary.writer.record_writer import RecordWriter

    written = []
    real_write = RecordWriter.write

    def write_until_full(self, data):
        written.append(data)
        if len(written) > 12:  # the file's version, the config, then a few rows of scalars
            raise no_space()
        real_write(self, data)

    monkeypatch.setattr(RecordWriter, "write", write_until_full)
    result, model, before, caught = fit_under_fault(tmp_path, "tensorboard")
    assert_trained_past_one_warning(result, model, before, caught, "TensorBoardLogger")
    monkeypatch.setattr(RecordWriter, "write", real_write)
    steps = [event.step for event in event_file(tmp_path / "logs" / "Sequential-1").Scalars("loss")]
    assert steps and steps == [h["step"] for h in result.history[:len(steps)]]


def test_a_full_disk_under_mlflow_keeps_the_metrics_written_and_training_goes_on(tmp_path, monkeypatch):
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    batches = []
    real_log_batch = MlflowClient.log_batch

    def log_batch_until_full(self, run_id, metrics=(), **kwargs):
        if metrics:
            batches.append(metrics)
            if len(batches) > 3:
                try:
                    raise no_space()
                except OSError as error:  # as the file store reports it
                    raise MlflowException(f"Failed to write metrics: {error}") from error
        return real_log_batch(self, run_id, metrics=metrics, **kwargs)

    monkeypatch.setattr(MlflowClient, "log_batch", log_batch_until_full)
    result, model, before, caught = fit_under_fault(tmp_path, "mlflow")
    assert_trained_past_one_warning(result, model, before, caught, "MLflowLogger")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = real_client(tmp_path)
    [run] = client.search_runs([client.get_experiment_by_name("gpunb").experiment_id])
    assert run.info.status == "FAILED"  # ended, not left RUNNING
    steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss"))
    assert steps == [h["step"] for h in result.history[:len(steps)]] and len(steps) == 3


def real_client(tmp_path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=(tmp_path / "logs" / "mlruns").as_uri())


def test_a_full_disk_under_wandb_is_seen_and_the_run_ends(tmp_path, monkeypatch):
    """W&B's service process writes the file and does not report a failed write: gpunb looks
    at the disk at each row."""
    import gpunb.loggers.wandb_logger as wandb_logger

    looks = []
    real_usage = wandb_logger.shutil.disk_usage

    def filling(path):
        looks.append(path)
        usage = real_usage(path)
        return usage._replace(free=0) if len(looks) > 3 else usage

    monkeypatch.setattr(wandb_logger.shutil, "disk_usage", filling)
    result, model, before, caught = fit_under_fault(tmp_path, "wandb")
    message = assert_trained_past_one_warning(result, model, before, caught, "WandbLogger")
    assert "does not report the writes it cannot make" in message
    records = list(wandb_records(tmp_path / "logs"))
    steps = [r.history.step.num for r in records if r.HasField("history")]
    assert steps == [h["step"] for h in result.history[:3]]
    [exit_record] = [r.exit for r in records if r.HasField("exit")]
    assert exit_record.exit_code == 1


def test_a_logger_whose_disk_is_full_at_the_start_is_switched_off_before_the_first_step(tmp_path, monkeypatch):
    import gpunb.loggers.csv_logger as csv_logger

    def full(path, value):
        raise no_space(f"No space left on device: '{path}'")

    monkeypatch.setattr(csv_logger, "_write_json", full)
    result, model, before, caught = fit_under_fault(tmp_path, "csv")
    message = assert_trained_past_one_warning(result, model, before, caught, "CSVLogger")
    assert "CSVLogger failed at step 0" in message
    assert not (tmp_path / "logs" / "Sequential-1" / "metrics.csv").exists()  # off: not a row written


def test_a_failed_write_of_any_kind_warns_with_the_logger_and_the_error(tmp_path):
    class Broken(CSVLogger):
        def write(self, step, metrics, state):
            if step >= 6:
                raise ConnectionError("the tracking server went away")
            super().write(step, metrics, state)

    result, model, before, caught = fit_under_fault(tmp_path, [Broken(tmp_path / "broken")])
    [message] = [str(w.message) for w in caught if "Broken failed" in str(w.message)]
    assert "Broken failed at step 6 and is switched off: ConnectionError: the tracking server went away" in message
    assert "HINT: check that" in message and result.steps == 20
    assert [int(r["step"]) for r in read_csv(tmp_path / "broken" / "metrics.csv")] == [2, 4, 5, 5]  # 5: epoch row


# --- a directory no logger can write in


@pytest.mark.parametrize("loggers", ["csv", "tensorboard", "mlflow", "wandb"])
def test_a_log_dir_that_cannot_be_written_is_named_before_any_work(tmp_path, loggers):
    (tmp_path / "a-file").write_text("not a directory")
    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    heard = []

    class Started:
        def on_fit_start(self, state):
            heard.append(state.step)

    x, y = classification_data(64)
    with pytest.raises(GpunbError, match=r"cannot write its logs to .*a-file.*NotADirectoryError(.|\n)*"
                                         r"HINT: pass a `log_dir` you can write to"):
        Trainer(**FIT, loggers=loggers, log_dir=str(tmp_path / "a-file" / "logs")).fit(
            model, (x, y), loss_fn=nn.CrossEntropyLoss(), callbacks=[Started()])
    assert heard == [] and all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_logger_objects_own_directory_is_checked_too(tmp_path):
    (tmp_path / "a-file").write_text("not a directory")
    x, y = classification_data(64)
    with pytest.raises(GpunbError, match="CSVLogger cannot write its logs to"):
        Trainer(**FIT, loggers=[CSVLogger(tmp_path / "a-file" / "mine")]).fit(mlp(), (x, y),
                                                                             loss_fn=nn.CrossEntropyLoss())


# --- a killed process


KILLED_AFTER_STEP_15 = """
    import os, signal, sys, time
    import torch
    from torch import nn
    from gpunb import Trainer

    class KillAt:
        def on_step_end(self, state):
            if state.step == 17:  # after the rows of steps 5, 10 and 15 were written
                time.sleep(float(sys.argv[2]))
                os.kill(os.getpid(), signal.SIGKILL)

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(640, 10, generator=g), torch.randint(0, 3, (640,), generator=g)  # 40 steps an epoch
    model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3))
    Trainer(epochs=1, batch_size=16, log_every=5, track=False, accelerator="cpu", log_dir=sys.argv[1],
            loggers=sys.argv[3].split(",")).fit(model, (x, y), loss_fn=nn.CrossEntropyLoss(),
                                                callbacks=[KillAt()])
"""


def train_and_kill(tmp_path, loggers, wait_s=0.0):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(KILLED_AFTER_STEP_15))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "logs"), str(wait_s), loggers],
                          env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == -9, done.stderr[-3000:]


def test_a_killed_run_keeps_every_csv_and_tensorboard_row_up_to_its_last_interval(tmp_path):
    train_and_kill(tmp_path, "csv,tensorboard")
    folder = tmp_path / "logs" / "Sequential-1"
    assert [int(r["step"]) for r in read_csv(folder / "metrics.csv")] == [5, 10, 15]
    assert [event.step for event in event_file(folder).Scalars("loss")] == [5, 10, 15]


def test_a_killed_run_keeps_the_wandb_rows_its_service_flushed(tmp_path):
    """W&B's own process writes the run file on a timer (gpunb sets it to 1 s); a kill 3 s after
    the last row keeps every row."""
    train_and_kill(tmp_path, "wandb", wait_s=3.0)
    steps = [r.history.step.num for r in wandb_records(tmp_path / "logs", teardown=False) if r.HasField("history")]
    assert steps == [5, 10, 15]


def test_wandb_writing_somewhere_else_than_asked_is_said(tmp_path, monkeypatch):
    """W&B falls back to the temp directory when it judges its `dir` unwritable (os.access: ACLs,
    root squash); with WANDB_SILENT its own note is hidden, so gpunb names where the run went."""
    import tempfile

    asked = tmp_path / "logs"
    (tmp_path / "temp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "temp"))
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: Path(path) != asked and real_access(path, mode, **kw))
    result, _model, _before, caught = fit_under_fault(tmp_path, "wandb")
    [message] = [str(w.message) for w in caught if "WandbLogger: W&B writes" in str(w.message)]
    assert str(tmp_path / "temp") in message and f"not in {asked} as asked" in message
    assert result.steps == 20


def test_a_logger_that_keeps_a_path_under_the_name_directory_is_not_called(tmp_path):
    from gpunb.config import TrainConfig
    from gpunb.loggers import CSVLogger, check_destinations

    class Mine(CSVLogger):
        def __init__(self):
            super().__init__(log_dir=tmp_path)
            self.directory = tmp_path / "mine"  # a path, not the method

    check_destinations([Mine()], TrainConfig())  # no TypeError: a path is no method to call
