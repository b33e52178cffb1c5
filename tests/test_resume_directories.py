"""Where a resumed run writes: its own newest checkpoints are kept, the future it abandons is kept,
a live run's directory is never adopted, and a NaN after a resume restores weights that exist."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from conftest import classification_data, mlp
from test_checkpoint_safety import NanFrom
from torch import nn

from gpunb import Trainer
from gpunb.errors import GpunbError
from gpunb.runtime.state.checkpoint_files import list_checkpoints, load_checkpoint

REPO = Path(__file__).resolve().parent.parent


def fit(tmp_path, model=None, loss_fn=None, val=False, callbacks=(), **options):
    x, y = classification_data(n=200)
    config = dict(batch_size=16, track=False, lr=0.01, checkpoint_dir=tmp_path, log_every=50)
    config.update(options)
    return Trainer(**config).fit(model or mlp(), (x, y), (x[:64], y[:64]) if val else None,
                                 loss_fn=loss_fn or nn.CrossEntropyLoss(), callbacks=callbacks)


def files(directory):
    return {p.name: p.stat().st_mtime_ns for p in Path(directory).iterdir() if p.suffix == ".pt"}


# --- a resume from an older checkpoint is a new run directory -----------------------------------

def test_resuming_an_older_checkpoint_keeps_the_new_checkpoints_and_the_abandoned_ones(tmp_path, capsys):
    first = fit(tmp_path, epochs=8, keep_last=8)  # steps 13, 26, ... 104
    old_dir = Path(first.checkpoint_path).parent
    before = files(old_dir)
    capsys.readouterr()

    resumed = fit(tmp_path, mlp(seed=3), epochs=5, keep_last=1, resume=str(old_dir / "step-000000052.pt"))

    assert resumed.steps == 65 and os.path.exists(resumed.checkpoint_path)
    new_dir = Path(resumed.checkpoint_path).parent
    assert new_dir != old_dir and new_dir.parent == tmp_path
    assert files(old_dir) == before  # not one file of the old run removed or rewritten
    assert [p.name for p in list_checkpoints(new_dir)] == ["step-000000065.pt"]
    note = resumed.resumed_from["note"]
    assert "4 checkpoint(s) saved after step 52 (up to step-000000104.pt); they are kept" in note
    assert new_dir.name in note and note in capsys.readouterr().out
    assert resumed.resumed_from["directory"] == str(new_dir)
    origin = load_checkpoint(resumed.checkpoint_path)["origin"]
    assert origin == {"run": old_dir.name[4:], "path": str(old_dir / "step-000000052.pt"), "step": 52}

    later = fit(tmp_path, mlp(seed=4), epochs=6, keep_last=1, resume="last")
    assert later.resumed_from["path"] == resumed.checkpoint_path  # the newest run, not old step 104
    assert Path(later.checkpoint_path).parent == new_dir  # and it goes on in that directory
    assert load_checkpoint(later.checkpoint_path)["origin"] == origin  # which still says where it came from
    assert files(old_dir) == before


def test_resume_best_keeps_its_last_checkpoint_and_finds_the_best_in_the_old_run(tmp_path):
    # val_acc reaches 1.0 early and ties keep the older checkpoint: the best is an early step
    best_options = dict(batch_size=32, lr=0.05, save_top_k=1, monitor="val_acc", val=True, keep_last=1)
    first = fit(tmp_path, epochs=8, **best_options)
    assert first.best_step < first.steps - 14
    old_dir = Path(first.checkpoint_path).parent

    resumed = fit(tmp_path, mlp(seed=3), epochs=6, resume="best", restore_best=True, **best_options)

    assert resumed.resumed_from["step"] == first.best_step
    assert os.path.exists(resumed.checkpoint_path) and Path(resumed.checkpoint_path).parent != old_dir
    assert resumed.steps == 42 and resumed.checkpoint_path.endswith("step-000000042.pt")
    assert os.path.exists(first.checkpoint_path)  # the abandoned future (step 56) is kept
    assert resumed.best_checkpoint == first.best_checkpoint and resumed.restored_best
    later = fit(tmp_path, mlp(seed=4), epochs=7, resume="last", **best_options)
    assert later.resumed_from["step"] == 42


def test_resuming_the_newest_checkpoint_goes_on_in_the_same_directory(tmp_path):
    first = fit(tmp_path, epochs=2, keep_last=2)
    resumed = fit(tmp_path, mlp(seed=3), epochs=3, keep_last=2, resume=first.checkpoint_path)
    assert Path(resumed.checkpoint_path).parent == Path(first.checkpoint_path).parent
    assert "note" not in resumed.resumed_from and resumed.resumed_from["origin"] is None
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000000026.pt", "step-000000039.pt"]


def test_resuming_into_another_checkpoint_dir_writes_there_and_leaves_the_source_alone(tmp_path):
    first = fit(tmp_path / "a", epochs=1)
    before = files(Path(first.checkpoint_path).parent)
    resumed = fit(tmp_path / "b", mlp(seed=3), epochs=2, resume=first.checkpoint_path)
    assert Path(resumed.checkpoint_path).parent.parent == tmp_path / "b"
    assert "is not a run directory of checkpoint_dir=" in resumed.resumed_from["note"]
    assert files(Path(first.checkpoint_path).parent) == before


# --- a NaN after a resume -------------------------------------------------------------------

def finite(model):
    return all(torch.isfinite(p).all() for p in model.parameters())


def test_a_nan_after_resuming_an_older_checkpoint_restores_the_resumed_runs_last_good_weights(tmp_path):
    first = fit(tmp_path, epochs=8, keep_last=20, checkpoint_every=10)
    old = Path(first.checkpoint_path).parent / "step-000000030.pt"
    model = mlp(seed=3)
    with pytest.raises(GpunbError) as error:
        fit(tmp_path, model, loss_fn=NanFrom(15), epochs=8, keep_last=1, checkpoint_every=10, resume=str(old))
    message = str(error.value)
    assert "became nan at step 45" in message and "last good checkpoint, step 40" in message
    assert "corrupt" not in message
    saved = [p for p in list_checkpoints(tmp_path) if p.name == "step-000000040.pt" and p.parent != old.parent]
    assert len(saved) == 1 and f"({saved[0]})" in message  # the resumed run's own, kept
    good = load_checkpoint(saved[0])["model"]
    for name, value in model.state_dict().items():
        assert torch.equal(value, good[name]), name


def test_a_nan_with_the_newest_checkpoint_gone_restores_the_one_before_and_says_so(tmp_path):
    class RemoveNewest:
        def on_checkpoint(self, state, path):
            if state.step == 20:
                os.unlink(path)

    model = mlp()
    with pytest.raises(GpunbError) as error:
        fit(tmp_path, model, loss_fn=NanFrom(25), epochs=3, keep_last=5, checkpoint_every=10,
            callbacks=[RemoveNewest()])
    message = str(error.value)
    assert "last good checkpoint, step 10" in message
    assert "step-000000020.pt could not be read, so an older one was taken" in message
    assert finite(model)


def test_a_nan_before_the_first_checkpoint_says_how_to_save_sooner(tmp_path):
    with pytest.raises(GpunbError) as error:
        fit(tmp_path, loss_fn=NanFrom(7), epochs=3, checkpoint_every=10)
    message = str(error.value)
    assert "at step 7 " in message and "written every 10 steps" in message
    assert "`checkpoint_every=N`" in message and "set `checkpoint_dir`" not in message


# --- a live run's directory -----------------------------------------------------------------

LIVE_RUN = textwrap.dedent("""
    import sys, time
    from torch import nn
    from conftest import classification_data, mlp
    from gpunb import Trainer

    class Slow:
        def on_checkpoint(self, state, path):
            if state.step == 2:
                print("checkpoint:", path, flush=True)

        def on_step_end(self, state):
            time.sleep(0.05)

    x, y = classification_data(n=200)
    Trainer(batch_size=16, track=False, max_steps=2400, checkpoint_dir=sys.argv[1], checkpoint_every=1,
            keep_last=2400, name="notebook-B").fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss(), callbacks=[Slow()])
