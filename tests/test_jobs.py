"""A run as a job on this machine (submitit's local executor): the same weights as in the kernel,
rows while it trains, stop, preemption and exact resume, attach, and the checks before submitting.

Every test ends with no process of its job left (the `no_leftovers` fixture)."""

import json
import os
import signal
import socket
import sys
import threading
import time

import cloudpickle

import psutil
import pytest
import torch
from conftest import classification_data, mlp
from torch import nn

import gpunb
from gpunb import Trainer
from gpunb.errors import GpunbError
from gpunb.runs import Registry

pytest.importorskip("submitit")

# The jobs import nothing from the tests (pytest's sys.path is not theirs): SlowLoss travels by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

SETTINGS = dict(accelerator="cpu", batch_size=16, log_every=4, seed=0)


@pytest.fixture(autouse=True)
def no_leftovers(tmp_path):
    """No job process (a controller or task running from this test's folders) outlives the test."""
    yield
    deadline = time.monotonic() + 15
    while True:
        # Every process, not only this one's children: a Slurm job's tasks are slurmd's.
        left = [p for p in psutil.process_iter() if p.pid != os.getpid() and _in(p, str(tmp_path))]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for process in left:
        process.kill()
    assert not left, [p.cmdline() for p in left]


def _in(process, text):
    try:
        return any(text in part for part in process.cmdline()) or text in process.cwd() or \
            any(text in value for value in process.environ().values())
    except psutil.Error:
        return False


def data():
    return classification_data(n=128)


def weights_equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def in_kernel(**overrides):
    model = mlp()
    Trainer(**{**SETTINGS, **overrides}, track=False).fit(model, data(), loss_fn=nn.CrossEntropyLoss())
    return model


class Watch:
    """Records what a job's follower hands to callbacks."""

    def __init__(self):
        self.rows, self.jobs, self.ended = [], [], None

    def on_job_state(self, state, job):
        self.jobs.append(dict(job))

    def on_log(self, state, row):
        done = os.path.exists(os.path.join(self.jobs[-1]["folder"], "result.pt"))
        self.rows.append((row["step"], done, time.time()))

    def on_fit_end(self, state):
        self.ended = state.result


def test_detached_job_trains_the_kernels_weights_and_streams_its_rows():
    watch = Watch()
    model = mlp()
    # SlowLoss (the same numbers, 50 ms a step) keeps the job training while its rows arrive.
    result = Trainer(**SETTINGS, cluster="local", max_steps=24, name="same").fit(
        model, data(), loss_fn=SlowLoss(), callbacks=[watch])
    assert result.status == "completed" and result.steps == 24
    assert weights_equal(model, in_kernel(max_steps=24))
    steps = [step for step, _, _ in watch.rows]
    assert steps == sorted(steps) and steps[-1] == 24 and len(steps) >= 6
    assert any(not done for _, done, _ in watch.rows), "every row came after the job had finished"
    assert watch.ended is result and result.model is model
    assert watch.jobs[-1]["state"] == "COMPLETED"  # the line above the dashboard follows the job to its end
    run = Registry().get_run(result.job["run_id"])
    assert run["status"] == "completed" and run["job"]["cluster"] == "local" and run["step"] == 24
    assert run["job"]["state"] not in ("PENDING", None)  # the scheduler's view followed the job past its queue


def test_two_task_job_matches_the_two_process_launch():
    model = mlp()
    result = Trainer(**SETTINGS, cluster="local", devices=2, max_steps=8, name="pair").fit(
        model, data(), loss_fn=nn.CrossEntropyLoss())
    assert result.world_size == 2 and len(result.per_rank) == 2
    assert weights_equal(model, in_kernel(devices=2, max_steps=8))


class StopAt:
    """Asks the job to stop (its stop file, as the kernel's interrupt button does) at a step."""

    def __init__(self, step):
        self.step, self.folder = step, None

    def on_job_state(self, state, job):
        self.folder = job["folder"]

    def on_log(self, state, row):
        if row["step"] >= self.step:
            open(os.path.join(self.folder, "stop"), "w").close()


