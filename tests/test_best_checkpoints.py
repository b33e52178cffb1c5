"""Best-k checkpoints by a monitored validation metric: which are kept, resume="best",
restore_best, and the up-front errors for a monitor that is never measured."""

import json
import math
import os
import random
import signal
import time
import warnings
from pathlib import Path

import pytest
import torch
from conftest import classification_data, mlp
from IPython.core.error import UsageError
from torch import nn

from gpunb import TrainConfig, Trainer
from gpunb.errors import GpunbError
from gpunb.runtime.state.best_k import BestCheckpoints
from gpunb.runtime.state.checkpoint_files import list_checkpoints, load_checkpoint
from gpunb.runtime.state.resume_target import find_checkpoint
from gpunb.runtime.validation.early_stopping import EarlyStopping
from gpunb.runtime.validation.monitor import Monitor, default_mode


def fit(model=None, epochs=6, val=True, callbacks=(), **options):
    x, y = classification_data(n=200)
    config = dict(batch_size=32, track=False, epochs=epochs, lr=0.01)
    config.update(options)
    model = model or mlp()
    result = Trainer(**config).fit(model, (x, y), (x[:64], y[:64]) if val else None,
                                   loss_fn=nn.CrossEntropyLoss(), callbacks=callbacks)
    return model, result


def best_files(result):
    return sorted(Path(result.best_checkpoint).parent.glob("best-step-*.pt"))


@pytest.mark.parametrize("monitor, k", [("val_loss", 2), ("val_acc", 3)])
def test_the_kept_checkpoints_are_the_k_best_by_the_metric(tmp_path, monitor, k):
    _, result = fit(epochs=8, checkpoint_dir=tmp_path, save_top_k=k, monitor=monitor, keep_last=1)
    values = {row["step"]: row[monitor] for row in result.validations}
    reverse = default_mode(monitor) == "max"
    ranked = sorted(values, key=lambda step: values[step], reverse=reverse)  # stable: older first on ties
    kept = [int(p.name[len("best-step-"):-3]) for p in best_files(result)]
    assert sorted(kept) == sorted(ranked[:k])
    assert result.best_step == ranked[0] and result.best_value == values[ranked[0]]
    assert result.best_monitor == monitor and not result.restored_best
    for path in best_files(result):  # full exact-resume checkpoints, holding their own metric value
        payload = load_checkpoint(path)
        assert payload["step"] == int(path.name[10:-3])
        assert payload["validations"][-1][monitor] == values[payload["step"]]
    index = json.loads((Path(result.best_checkpoint).parent / "best.json").read_text())
    assert [e["step"] for e in index["kept"]] == ranked[:k] and index["mode"] == default_mode(monitor)
    # the last-N checkpoint is still there beside them
    assert [p.name for p in list_checkpoints(tmp_path)] == [f"step-{result.steps:09d}.pt"]


def test_resume_best_loads_the_best_checkpoint(tmp_path):
    _, first = fit(checkpoint_dir=tmp_path, save_top_k=1, monitor="val_acc")
    assert find_checkpoint("best", tmp_path) == Path(first.best_checkpoint)
    model = mlp(seed=7)
    _, resumed = fit(model, epochs=first.best_step // 7 + 1, checkpoint_dir=tmp_path, save_top_k=1,
                     monitor="val_acc", resume="best")
    assert resumed.resumed_from["path"] == first.best_checkpoint
    assert resumed.resumed_from["step"] == first.best_step


def test_restore_best_puts_the_best_weights_into_the_model_and_says_so(tmp_path):
    model, result = fit(epochs=8, checkpoint_dir=tmp_path, save_top_k=1, restore_best=True, lr=0.05)
    assert result.restored_best
    best = load_checkpoint(result.best_checkpoint)["model"]
    for name, value in model.state_dict().items():
        assert torch.equal(value, best[name]), name
    assert f"val_loss={result.best_value:.4g} at step {result.best_step} (restored into the model)" in repr(result)


def test_no_best_checkpoint_after_a_non_finite_loss(tmp_path):
    class Poison:
        def on_step_end(self, state):
            if state.step == 10:
                with torch.no_grad():
                    next(state.model.parameters()).fill_(float("nan"))

    with pytest.warns(RuntimeWarning):
        _, result = fit(epochs=4, checkpoint_dir=tmp_path, save_top_k=3, detect_nan=False, callbacks=[Poison()])
    assert all(p.name <= "best-step-000000007.pt" for p in best_files(result))
    assert math.isnan(result.validations[-1]["val_loss"])


