"""One relay from rank 0 to the kernel (distributed/relay.py), for launched ranks and for jobs.

The code is read to check that what the relay does is written in it alone; its pieces are then
driven directly: rank 0's writer over a channel, the kernel's mirror, the reports of the ranks.
The relay at work across processes is tested with launched runs (test_distributed.py) and jobs
(test_jobs.py, test_job_events.py, test_jobs_slurm.py)."""

import ast
from pathlib import Path

import torch
from conftest import mlp

from gpunb.config import TrainConfig
from gpunb.distributed import relay
from gpunb.distributed.relay import Mirror, QueueChannel, RelayWriter, rank_report, with_ranks
from gpunb.runtime.result import TrainResult
from gpunb.runtime.run_state import RunState

PACKAGE = Path(__file__).resolve().parent.parent / "gpunb"
RELAY = "distributed/relay.py"


def modules():
    """(path under gpunb/, parsed tree) of every module in the package."""
    return [(path.relative_to(PACKAGE).as_posix(), ast.parse(path.read_text(), filename=str(path)))
            for path in sorted(PACKAGE.rglob("*.py"))]


def assigning(tree, name: str) -> bool:
    """Whether `tree` assigns the module-level name `name` (NAME = ..., NAME: type = ...)."""
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return True
    return False


def calling(tree, name: str) -> bool:
    """Whether `tree` calls a function or method called `name`."""
    return any(isinstance(node, ast.Call) and name in (getattr(node.func, "attr", None), getattr(node.func, "id", None))
               for node in ast.walk(tree))


def storing_attribute(tree, name: str) -> bool:
    return any(isinstance(node, ast.Attribute) and node.attr == name and isinstance(node.ctx, ast.Store)
               for node in ast.walk(tree))


def loading_with_torch(tree) -> bool:
    """Whether `tree` calls torch.load (a weights file read back)."""
    return any(isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load"
               and getattr(node.func.value, "id", None) == "torch" for node in ast.walk(tree))