def test_stop_ends_the_job_with_a_checkpoint_and_its_weights():
    model = mlp()
    result = Trainer(**SETTINGS, cluster="local", max_steps=100_000, name="stopped").fit(
        model, data(), loss_fn=nn.CrossEntropyLoss(), callbacks=[StopAt(8)])
    assert result.status == "stopped" and 8 <= result.steps < 100_000
    checkpoint = torch.load(result.checkpoint_path, weights_only=True)
    assert checkpoint["step"] == result.steps
    assert all(torch.equal(checkpoint["model"][k], v) for k, v in model.state_dict().items())
    run = Registry().get_run(result.job["run_id"])
    assert (run["status"], run["stop_reason"]) == ("stopped", "stopped from the notebook")
    assert result.stop_reason == "stopped from the notebook"


class PreemptOnce:
    """A forward pre-hook that, in the job, sends its own process SIGUSR2 (submitit's preemption
    signal) at the model's n-th call, once: the marker file keeps the requeued attempt from being
    preempted again. Sent from inside the job, the signal lands mid-run however fast the job
    runs (a kernel-side trigger could come after a quick job had already finished)."""

    def __init__(self, calls, marker):
        self.calls, self.marker, self.seen = calls, str(marker), 0

    def __call__(self, module, args):
        self.seen += 1
        if self.seen == self.calls and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGUSR2)


def test_preempted_job_checkpoints_requeues_and_resumes_exactly(tmp_path):
    model = mlp()
    hook = model.register_forward_pre_hook(PreemptOnce(12, tmp_path / "preempted"))
    result = Trainer(**SETTINGS, cluster="local", max_steps=40, name="preempted").fit(
        model, data(), loss_fn=nn.CrossEntropyLoss())
    hook.remove()
    assert (tmp_path / "preempted").exists() and result.status == "completed" and result.steps == 40
    with open(os.path.join(result.job["folder"], "events.jsonl")) as handle:
        kinds = [json.loads(line)["event"] for line in handle]
    assert kinds.count("job_started") == 2 and kinds.count("requeued") == 1
    assert_resumed_from_the_newest_checkpoint(result)
    steps = [row["step"] for row in result.history]
    assert steps == sorted(set(steps)) and steps[-1] == 40
    assert weights_equal(model, in_kernel(max_steps=40))


def checkpoints_before_requeue(folder) -> list[tuple[int, str]]:
    """(step, path) of each checkpoint the job's first attempt wrote, in order: its on_checkpoint
    events before the second job_started (a requeue's `requeued` event, when it wrote one, comes between)."""
    with open(os.path.join(folder, "events.jsonl")) as handle:
        lines = [json.loads(line) for line in handle]
    starts = [i for i, line in enumerate(lines) if line["event"] == "job_started"]
    paths = [line["args"][0] for line in lines[:starts[1]] if line["event"] == "on_checkpoint"]
    return [(int(os.path.basename(path)[len("step-"):-len(".pt")]), path) for path in paths]


def assert_resumed_from_the_newest_checkpoint(result):
    """Resume is exact from any checkpoint, so equal weights cannot tell which one a requeue took:
    the result's `resumed_from` must name the newest written before the requeue (of two or more)."""
    written = checkpoints_before_requeue(result.job["folder"])
    assert len(written) >= 2, written  # an older one to take by mistake
    assert (result.resumed_from["step"], result.resumed_from["path"]) == written[-1], (result.resumed_from, written)


class StartedAt:
    def on_fit_start(self, state):
        self.started_at = state.started_at


def test_the_same_run_again_attaches_instead_of_resubmitting(gpunb_home):
    first, second = mlp(), mlp()
    one = Trainer(**SETTINGS, cluster="local", max_steps=8, name="again").fit(first, data(), loss_fn=nn.CrossEntropyLoss())
    started = StartedAt()
    two = Trainer(**SETTINGS, cluster="local", max_steps=8, name="again").fit(
        second, data(), loss_fn=nn.CrossEntropyLoss(), callbacks=[started])
    with open(os.path.join(one.job["folder"], "events.jsonl")) as handle:
        began = [event["t"] for event in map(json.loads, handle) if event["event"] == "job_started"]
    assert started.started_at == began[0]  # the dashboard's elapsed time counts from the job's start
    assert not one.job["attached"] and two.job["attached"] and one.job["folder"] == two.job["folder"]
    assert len(os.listdir(gpunb_home / "jobs")) == 1 and weights_equal(first, second)
    three = Trainer(**SETTINGS, cluster="local", max_steps=8, name="again", resubmit=True).fit(
        mlp(), data(), loss_fn=nn.CrossEntropyLoss())
    assert three.job["folder"] != one.job["folder"] and len(os.listdir(gpunb_home / "jobs")) == 2


