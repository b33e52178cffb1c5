"""A job's events file is a log that survives damage: a half line waits until it is complete, a
damaged line is skipped with one warning, a line glued to a half one is kept, a full disk warns
once and the run goes on, and a completed job's weights come back whatever its events say."""

import errno
import json
import os
import warnings

import pytest
import torch
from conftest import mlp
from test_jobs import SETTINGS, data, no_leftovers, weights_equal  # noqa: F401 (a fixture)
from torch import nn

import gpunb
from gpunb import Trainer
from gpunb.distributed.relay import RelayWriter
from gpunb.jobs import events
from gpunb.jobs.events import EventsChannel, EventsReader, append

pytest.importorskip("submitit")


def line(event, **fields):
    return (json.dumps({"t": 1.0, "event": event, **fields}) + "\n").encode()


def write(path, data: bytes):
    with open(path, "ab") as handle:
        handle.write(data)


def damage_warnings(caught):
    return [w for w in caught if "damaged line" in str(w.message)]


def test_a_half_line_is_read_again_once_it_is_complete(tmp_path):
    path = tmp_path / "events.jsonl"
    reader = EventsReader(path)
    assert reader.read() == []  # no file yet
    whole = line("on_log", rows=[{"step": 4, "loss": 0.5}])
    write(path, line("job_started") + whole[:25])  # the writer is in the middle of its second line
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert [e["event"] for e in reader.read()] == ["job_started"]
        assert reader.read() == [] and reader.offset == len(line("job_started"))  # waits at the line's start
        write(path, whole[25:])
        assert reader.read() == [{"t": 1.0, "event": "on_log", "rows": [{"step": 4, "loss": 0.5}]}]
        assert reader.read() == []
    assert damage_warnings(caught) == []  # a line being written is not damage


def test_a_damaged_line_is_skipped_with_one_warning(tmp_path):
    path = tmp_path / "events.jsonl"
    reader = EventsReader(path)
    write(path, line("job_started") + b"\x00\x00garbage{\n" + line("on_log", rows=[]))
    with pytest.warns(RuntimeWarning, match=r"Skipped a damaged line in .*events.jsonl \(at byte 35: "
                                            r"b'\\x00\\x00garbage\{'"):
        assert [e["event"] for e in reader.read()] == ["job_started", "on_log"]
    write(path, b"[1, 2]\n" + b'{"t": 2.0, "event": \n' + line("job_done"))  # JSON but no event; a torn line
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert [e["event"] for e in reader.read()] == ["job_done"]
    assert damage_warnings(caught) == [] and reader.skipped == 3  # one warning per file, not one per read


def test_a_line_glued_to_a_half_one_is_kept(tmp_path):
    path = tmp_path / "events.jsonl"
    # A writer died in the middle of a line; the requeued attempt's first write went on right after it.
    write(path, line("on_log", rows=[]) + line("on_step_end", rows=[{"step": 9}])[:30] + line("job_started", attempt=2))
    reader = EventsReader(path)
    with pytest.warns(RuntimeWarning, match="damaged line"):
        read = reader.read()
    assert [(e["event"], e.get("attempt")) for e in read] == [("on_log", None), ("job_started", 2)]


def test_a_writer_starts_on_a_fresh_line_after_a_half_one(tmp_path):
    path = tmp_path / "events.jsonl"
    write(path, line("job_started") + line("on_step_end", rows=[{"step": 9}])[:30])  # a writer died mid-line
    append(path, "job_started", attempt=2)
    with open(path, "rb") as handle:
        written = handle.read().split(b"\n")
    assert written[1] == line("on_step_end", rows=[{"step": 9}])[:30] and json.loads(written[2])["attempt"] == 2
    reader = EventsReader(path)
    with pytest.warns(RuntimeWarning, match="damaged line"):
        assert [e["event"] for e in reader.read()] == ["job_started", "job_started"]


class FullDisk:
    """os.write as on a disk that fills up: for the events file, the `fail_at`-th write stops
    halfway (what a full disk does to a write), the next `refused` writes fail with ENOSPC, and
    later ones succeed (space was freed). Other files are written as usual."""

    def __init__(self, path, fail_at, refused):
        self.path, self.fail_at, self.refused = str(path), fail_at, refused
        self.calls, self.failed = 0, 0
        self.real = os.write

    def __call__(self, fd, data):
        if not os.path.exists(self.path) or not os.path.samestat(os.fstat(fd), os.stat(self.path)):
            return self.real(fd, data)
        self.calls += 1
        if self.calls == self.fail_at:
            self.failed += 1
            return self.real(fd, bytes(data)[:len(data) // 2])
        if self.fail_at < self.calls <= self.fail_at + self.refused:
            self.failed += 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.real(fd, data)


def test_a_full_disk_warns_once_and_the_run_goes_on(tmp_path, monkeypatch):
    path = tmp_path / "events.jsonl"
    disk = FullDisk(path, fail_at=4, refused=6)
    monkeypatch.setattr(events.os, "write", disk)
    monkeypatch.setattr(events, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = Trainer(**SETTINGS, max_steps=40, track=False).fit(
            mlp(), data(), loss_fn=nn.CrossEntropyLoss(), callbacks=[RelayWriter(EventsChannel(path))])
    assert result.steps == 40 and disk.failed == 7 and disk.calls > 11  # writes were refused, then went on
    full = [w for w in caught if "events file" in str(w.message)]
    assert len(full) == 1 and "the disk is full" in str(full[0].message) and "HINT:" in str(full[0].message)
    monkeypatch.setattr(events.os, "write", disk.real)
    reader = EventsReader(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lines = reader.read()
    assert damage_warnings(caught) == [] and reader.skipped == 0  # no half line was left behind
    assert lines[0]["event"] == "on_fit_start" and lines[-1]["event"] == "on_fit_end"
    rows = [row for event in lines for row in event["rows"]]  # a lost line's rows came with the next one
    assert rows == result.history
    append(path, "job_done")  # later events are readable
    assert [e["event"] for e in reader.read()] == ["job_done"]


def test_attach_brings_a_completed_jobs_weights_back_whatever_its_events_say():
    model = mlp()
    done = Trainer(**SETTINGS, cluster="local", max_steps=8, name="damaged").fit(
        model, data(), loss_fn=nn.CrossEntropyLoss())
    assert done.status == "completed"
    path = os.path.join(done.job["folder"], "events.jsonl")
    with open(path, "rb") as handle:
        lines = handle.read().splitlines(keepends=True)
    assert json.loads(lines[-1])["event"] == "job_done"
    # A garbage line, a half line glued to the next event, and the end's own event cut in half.
    damaged = lines[:2] + [b"garbage\n", lines[2][:40]] + lines[3:-1] + [lines[-1][:30]]
    with open(path, "wb") as handle:
        handle.write(b"".join(damaged))
    with pytest.warns(RuntimeWarning, match="damaged line"):
        again = gpunb.attach("damaged")
    assert again.status == "completed" and again.steps == 8
    assert weights_equal(again.model, model)
    saved = torch.load(os.path.join(done.job["folder"], "result.pt"), weights_only=True)["model"]
    assert all(torch.equal(saved[k], v) for k, v in again.model.state_dict().items())