def test_the_relay_is_written_once():
    found = modules()
    assert [path for path, tree in found if assigning(tree, "PROGRESS_EVERY_S")] == [RELAY]
    # Rank 0's writer sends RunState.relayed(), the kernel's mirror takes it (the runtime defines both).
    assert [path for path, tree in found if calling(tree, "relayed")] == [RELAY]
    assert [path for path, tree in found if calling(tree, "load_relayed")] == [RELAY]
    # Weights back into the caller's model, and the weights file rank 0 writes: outside the runtime's own
    # checkpoints (and the process-group context that implements the loads), only the relay.
    for name in ("load_model_state", "load_optimizer_state", "trainable_part"):
        outside = [path for path, tree in found if calling(tree, name)
                   and not path.startswith("runtime/") and path != "distributed/context.py"]
        assert outside == [RELAY], (name, outside)
    # Every rank's timings and the energy summed over them: the result's per_rank is set in one place.
    assert [path for path, tree in found if storing_attribute(tree, "per_rank")] == [RELAY]
    # The launcher and the job's follower keep only lifetimes: no dispatch or weight loading of their own.
    for path in ("distributed/launch.py", "jobs/follow.py", "jobs/entry.py", "distributed/worker.py", "jobs/events.py"):
        tree = dict(found)[path]
        defined = {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
        assert not defined & {"_dispatch", "_load_into", "_load", "_all_timings", "Relay", "EventsWriter"}, path
        assert not calling(tree, "gather_object") and not loading_with_torch(tree), path


def test_the_checks_see_a_second_copy():
    copy = ast.parse("import time\nPROGRESS_EVERY_S = 0.25\ndef f(state, p):\n    state.load_relayed(p)\n"
                     "    result.per_rank = []\n")
    assert assigning(copy, "PROGRESS_EVERY_S") and calling(copy, "load_relayed") and storing_attribute(copy, "per_rank")
    assert not calling(copy, "relayed")


class ListChannel:
    """A channel that keeps what it is sent; `lose` refuses the next messages (a full disk)."""

    def __init__(self):
        self.sent, self.lose, self.closed = [], 0, 0

    def send(self, message):
        if self.lose:
            self.lose -= 1
            return False
        self.sent.append(message)
        return True

    def stop_requested(self):
        return None

    def close(self):
        self.closed += 1


class Heard:
    def __init__(self):
        self.events = []

    def __getattr__(self, event):
        if not event.startswith("on_"):
            raise AttributeError(event)
        return lambda state, *args: self.events.append((event, state.step, *args))


def rank0_state(**fields):
    model = mlp()
    return RunState(config=TrainConfig(), model=model, device=torch.device("cpu"), **fields)


def test_the_writer_sends_progress_at_most_every_quarter_second_and_nothing_outside_the_fit(monkeypatch):
    channel, state = ListChannel(), rank0_state()
    writer = RelayWriter(channel)
    now = [0.0]
    monkeypatch.setattr(relay.time, "monotonic", lambda: now[0])
    writer.on_log(state, {"step": 0})  # before on_fit_start: not sent
    writer.on_fit_start(state)
    for step, now[0] in zip(range(1, 6), [100.0, 100.1, 100.2, 100.26, 100.3]):
        state.step = step
        writer.on_step_end(state)
    assert [(m["event"], m["fields"]["step"]) for m in channel.sent] == [("on_fit_start", 0), ("on_step_end", 1),
                                                                          ("on_step_end", 4)]
    writer.on_fit_end(state)
    writer.on_log(state, {"step": 5})  # after the end: not sent
    assert channel.sent[-1]["event"] == "on_fit_end" and channel.closed == 1 and len(channel.sent) == 4


def test_a_lost_message_sends_its_rows_with_the_next_one():
    channel, state = ListChannel(), rank0_state()
    writer = RelayWriter(channel)
    writer.on_fit_start(state)
    state.history.append({"step": 1, "loss": 1.0})
    channel.lose = 1
    writer.on_log(state, state.history[-1])  # lost
    state.history.append({"step": 2, "loss": 0.5})
    writer.on_log(state, state.history[-1])
    last = channel.sent[-1]
    assert [row["step"] for row in last["rows"]] == [1, 2] and last["args"] == [{"step": 2, "loss": 0.5}]


def test_the_mirror_follows_rank0_and_tells_each_event_once():
    channel, rank0 = ListChannel(), rank0_state(run_name="far")
    writer = RelayWriter(channel)
    heard = Heard()
    mirror = Mirror(rank0_state(), [heard])
    rows = [{"step": 2, "loss": 1.0}, {"step": 4, "loss": 0.5}]

    def attempt(first_row):  # a run (or a requeued job's attempt resumed from a checkpoint) logging rows
        writer.on_fit_start(rank0)
        for row in rows[first_row:]:
            rank0.step = row["step"]
            rank0.history.append(row)
            writer.on_log(rank0, row)
        writer.on_fit_end(rank0)

    attempt(0)
    rank0.history = rows[:1]  # resumed at step 2: the second attempt logs step 4 again
    attempt(1)
    for message in channel.sent:
        mirror.receive(message)
    assert heard.events == [("on_fit_start", 0), ("on_log", 2, rows[0]), ("on_log", 4, rows[1])]
    assert mirror.state.history == rows and mirror.state.step == 4 and mirror.state.run_name == "far"
    assert mirror.started


def test_weights_come_back_into_the_callers_model_and_optimizer(tmp_path):
    from gpunb.runtime.context import LocalContext

    trained = mlp(seed=1)
    trained_optimizer = torch.optim.Adam(trained.parameters())
    trained(torch.randn(3, 10)).sum().backward()
    trained_optimizer.step()
    result = TrainResult(run_name="far", ema_state_dict={"w": torch.ones(2)})
    relay.write_weights(tmp_path / "weights.pt", LocalContext(), trained, trained_optimizer, result)
    assert result.ema_state_dict is None and not (tmp_path / "weights.pt.partial").exists()
    kernel_model = mlp(seed=2)
    optimizer = torch.optim.Adam(kernel_model.parameters())
    mirror = Mirror(RunState(model=kernel_model, optimizer=optimizer), [])
    ema = mirror.weights_back(tmp_path / "weights.pt")
    assert torch.equal(ema["w"], torch.ones(2))
    assert all(torch.equal(a, b) for a, b in zip(kernel_model.state_dict().values(), trained.state_dict().values()))
    assert optimizer.state_dict()["state"][0]["step"] == 1


def test_every_ranks_report_meets_rank0s_result():
    def ranks_result(energy, device):
        return TrainResult(run_name="far", device=device, steps=8, wall_time_s=1.0, energy_j=energy)

    rank0 = ranks_result(10.0, "cuda:0")
    reports = [rank_report(1, ranks_result(5.0, "cuda:1")), rank_report(0, rank0)]
    assert reports[0]["result"] is None and reports[1]["result"] is rank0
    combined = with_ranks(rank0, reports)
    assert [t["rank"] for t in combined.per_rank] == [0, 1] and combined.energy_j == 15.0
    assert combined.per_rank[1]["device"] == "cuda:1"
    unmeasured = ranks_result(None, "cpu")
    assert with_ranks(unmeasured, [rank_report(0, unmeasured)]).energy_j is None


def test_the_launchers_channel_brings_its_stops_in():
    class Flag:
        value = relay.RUN

    class Queue(list):
        put = list.append

    flag, queue = Flag(), Queue()
    channel = QueueChannel(queue, flag)
    state = rank0_state(history=[{"step": 1, "loss": 1.0}])  # resumed: its history goes first
    writer = RelayWriter(channel)
    writer.on_fit_start(state)
    writer.on_step_end(state)
    assert not state.should_stop
    flag.value = relay.INTERRUPT
    writer.on_step_end(state)
    assert state.stop_reason == "interrupted"
    message = queue[0][2]
    assert queue[0][:2] == ("event", 0) and message["event"] == "on_fit_start"
    # A copy: the queue pickles it later, on its own thread, while training goes on.
    assert message["rows"] == state.history and message["rows"][0] is not state.history[0]