def test_submit_returns_at_once_and_attach_brings_the_weights_back():
    submitted = Trainer(**SETTINGS, cluster="local", max_steps=8, name="later").submit(
        mlp(), data(), loss_fn=nn.CrossEntropyLoss())
    assert submitted.status in ("queued", "running") and submitted.model is None
    listed = {run["name"]: run for run in Registry().list_runs()}
    assert listed["later"]["status"] in ("queued", "running") and listed["later"]["job"]["cluster"] == "local"
    assert "later" in repr(gpunb.runs())
    result = gpunb.attach("later")
    assert result.status == "completed" and result.steps == 8
    assert weights_equal(result.model, in_kernel(max_steps=8))


@pytest.mark.parametrize("submitter", ["foreground", "background"])
def test_a_cancelled_job_is_reported_cancelled(submitter):
    """In the background (`python submit.py &`, `nohup`) the submitting process ignores SIGINT and
    its children inherit that; the detached job's controller must still answer cancel's SIGINT."""
    from gpunb.jobs import spec as job_spec

    if submitter == "background":
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the autouse fixture puts the handler back
    submitted = Trainer(**SETTINGS, cluster="local", max_steps=1_000_000, name="cancelled").submit(
        mlp(), data(), loss_fn=nn.CrossEntropyLoss())
    spec = job_spec.load(submitted.job["folder"])
    spec.backend.cancel(spec)
    result = gpunb.attach("cancelled")
    assert result.status == "cancelled" and result.stop_reason == "cancelled from gpunb"
    row = Registry().get_run(spec.run_id)
    assert (row["status"], row["stop_reason"]) == ("cancelled", "cancelled from gpunb")
    if not result.device:  # cancelled before it set up (a job set up at step 0 knows its precision)
        shown = result._repr_html_()
        assert "precision" not in shown and "micro-batch" not in shown and "wall time" not in shown


@pytest.mark.parametrize("ignores_for_s, ends_by", [(1.0, "SIGINT"), (None, "SIGKILL")])
def test_a_local_cancel_reaches_a_controller_that_ignored_sigint_while_starting(ignores_for_s, ends_by):
    """A controller started by a submitter that ignores SIGINT ignores it too until its own
    handler is in place: the cancel sends SIGINT again, and at last SIGKILLs its session."""
    import subprocess
    from types import SimpleNamespace

    from gpunb.jobs.backends.local import end_controller

    handler = "signal.SIG_IGN" if ignores_for_s is None else "signal.default_int_handler"
    code = f"import signal, time; time.sleep({ignores_for_s or 0}); signal.signal(signal.SIGINT, {handler}); time.sleep(120)"
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a submitter in the background (the autouse fixture undoes it)
    process = subprocess.Popen([sys.executable, "-c", code], start_new_session=True, stderr=subprocess.DEVNULL)
    try:
        spec = SimpleNamespace(job_id=str(process.pid), job_started=psutil.Process(process.pid).create_time())
        end_controller(spec, tries=3, wait_s=1.5)
        code = process.wait(timeout=10)
        assert code == -getattr(signal, ends_by)  # Python ends on an uncaught KeyboardInterrupt by SIGINT
    finally:
        process.kill()


def test_an_unpicklable_object_is_named_before_submitting(gpunb_home):
    model = mlp()
    model.guard = threading.Lock()
    with pytest.raises(GpunbError, match=r"`model` holds a lock \(at `model.guard`\) that cannot be pickled, "
                                         r"so it cannot be sent to the job"):
        Trainer(**SETTINGS, cluster="local", max_steps=2).fit(model, data(), loss_fn=nn.CrossEntropyLoss())
    assert not (gpunb_home / "jobs").exists() and Registry().list_runs() == []


def test_data_too_large_to_ship_names_the_fix(tmp_path, monkeypatch, gpunb_home):
    clusters = tmp_path / "clusters.toml"
    clusters.write_text("[local]\nmax_ship_mb = 0.01\n")
    monkeypatch.setenv("GPUNB_CLUSTERS", str(clusters))
    x, y = classification_data(n=4096)
    with pytest.raises(GpunbError) as caught:
        Trainer(**SETTINGS, cluster="local", max_steps=2).fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss())
    message = str(caught.value)
    assert "more than the 0 MB a job is sent by value" in message and "'train_data'" in message
    assert "a file system the job's nodes see" in message and str(clusters) in message
    assert not (gpunb_home / "jobs").exists()