@pytest.mark.parametrize("options, message", [
    (dict(save_top_k=1, monitor="val_f1"), "validation produces only `val_loss`, `val_acc`"),
    (dict(save_top_k=1, val=False), "no validation data"),
])
def test_a_monitor_that_is_never_measured_is_refused_before_training(tmp_path, options, message):
    model = mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(GpunbError, match=message):
        fit(model, checkpoint_dir=tmp_path, **options)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing trained


def test_early_stopping_on_a_metric_never_measured_is_refused_before_training():
    with pytest.raises(GpunbError, match="EarlyStopping monitors 'val_top5'"):
        fit(callbacks=[EarlyStopping(monitor="val_top5")])


@pytest.mark.parametrize("options, message", [
    (dict(save_top_k=2), "pass `checkpoint_dir='checkpoints'` too"),
    (dict(restore_best=True, checkpoint_dir="c"), "pass `save_top_k=1`"),
    (dict(save_top_k=1, checkpoint_dir="c", mode="up"), "mode must be 'min' or 'max'"),
    (dict(resume="best"), "resume='best' needs a checkpoint_dir"),
])
def test_config_errors_name_the_fix(options, message):
    with pytest.raises(GpunbError, match=message):
        TrainConfig(**options)


def test_resume_best_without_a_best_checkpoint_says_so(tmp_path):
    fit(epochs=1, checkpoint_dir=tmp_path)
    with pytest.raises(GpunbError, match="found no best checkpoint"):
        find_checkpoint("best", tmp_path)


def test_mode_follows_the_name_and_early_stopping_shares_it():
    assert [default_mode(n) for n in ("val_loss", "val_acc", "val_f1", "val_auroc", "val_mae")] == \
        ["min", "max", "max", "max", "min"]
    assert EarlyStopping(monitor="val_acc").mode == "max"
    judge = Monitor("val_acc")
    assert judge.better(0.9, 0.8) and not judge.better(float("nan"), 0.1)


def test_gputrain_options_reach_the_config():
    from IPython.core.magic_arguments import parse_argstring

    from gpunb.notebook.magics import GpuMagics, _config

    args = parse_argstring(GpuMagics.gputrain, "--checkpoint-dir c --save-top-k 2 --monitor val_acc --mode max "
                                               "--restore-best --val-every-steps 5")
    config = _config(args)
    assert (config.save_top_k, config.monitor, config.mode, config.restore_best, config.val_every_steps) == \
        (2, "val_acc", "max", True, 5)
    with pytest.raises(UsageError, match="--checkpoint-dir checkpoints"):
        _config(parse_argstring(GpuMagics.gputrain, "--save-top-k 2"))


def test_restore_best_warns_and_keeps_the_last_weights_when_the_file_is_gone(tmp_path):
    class RemoveBest:
        def on_validation_end(self, state, metrics):
            for path in (tmp_path / f"run-{state.checkpoint_run}").glob("best-step-*.pt"):
                path.unlink()

    model = mlp()
    with pytest.warns(RuntimeWarning, match="no longer on disk"):
        _, result = fit(model, epochs=2, checkpoint_dir=tmp_path, save_top_k=1, restore_best=True,
                        callbacks=[RemoveBest()])
    assert not result.restored_best and result.best_step is not None


# --- the index after a kill or a lost file ------------------------------------------------------

def three_best(tmp_path):
    """A run that keeps the 3 best checkpoints by val_loss; returns its directory and best.json's list."""
    _, result = fit(epochs=8, checkpoint_dir=tmp_path, save_top_k=3, keep_last=1)
    run = Path(result.best_checkpoint).parent
    return run, json.loads((run / "best.json").read_text())["kept"]


def test_resume_best_with_the_best_file_deleted_warns_and_takes_the_best_one_left(tmp_path):
    run, kept = three_best(tmp_path)
    (run / kept[0]["file"]).unlink()
    with pytest.warns(RuntimeWarning, match=f"names {kept[0]['file']}, no longer on disk") as caught:
        _, resumed = fit(mlp(seed=3), epochs=8, checkpoint_dir=tmp_path, save_top_k=3, resume="best")
    assert f"the best now is {kept[1]['file']} (val_loss=" in str(caught[0].message)
    assert resumed.resumed_from["path"] == str(run / kept[1]["file"])


def test_a_truncated_index_is_rebuilt_from_the_files_with_a_warning(tmp_path):
    run, kept = three_best(tmp_path)
    index = run / "best.json"
    index.write_text(index.read_text()[:40])
    with pytest.warns(RuntimeWarning, match="best.json cannot be read .*JSONDecodeError.*ranked again"):
        found = find_checkpoint("best", tmp_path)
    assert found == run / kept[0]["file"]