""")


def start_live_run(directory):
    """A process that trains slowly (2 minutes at most) in `directory`; returns it and the path of its
    second checkpoint, once written."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests"),
                                                       os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, "-c", LIVE_RUN, str(directory)], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True, env=env)
    found = []

    def read():
        for line in child.stdout:  # ends when the child does
            if line.startswith("checkpoint: "):
                found.append(Path(line[len("checkpoint: "):].strip()))
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=90)
    if not found:
        child.kill()
        child.wait()
        pytest.fail("the live run did not write a checkpoint within 90 s")
    return child, found[0]


class StopAfter:
    """Stops a fit after `steps` of its own steps (it then writes a checkpoint)."""

    def __init__(self, steps):
        self.steps, self.start = steps, None

    def on_fit_start(self, state):
        self.start = state.step

    def on_step_end(self, state):
        if state.step >= self.start + self.steps:
            state.request_stop("test stop")


def test_resume_last_refuses_a_live_runs_directory_and_adopts_it_once_that_run_is_dead(tmp_path):
    child, live_checkpoint = start_live_run(tmp_path)
    live_dir = live_checkpoint.parent
    try:
        model = mlp(seed=3)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(GpunbError, match="still training") as error:
            fit(tmp_path, model, max_steps=2400, checkpoint_every=1, keep_last=2, resume="last",
                callbacks=[StopAfter(3)])  # (bounded, should it not be refused)
        message = str(error.value)
        assert "run 'notebook-B'" in message and f"process {child.pid}" in message and str(live_dir) in message
        assert "HINT" in message and "`checkpoint_dir`" in message
        for name, value in model.state_dict().items():  # refused before anything loaded
            assert torch.equal(value, before[name]), name

        # A path given on purpose: a new directory, and the live run is left alone.
        forked = fit(tmp_path / "other", mlp(seed=4), max_steps=4, resume=str(live_checkpoint))
        assert "still trains in" in forked.resumed_from["note"] and "notebook-B" in forked.resumed_from["note"]
        assert Path(forked.checkpoint_path).parent.parent == tmp_path / "other"
        assert child.poll() is None  # still training
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)

    # Dead (the lock went with the process): its directory may now be taken over.
    resumed = fit(tmp_path, mlp(seed=5), max_steps=2400, checkpoint_every=1, keep_last=2, resume="last",
                  callbacks=[StopAfter(3)])
    assert Path(resumed.checkpoint_path).parent == live_dir
    assert "note" not in resumed.resumed_from


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_does_not_keep_a_released_run_directory_locked(tmp_path):
    from gpunb.runtime.state.run_lock import RunLock

    lock = RunLock.acquire(tmp_path, {"run_name": "mine"})
    assert RunLock.acquire(tmp_path, {}) is None  # held (even against this process)
    started, running = os.pipe()
    child = os.fork()  # as a DataLoader worker is forked while the run trains
    if child == 0:
        import time

        os.write(running, b"x")  # (the fork hooks have run by now)
        time.sleep(30)
        os._exit(0)
    os.read(started, 1)
    try:
        lock.release()
        again = RunLock.acquire(tmp_path, {})
        assert again is not None  # free although the child (with the inherited file) still lives
        again.release()
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