def test_a_version_mismatch_ends_the_job_and_the_message_reaches_the_kernel(monkeypatch):
    from gpunb.jobs import spec as job_spec, submit

    real = job_spec.current_versions()
    monkeypatch.setattr(submit, "current_versions", lambda: {**real, "torch": "1.0.0"})
    with pytest.raises(GpunbError) as caught:
        Trainer(**SETTINGS, cluster="local", max_steps=2, name="mismatch").fit(mlp(), data(),
                                                                               loss_fn=nn.CrossEntropyLoss())
    message = str(caught.value)
    assert f"torch 1.0.0 in the notebook's kernel, {real['torch']} in the job" in message
    assert "HINT:" in message and "Traceback" not in message
    run = [r for r in Registry().list_runs() if r["name"] == "mismatch"][0]
    assert run["status"] == "failed"


def test_a_slurm_job_folder_must_be_on_a_shared_file_system(tmp_path, monkeypatch):
    from gpunb.jobs import checks

    monkeypatch.setattr(checks, "_nodes_are_this_host", lambda: False)
    monkeypatch.setattr(checks, "file_system_type", lambda path: "ext4")
    with pytest.raises(GpunbError, match=r"(?s)is on a local file system \(ext4\).*HINT: set `job_dir` under \[slurm\]"):
        checks.check_shared(tmp_path, {})
    checks.check_shared(tmp_path, {"shared_fs": True})
    monkeypatch.setattr(checks, "file_system_type", lambda path: "nfs4")
    checks.check_shared(tmp_path, {})


def test_the_cluster_file_gives_defaults_and_refuses_unknown_keys(tmp_path, monkeypatch):
    from gpunb.config import TrainConfig
    from gpunb.jobs.backends import get
    from gpunb.jobs.submit import job_settings

    clusters = tmp_path / "clusters.toml"
    clusters.write_text('[slurm]\npartition = "gpu"\naccount = "team"\ntime = "2:00:00"\n[slurm.sbatch]\nmem = "8G"\n')
    monkeypatch.setenv("GPUNB_CLUSTERS", str(clusters))
    settings = job_settings(TrainConfig(cluster="slurm", slurm={"partition": "debug", "exclusive": ""}))
    assert settings["partition"] == "debug" and settings["account"] == "team"
    assert settings["sbatch"] == {"mem": "8G", "exclusive": ""}
    slurm = get("slurm")
    assert slurm.time_limit_min(settings) == 120 and slurm.time_limit_min({"time": "1-00:30:00"}) == 1470
    clusters.write_text('[slurm]\npartiton = "gpu"\n')
    with pytest.raises(GpunbError, match="unknown key"):
        job_settings(TrainConfig(cluster="slurm"))


class InterruptAt:
    """Presses the kernel's interrupt button (SIGINT to this process) `times` times at a step."""

    def __init__(self, step, times):
        self.step, self.times, self.done = step, times, False

    def on_log(self, state, row):
        if row["step"] >= self.step and not self.done:
            self.done = True
            for _ in range(self.times):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.2)


def test_the_interrupt_button_stops_the_job_and_a_second_press_cancels_it():
    model = mlp()
    result = Trainer(**SETTINGS, cluster="local", max_steps=100_000, name="interrupted").fit(
        model, data(), loss_fn=nn.CrossEntropyLoss(), callbacks=[InterruptAt(8, times=1)])
    assert result.status == "stopped" and result.steps < 100_000
    checkpoint = torch.load(result.checkpoint_path, weights_only=True)
    assert all(torch.equal(checkpoint["model"][k], v) for k, v in model.state_dict().items())
    result = Trainer(**SETTINGS, cluster="local", max_steps=100_000, checkpoint_every=4, name="pressed-twice").fit(
        mlp(), data(), loss_fn=SlowLoss(), callbacks=[InterruptAt(8, times=2)])
    assert result.status == "cancelled" and Registry().get_run(result.job["run_id"])["status"] == "cancelled"


class GpuWatch:
    """Records the GPU samples a job's follower hands over, and whether the job had finished by then."""

    def __init__(self):
        self.samples, self.folder = [], None

    def on_job_state(self, state, job):
        self.folder = job["folder"]

    def on_gpu_samples(self, state, samples):
        done = os.path.exists(os.path.join(self.folder, "result.pt"))
        self.samples += [(sample, done) for sample in samples]