def test_an_index_that_leaves_out_the_newest_best_file_is_rebuilt(tmp_path):
    run, kept = three_best(tmp_path)
    index = run / "best.json"
    stale = json.loads(index.read_text())
    stale["kept"] = kept[1:]  # as if killed after the best file was written, before its index
    index.write_text(json.dumps(stale))
    with pytest.warns(RuntimeWarning, match=f"leaves out {kept[0]['file']}"):
        assert find_checkpoint("best", tmp_path) == run / kept[0]["file"]


def test_the_index_is_written_before_the_dropped_files_are_removed(tmp_path, monkeypatch):
    class Killed(BaseException):
        pass

    run, kept = three_best(tmp_path)
    best = BestCheckpoints(Monitor("val_loss"), 3)
    best.load_state_dict({"monitor": "val_loss", "mode": "min", "k": 3, "kept": kept})
    newer = best.with_entry(999, kept[0]["value"] / 2)

    def killed(path, missing_ok=False):
        raise Killed  # the process dies at its first removal

    monkeypatch.setattr(Path, "unlink", killed)
    with pytest.raises(Killed):
        best.write(run, newer, 999, {"best": {**best.state_dict(), "kept": newer}, "step": 999})
    monkeypatch.undo()
    listed = json.loads((run / "best.json").read_text())["kept"]
    assert listed[0]["file"] == "best-step-000000999.pt" and all((run / e["file"]).exists() for e in listed)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_sigkill_during_best_checkpoint_writes_leaves_an_index_that_finds_the_true_best(tmp_path):
    """20 writers killed at random points: resume="best" always finds the best file on disk, and
    best.json never names a file that is gone."""
    weights = torch.randn(256, 1024)  # 1 MB a file: a write takes long enough to be hit mid-way
    rng = random.Random(0)
    for attempt in range(20):
        run = tmp_path / f"attempt-{attempt:02d}" / "run-x"
        run.mkdir(parents=True)
        ready, written = os.pipe()
        child = os.fork()
        if child == 0:  # the writer, as a run whose every validation is a new best
            try:
                os.close(ready)
                best = BestCheckpoints(Monitor("val_loss"), 2)
                for step in range(1, 10_000):
                    kept = best.with_entry(step, 1.0 / step)
                    best.write(run, kept, step, {"best": {**best.state_dict(), "kept": kept}, "step": step,
                                                 "model": {"w": weights}})
                    if step == 2:
                        os.write(written, b"x")
            finally:
                os._exit(0)
        os.close(written)
        os.read(ready, 1)  # two bests on disk; then it dies anywhere within the next writes
        os.close(ready)
        time.sleep(rng.uniform(0, 0.15))
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)

        newest = max(run.glob("best-step-*.pt"))  # files appear whole (renamed): the newest is the best
        listed = json.loads((run / "best.json").read_text())["kept"]
        assert all((run / e["file"]).exists() for e in listed), (attempt, listed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a kill between a file and its index: rebuilt, with a warning
            assert find_checkpoint("best", run.parent) == newest, (attempt, newest.name, listed)


@pytest.mark.parametrize("elsewhere", [False, True])  # the old run under the same checkpoint_dir, or another
def test_a_run_resumed_into_a_new_directory_ranks_the_old_runs_best_files_without_removing_them(tmp_path,
                                                                                                 elsewhere):
    old = tmp_path / ("other" if elsewhere else "checkpoints") / "run-old"
    new = tmp_path / "checkpoints" / "run-new"
    first = BestCheckpoints(Monitor("val_loss"), 2)
    for step, value in [(1, 0.5), (2, 0.4)]:
        kept = first.with_entry(step, value)
        first.write(old, kept, step, {"best": {**first.state_dict(), "kept": kept}, "step": step})

    resumed = BestCheckpoints(Monitor("val_loss"), 2)
    resumed.load_state_dict(first.state_dict())
    resumed.kept_in(old, new.parent)
    kept = resumed.with_entry(3, 0.45)  # pushes the old step 1 out of the list
    resumed.write(new, kept, 3, {"best": {**resumed.state_dict(), "kept": kept}, "step": 3})

    assert sorted(p.name for p in old.iterdir() if p.suffix == ".pt") == ["best-step-000000001.pt",
                                                                          "best-step-000000002.pt"]
    assert find_checkpoint("best", new.parent) == old / "best-step-000000002.pt"
    (old / "best-step-000000002.pt").unlink()
    with pytest.warns(RuntimeWarning, match="no longer on disk"):
        assert find_checkpoint("best", new.parent) == new / "best-step-000000003.pt"