# --- a fit that fails at its end, or is stopped before its first step ------------------------------

class DamageBest:
    """Overwrites each best checkpoint as it is written: restore_best then fails at the fit's end."""

    def on_checkpoint(self, state, path):
        if Path(path).name.startswith("best-"):
            Path(path).write_bytes(b"not a checkpoint")


def test_a_fit_that_fails_at_its_end_lets_go_of_its_directory(tmp_path):
    with pytest.raises(GpunbError):
        fit(tmp_path, epochs=2, val=True, save_top_k=1, restore_best=True, callbacks=[DamageBest()])
    # the same kernel goes on: its own earlier fit holds no lock on the directory any more
    assert fit(tmp_path, epochs=3, resume="last").steps == 39


class StopBeforeTheFirstStep:
    """What a Ctrl-C during set-up does: the run stops before its first step."""

    def on_fit_start(self, state):
        state.request_stop("interrupted")


def test_a_resumed_run_stopped_before_its_first_step_keeps_its_place_in_the_epoch(tmp_path):
    first = fit(tmp_path, epochs=1, max_steps=5)  # 13 batches an epoch: stopped 5 in
    path = Path(first.checkpoint_path)
    assert load_checkpoint(path)["batch_in_epoch"] == 5
    fit(tmp_path, epochs=1, resume="last", callbacks=[StopBeforeTheFirstStep()])
    newest = sorted(list_checkpoints(tmp_path), key=lambda p: p.name)[-1]
    assert load_checkpoint(newest)["step"] == 5 and load_checkpoint(newest)["batch_in_epoch"] == 5


def test_a_best_file_the_abandoned_run_pruned_ranks_nothing_after_the_resume(tmp_path):
    first = fit(tmp_path, epochs=4, val=True, save_top_k=1, keep_last=4)  # the best moves on past step 13
    old_dir = Path(first.checkpoint_path).parent
    assert not (old_dir / "best-step-000000013.pt").exists() and first.best_step != 13
    resumed = fit(tmp_path, epochs=5, val=True, save_top_k=1, resume=str(old_dir / "step-000000013.pt"),
                  callbacks=[Scramble()])  # validates worse than step 13 did
    assert resumed.best_checkpoint is not None and Path(resumed.best_checkpoint).is_file()


class Scramble:
    """Noise on the resumed weights: every later validation is worse than the resumed run's."""

    def on_fit_start(self, state):
        torch.manual_seed(0)
        with torch.no_grad():
            for parameter in state.model.parameters():
                parameter.add_(torch.randn_like(parameter) * 3)