def test_each_nodes_gpu_samples_reach_the_kernel_while_the_job_runs_and_give_its_energy(monkeypatch):
    # The job's processes get two fake GPUs from tests/fake_gpus/sitecustomize.py (NVML is absent here).
    fake_gpus = os.path.join(os.path.dirname(__file__), "fake_gpus")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([fake_gpus, os.environ.get("PYTHONPATH", "")]))
    watch = GpuWatch()
    result = Trainer(**SETTINGS, cluster="local", gpus_per_node=2, max_steps=64, name="gpus").fit(
        mlp(), data(), loss_fn=SlowLoss(), callbacks=[watch])
    assert result.status == "completed" and result.world_size == 2
    folder = result.job["folder"]
    assert sorted(name for name in os.listdir(folder) if name.startswith("gpus-")) == ["gpus-0.jsonl"]
    with open(os.path.join(folder, "gpus-0.jsonl")) as handle:
        lines = [json.loads(line) for line in handle]
    written = [sample for line in lines for sample in line["samples"]]
    assert [sample for sample, _ in watch.samples] == [{"node": 0, "host": socket.gethostname(), **sample}
                                                       for sample in written]  # each one once, in order
    assert any(not done for _, done in watch.samples), "every sample came after the job had finished"
    for gpu in (0, 1):
        mine = [sample for sample in written if sample["index"] == gpu]
        assert mine and all((s["utilization_gpu"], s["memory_used_mb"], s["power_w"], s["temperature_c"]) ==
                            (90 + gpu, 1024 * (gpu + 1), 300 + 10 * gpu, 60 + gpu) for s in mine)
    # Each GPU's counter gains 50 J a read: its samples, then the end's read.
    assert lines[-1]["energy_j"] == pytest.approx(50.0 * len(written))
    assert result.energy_j == lines[-1]["energy_j"] and result.energy_by_node == {0: result.energy_j}


def test_the_kernel_adds_up_the_energy_of_every_node_and_attempt(tmp_path):
    from gpunb.jobs.events import append
    from gpunb.jobs.gpus import NodeGpuReader, gpus_path

    def write(node, attempt, energy):
        append(gpus_path(tmp_path, node), "gpu_samples", node=node, host=f"n{node}", attempt=attempt,
               samples=[{"index": 0, "power_w": 300.0 + node}], energy_j=energy)

    for node, attempt, energy in ((0, 1.0, 100.0), (1, 1.0, 200.0), (0, 2.0, 30.0)):  # node 0 was requeued
        write(node, attempt, energy)
    reader = NodeGpuReader(tmp_path)
    assert [(s["node"], s["host"], s["power_w"]) for s in reader.read()] == [
        (0, "n0", 300.0), (0, "n0", 300.0), (1, "n1", 301.0)]
    assert reader.energy_by_node == {0: 130.0, 1: 200.0} and reader.energy_j == 330.0
    write(1, 1.0, 250.0)  # a newer line of the same attempt replaces its energy
    assert len(reader.read()) == 1 and reader.energy_j == 380.0 and reader.read() == []


def test_the_dashboard_shows_each_node_and_gpu_of_a_job():
    from gpunb.notebook.dashboard import Dashboard

    view = Dashboard()
    view.on_gpu_samples(None, [{"node": 0, "host": "a", "index": 0, "utilization_gpu": 90.0, "temperature_c": 60.0},
                               {"node": 1, "host": "b", "index": 1, "utilization_gpu": 91.0, "power_w": 301.0}])
    shown = view._gpu_html()
    assert shown.index("node 0 · a · GPU 0") < shown.index("node 1 · b · GPU 1")
    assert "90%" in shown and "60 C" in shown and "91%" in shown and "301 W" in shown


class VisibleRecorder(nn.CrossEntropyLoss):
    """A loss that writes the CUDA_VISIBLE_DEVICES of each process it runs in to `folder`."""

    def __init__(self, folder):
        super().__init__()
        self.folder = str(folder)

    def forward(self, output, target):
        with open(os.path.join(self.folder, f"visible-{os.getpid()}"), "w") as handle:
            handle.write(os.environ.get("CUDA_VISIBLE_DEVICES", "unset"))
        return super().forward(output, target)


def test_a_local_job_runs_on_the_first_gpus_the_kernel_may_use_not_on_gpu_0(tmp_path, monkeypatch):
    # A kernel started on GPUs 3, 5 and 6 (another user may hold 0 and 1): its job of two GPUs gets
    # 3 and 5, as the kernel names them. No GPU here: the job's processes only carry the variable.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6")
    seen = tmp_path / "seen"
    seen.mkdir()
    result = Trainer(**SETTINGS, cluster="local", gpus_per_node=2, max_steps=4, name="visible").fit(
        mlp(), data(), loss_fn=VisibleRecorder(seen))
    assert result.status == "completed" and result.world_size == 2
    assert sorted(path.read_text() for path in seen.iterdir()) == ["3,5", "3,5"]  # each task's process


class SlowLoss(nn.CrossEntropyLoss):
    def forward(self, output, target):
        time.sleep(0.05)
        return super().forward(output, target)


def test_the_key_of_a_cell_changes_with_its_options_values():
    from gpunb.jobs.lookup import cell_key

    cell = "model = make()\ntrain_data = data()"
    sixty = cell_key(cell, "--detach --max-steps 60")
    assert sixty == cell_key(cell + "\n\n", "--detach  --max-steps 60 --quiet --no-wait")  # how it waits: the same run
    assert sixty != cell_key(cell, "--detach --max-steps 80") != cell_key(cell, "--detach --max-steps 60 --lr 0.1")


def test_a_changed_option_is_another_job(gpunb_home):
    first = Trainer(**SETTINGS, cluster="local", max_steps=4, name="options").fit(
        mlp(), data(), loss_fn=nn.CrossEntropyLoss())
    second = Trainer(**SETTINGS, cluster="local", max_steps=6, name="options").fit(
        mlp(), data(), loss_fn=nn.CrossEntropyLoss())
    assert not second.job["attached"] and second.job["folder"] != first.job["folder"] and second.steps == 6


class KillAfterCheckpoint:
    """Kills the job's every process (controller and tasks, SIGKILL) once a checkpoint at or after
    `step` is written: the job ends without a result, as after an out-of-memory kill."""

    def __init__(self, step):
        self.step, self.job = step, None

    def on_job_state(self, state, job):
        self.job = job

    def on_checkpoint(self, state, path):
        if state.step >= self.step and self.job is not None:
            controller = psutil.Process(int(self.job["id"]))
            for process in [*controller.children(recursive=True), controller]:
                process.kill()
            self.job = None


def test_a_killed_jobs_cell_run_again_resumes_from_its_newest_checkpoint(capsys):
    from gpunb.runtime.state.checkpoint_files import list_checkpoints

    settings = dict(**SETTINGS, cluster="local", max_steps=40, checkpoint_every=4, name="killed")
    with pytest.raises(GpunbError, match="without a result"):
        Trainer(**settings).fit(mlp(), data(), loss_fn=SlowLoss(), callbacks=[KillAfterCheckpoint(8)])
    folder = [run for run in Registry().list_runs() if run["name"] == "killed"][0]["job"]["folder"]
    newest = list_checkpoints(os.path.join(folder, "checkpoints"))[-1]
    saved = torch.load(newest, weights_only=True)["step"]
    assert 8 <= saved < 40
    model = mlp()
    result = Trainer(**settings).fit(model, data(), loss_fn=nn.CrossEntropyLoss())
    assert f"it goes on from its newest checkpoint (step {saved})" in capsys.readouterr().out
    assert result.status == "completed" and result.steps == 40 and result.job["folder"] == folder
    assert result.resumed_from["step"] == saved and result.resumed_from["path"] == str(newest)
    assert weights_equal(model, in_kernel(max_steps=40, checkpoint_every=4))
    fresh = Trainer(**settings, resubmit=True).fit(mlp(), data(), loss_fn=nn.CrossEntropyLoss())
    assert fresh.job["folder"] != folder and fresh.resumed_from is None and fresh.steps == 40


def test_a_cancel_loads_the_newest_checkpoint(gpunb_home):
    from gpunb.runtime.state.checkpoint_files import list_checkpoints

    model = mlp()
    result = Trainer(**SETTINGS, cluster="local", max_steps=100_000, checkpoint_every=4, name="cancel-newest").fit(
        model, data(), loss_fn=SlowLoss(), callbacks=[CancelAfterCheckpoints(3)])
    assert result.status == "cancelled" and result.stop_reason == "cancelled from the notebook"
    written = list_checkpoints(os.path.join(result.job["folder"], "checkpoints"))
    steps = [torch.load(path, weights_only=True)["step"] for path in written]
    assert len(written) >= 2 and steps == sorted(steps)
    assert result.loaded_step == steps[-1] and result.checkpoint_path == str(written[-1])
    newest = torch.load(written[-1], weights_only=True)["model"]
    assert all(torch.equal(newest[k], v) for k, v in model.state_dict().items())
    row = Registry().get_run(result.job["run_id"], with_history=False)
    assert (row["status"], row["stop_reason"], row["error"]) == ("cancelled", "cancelled from the notebook", None)


class CancelAfterCheckpoints:
    """Cancels the job (as a second press of the interrupt button does) after `count` checkpoints."""

    def __init__(self, count):
        self.count, self.seen, self.follower = count, 0, None

    def on_checkpoint(self, state, path):
        self.seen += 1
        if self.seen == self.count:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)


def test_an_interrupt_followed_by_a_shutdown_leaves_the_job_running(monkeypatch):
    """The shutdown_request that follows a restart's interrupt may come late on a loaded machine:
    within the grace, the interrupt is not taken for a stop."""
    import IPython

    shell = type("Shell", (), {"exit_now": False})()
    monkeypatch.setattr(IPython, "get_ipython", lambda: shell)
    result = Trainer(**SETTINGS, cluster="local", max_steps=40, name="restarted").fit(
        mlp(), data(), loss_fn=SlowLoss(), callbacks=[InterruptThenShutdown(8, shell)])
    assert result.status in ("queued", "running") and result.model is None
    assert not os.path.exists(os.path.join(result.job["folder"], "stop"))
    shell.exit_now = False  # a new kernel
    model = mlp()
    ended = Trainer(**SETTINGS, cluster="local", max_steps=40, name="restarted").fit(
        model, data(), loss_fn=nn.CrossEntropyLoss())
    assert ended.job["attached"] and ended.status == "completed" and ended.steps == 40
    assert weights_equal(model, in_kernel(max_steps=40))


class InterruptThenShutdown:
    """SIGINT at a step, and the kernel's shutdown (ipykernel's `exit_now`) a second after it."""

    def __init__(self, step, shell):
        self.step, self.shell, self.done = step, shell, False

    def on_log(self, state, row):
        if row["step"] >= self.step and not self.done:
            self.done = True
            os.kill(os.getpid(), signal.SIGINT)
            threading.Timer(1.0, setattr, (self.shell, "exit_now", True)).start()


def test_an_interrupt_stands_only_past_its_grace_and_without_a_shutdown(monkeypatch):
    import IPython

    from gpunb.jobs.interrupts import GRACE_S, KernelInterrupts

    shell = type("Shell", (), {"exit_now": False})()
    monkeypatch.setattr(IPython, "get_ipython", lambda: shell)
    interrupts = KernelInterrupts()
    interrupts.times = [100.0]
    assert interrupts.due(now=100.0) == 0 and interrupts.due(now=100.0 + GRACE_S - 0.5) == 0
    assert interrupts.due(now=100.0 + GRACE_S) == 1
    interrupts.times.append(101.0)  # a second press: both stand once it is past its grace (a cancel, not a stop)
    assert interrupts.due(now=100.0 + GRACE_S) == 0 and interrupts.due(now=101.0 + GRACE_S) == 2
    shell.exit_now = True
    assert interrupts.shutting_down() and interrupts.due(now=200.0) == 0


def test_gpunb_stop_stops_a_job_and_a_second_call_cancels_it():
    submitted = Trainer(**SETTINGS, cluster="local", max_steps=100_000, checkpoint_every=4, name="stop-me").submit(
        mlp(), data(), loss_fn=SlowLoss())
    stop_file = os.path.join(submitted.job["folder"], "stop")
    deadline = time.monotonic() + 120
    while Registry().get_run(submitted.job["run_id"])["status"] == "queued":  # a waiting job is cancelled
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert gpunb.stop("stop-me") == "stopping"
    with open(stop_file) as handle:
        assert handle.read() == "stopped from gpunb.stop"
    result = gpunb.attach("stop-me")
    assert result.status == "stopped" and result.stop_reason == "stopped from gpunb.stop"
    assert Registry().get_run(submitted.job["run_id"])["stop_reason"] == "stopped from gpunb.stop"
    assert gpunb.stop("stop-me") == "stopped"  # ended: nothing to do
    again = Trainer(**SETTINGS, cluster="local", max_steps=100_000, name="cancel-me").submit(
        mlp(), data(), loss_fn=SlowLoss())
    assert gpunb.stop(again.job["run_id"]) in ("stopping", "cancelled")
    assert gpunb.stop(again.job["run_id"]) == "cancelled"
    assert gpunb.attach("cancel-me").stop_reason == "cancelled from gpunb.stop"


def test_a_job_that_has_not_started_shows_only_what_is_known(tmp_path):
    from gpunb.config import TrainConfig
    from gpunb.jobs.follow import Follower
    from gpunb.jobs.spec import JobSpec

    spec = JobSpec(run_id="0" * 32, name="waiting", key=None, cluster="slurm", folder=str(tmp_path), nodes=2,
                   tasks_per_node=8, gpus_per_node=8, accelerator="cuda", entry="m:f", registry=None)
    result = Follower(spec, TrainConfig(cluster="slurm")).now()
    assert result.status == "queued"
    shown = result._repr_html_()
    for unknown in ("precision", "micro-batch", "wall time", "device"):
        assert unknown not in shown, unknown


def test_a_cancelled_two_task_job_says_cancelled_not_what_killed_its_ranks():
    result = Trainer(**SETTINGS, cluster="local", devices=2, max_steps=100_000, checkpoint_every=4,
                     name="cancelled-pair").fit(mlp(), data(), loss_fn=SlowLoss(), callbacks=[CancelAfterCheckpoints(2)])
    assert result.status == "cancelled" and result.stop_reason == "cancelled from the notebook"
    row = Registry().get_run(result.job["run_id"], with_history=False)
    assert (row["status"], row["stop_reason"], row["error"]) == ("cancelled", "cancelled from the notebook", None)


def test_a_job_cancelled_with_no_kernel_following_stays_cancelled():
    from gpunb.jobs import spec as job_spec
    from gpunb.jobs.backends.base import ENDED
    from gpunb.jobs.lookup import stop_job

    submitted = Trainer(**SETTINGS, cluster="local", devices=2, max_steps=100_000, name="cancel-alone").submit(
        mlp(), data(), loss_fn=SlowLoss())
    run_id = submitted.job["run_id"]
    deadline = time.monotonic() + 120
    while Registry().get_run(run_id)["status"] == "queued":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    # The Cancel of a job asked to stop before (so that the cancel meets a running job, not one stopping)
    assert stop_job(Registry(), {**Registry().get_run(run_id), "stop_requested": True}, by="gpunb.stop")
    spec = job_spec.load(submitted.job["folder"])
    while spec.backend.state(spec)[0] not in ENDED:  # its ranks end, and say what they say
        assert time.monotonic() < deadline
        time.sleep(0.1)
    row = Registry().get_run(run_id, with_history=False)
    assert (row["status"], row["stop_reason"], row["error"]) == ("cancelled", "cancelled from gpunb.stop", None)
    assert gpunb.attach("cancel-alone").stop_reason == "cancelled from gpunb.stop"


def dropout_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 3))


def users_loader():
    """The user's own shuffled DataLoader: its order drawn from torch's RNG when each epoch begins."""
    from torch.utils.data import DataLoader, TensorDataset
    return DataLoader(TensorDataset(*data()), batch_size=16, shuffle=True)


def test_a_job_preempted_mid_epoch_resumes_a_users_dataloader_exactly(tmp_path):
    """8 batches an epoch: preempted at the 12th forward (2 are the checks'), mid-way through the
    second epoch, whose order and Dropout masks the requeued job draws as the kernel's run does."""
    model = dropout_mlp()
    hook = model.register_forward_pre_hook(PreemptOnce(12, tmp_path / "preempted"))
    result = Trainer(**SETTINGS, cluster="local", max_steps=40, name="preempted-loader").fit(
        model, users_loader(), loss_fn=nn.CrossEntropyLoss())
    hook.remove()
    assert result.status == "completed" and result.steps == 40
    assert result.resumed_from is not None and result.resumed_from["step"] % 8 != 0  # mid-epoch
    straight = dropout_mlp()
    Trainer(**SETTINGS, max_steps=40, track=False).fit(straight, users_loader(), loss_fn=nn.CrossEntropyLoss())
    assert weights_equal(model, straight)
