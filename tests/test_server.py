"""The server extension's REST API (gpunb/server/), through a real Jupyter server.

NVML is faked at the pynvml function boundary, so these run on any machine.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import time
from types import SimpleNamespace

import psutil
import pynvml
import pytest
from tornado.httpclient import HTTPClientError

from gpunb.runs import Registry
from gpunb.telemetry import nvml

pytest_plugins = ("pytest_jupyter.jupyter_server",)

GIB = 1024**3
TOKEN = "gpunb-test-token"
RUN_ROUTES = [("GET", "runs/{}"), ("POST", "runs/{}/stop"), ("DELETE", "runs/{}")]
REGISTRY_WAIT_S = 1.5  # how long the server waits for a locked registry in these tests
ALL_ROUTES = [("GET", "devices"), ("GET", "runs"), *RUN_ROUTES]


@pytest.fixture(autouse=True)
def gpunb_home(tmp_path, monkeypatch):
    # Set before the server starts: the extension opens $GPUNB_HOME/runs.sqlite.
    monkeypatch.setenv("GPUNB_HOME", str(tmp_path / "gpunb"))
    return tmp_path / "gpunb"


@pytest.fixture
def jp_server_config(jp_server_config):
    return {
        "ServerApp": {"jpserver_extensions": {"gpunb": True}, "allow_unauthenticated_access": False,
                      "tornado_settings": {"gpunb_registry_wait_s": REGISTRY_WAIT_S}},
        "IdentityProvider": {"token": TOKEN},
    }


@pytest.fixture
def registry(gpunb_home):
    return Registry(gpunb_home / "runs.sqlite")


@pytest.fixture
def running_run(registry):
    run_id = registry.start_run("mnist", total_steps=100, notebook="work/mnist.ipynb")
    for step, loss in [(10, 2.0), (20, 1.2), (30, 0.7)]:
        registry.add_metrics(run_id, step, {"loss": loss})
    registry.update(run_id, step=30, progress=0.3, eta_s=12.5, latest={"loss": 0.7})
    return run_id


def fetch(jp_fetch, method, *parts, **kwargs):
    if method == "POST":
        kwargs.setdefault("body", b"{}")
    return jp_fetch("gpunb", "api", *parts, method=method, **kwargs)


async def fetch_json(jp_fetch, method, *parts, **kwargs):
    response = await fetch(jp_fetch, method, *parts, **kwargs)
    return response.code, json.loads(response.body)


async def expect_error(jp_fetch, code, method, *parts, **kwargs):
    with pytest.raises(HTTPClientError) as error:
        await fetch(jp_fetch, method, *parts, **kwargs)
    assert error.value.code == code
    return error.value


# --------------------------------------------------------------------- NVML fakes
def fake_nvml(monkeypatch, processes=()):
    """One H100 whose PCIe counters are not supported, running `processes` (pid, MiB)."""
    def not_supported(*args):
        raise pynvml.NVMLError_NotSupported()

    fakes = {
        "nvmlInit": lambda: None,
        "nvmlDeviceGetCount": lambda: 1,
        "nvmlSystemGetDriverVersion": lambda: "560.35.03",
        "nvmlDeviceGetHandleByIndex": lambda index: f"handle-{index}",
        "nvmlDeviceGetName": lambda handle: "NVIDIA H100 80GB HBM3",
        "nvmlDeviceGetUUID": lambda handle: "GPU-1234",
        "nvmlDeviceGetUtilizationRates": lambda handle: SimpleNamespace(gpu=87, memory=41),
        "nvmlDeviceGetMemoryInfo": lambda handle: SimpleNamespace(used=20 * GIB, total=80 * GIB),
        "nvmlDeviceGetPowerUsage": lambda handle: 312_000,  # mW
        "nvmlDeviceGetEnforcedPowerLimit": lambda handle: 700_000,
        "nvmlDeviceGetTemperature": lambda handle, sensor: 61,
        "nvmlDeviceGetClockInfo": lambda handle, clock: 1980,
        "nvmlDeviceGetPcieThroughput": not_supported,
        "nvmlDeviceGetMigMode": not_supported,
        "nvmlDeviceGetTotalEnergyConsumption": lambda handle: 5_000_000,  # mJ
        "nvmlDeviceGetComputeRunningProcesses": lambda handle: [
            SimpleNamespace(pid=pid, usedGpuMemory=mib * 1024**2) for pid, mib in processes],
    }
    for name, fake in fakes.items():
        monkeypatch.setattr(pynvml, name, fake)
    # NVML initialises once per process; start this test from scratch.
    monkeypatch.setattr(nvml, "_initialised", False)
    monkeypatch.setattr(nvml, "_init_error", None)


def no_nvml(monkeypatch):
    def missing_library():
        raise pynvml.NVMLError_LibraryNotFound()

    monkeypatch.setattr(pynvml, "nvmlInit", missing_library)
    monkeypatch.setattr(nvml, "_initialised", False)
    monkeypatch.setattr(nvml, "_init_error", None)


# --------------------------------------------------------------------- devices
async def test_devices_without_gpu_reports_host(jp_fetch, monkeypatch):
    no_nvml(monkeypatch)
    code, body = await fetch_json(jp_fetch, "GET", "devices")
    assert code == 200
    assert body["nvidia"] is False and body["gpus"] == []
    assert "driver" in body["reason"]
    assert body["host"]["ram_total_mb"] > 0 and body["host"]["cpu_count"] >= 1


async def test_devices_with_fake_gpu(jp_fetch, monkeypatch):
    fake_nvml(monkeypatch, processes=[(999_999_999, 512)])
    code, body = await fetch_json(jp_fetch, "GET", "devices")
    assert code == 200 and body["nvidia"] is True and body["driver"] == "560.35.03"
    (gpu,) = body["gpus"]
    assert gpu["name"] == "NVIDIA H100 80GB HBM3" and gpu["uuid"] == "GPU-1234"
    assert gpu["utilization_gpu"] == 87 and gpu["memory_total_mb"] == 80 * 1024
    assert gpu["power_w"] == 312 and gpu["power_limit_w"] == 700 and gpu["temperature_c"] == 61
    assert "pcie_tx_kbps" not in gpu and "pcie_rx_kbps" not in gpu  # NVMLError_NotSupported
    # A process that is none of this server's kernels gets no kernel or notebook.
    assert gpu["processes"] == [{"pid": 999_999_999, "used_memory_mb": 512}]


async def test_devices_list_mig_instances_as_devices_with_their_memory(jp_fetch, monkeypatch):
    fake_nvml(monkeypatch)
    migs = {0: "MIG-aaaa", 1: "MIG-bbbb"}

    def mig_handle(handle, index):
        if index not in migs:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return f"mig-{index}"

    fakes = {
        "nvmlDeviceGetMigMode": lambda handle: (pynvml.NVML_DEVICE_MIG_ENABLE, pynvml.NVML_DEVICE_MIG_ENABLE),
        "nvmlDeviceGetMaxMigDeviceCount": lambda handle: 7,
        "nvmlDeviceGetMigDeviceHandleByIndex": mig_handle,
        "nvmlDeviceGetName": lambda h: "NVIDIA H100 MIG 3g.40gb" if h.startswith("mig") else "NVIDIA H100 80GB HBM3",
        "nvmlDeviceGetUUID": lambda h: migs[int(h[-1])] if h.startswith("mig") else "GPU-1234",
        "nvmlDeviceGetMemoryInfo": lambda h: SimpleNamespace(used=GIB, total=(40 if h.startswith("mig") else 80) * GIB),
    }
    for name, fake in fakes.items():
        monkeypatch.setattr(pynvml, name, fake)
    code, body = await fetch_json(jp_fetch, "GET", "devices")
    assert code == 200
    assert [(g["index"], g.get("parent_index"), g["uuid"]) for g in body["gpus"]] == [
        (0, None, "GPU-1234"), ("0:0", 0, "MIG-aaaa"), ("0:1", 0, "MIG-bbbb")]
    assert body["gpus"][2]["name"] == "NVIDIA H100 MIG 3g.40gb" and body["gpus"][2]["memory_total_mb"] == 40 * 1024


async def test_devices_maps_gpu_processes_to_kernels_and_notebooks(jp_fetch, jp_serverapp, monkeypatch):
    response = await jp_fetch("api", "sessions", method="POST", body=json.dumps(
        {"path": "work/train.ipynb", "type": "notebook", "name": "train.ipynb", "kernel": {"name": "python3"}}))
    session = json.loads(response.body)
    kernel_id = session["kernel"]["id"]
    kernel = jp_serverapp.kernel_manager.get_kernel(kernel_id)
    kernel_pid = kernel.provisioner.pid
    # A child of the kernel (as a DataLoader worker or a DDP rank would be) counts as the kernel.
    client = kernel.client()
    client.start_channels()
    try:
        await client.wait_for_ready(timeout=60)
        await client.execute_interactive(
            "import subprocess, sys\n"
            "worker = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])",
            timeout=30)
    finally:
        client.stop_channels()
    (worker,) = psutil.Process(kernel_pid).children()
    try:
        fake_nvml(monkeypatch, processes=[(kernel_pid, 1000), (worker.pid, 200), (999_999_999, 30)])
        _, body = await fetch_json(jp_fetch, "GET", "devices")
    finally:
        worker.kill()
        await jp_serverapp.kernel_manager.shutdown_kernel(kernel_id, now=True)
    processes = {p["pid"]: p for p in body["gpus"][0]["processes"]}
    for pid in (kernel_pid, worker.pid):
        assert processes[pid]["kernel_id"] == kernel_id
        assert processes[pid]["notebook"] == "work/train.ipynb"
    assert "kernel_id" not in processes[999_999_999]


# --------------------------------------------------------------------- runs
async def test_runs_lists_recorded_runs(jp_fetch, registry, running_run):
    done = registry.start_run("tiny", total_steps=10)
    registry.finish(done, "completed")
    code, body = await fetch_json(jp_fetch, "GET", "runs")
    assert code == 200
    assert [run["name"] for run in body["runs"]] == ["tiny", "mnist"]  # newest first
    mnist = body["runs"][1]
    assert mnist["id"] == running_run and mnist["status"] == "running"
    assert mnist["progress"] == 0.3 and mnist["latest"] == {"loss": 0.7}
    assert mnist["notebook"] == "work/mnist.ipynb" and mnist["stop_requested"] is False
    # Running runs carry their newest losses, so one request a poll draws every sparkline.
    assert mnist["losses"] == [[10, 2.0], [20, 1.2], [30, 0.7]] and "losses" not in body["runs"][0]


async def test_the_eta_is_counted_down_to_now_by_the_servers_clock(jp_fetch, registry):
    # the browser's clock may be set otherwise: the server says how much is left as it answers
    run_id = registry.start_run("slow", total_steps=100)
    registry.update(run_id, step=10, eta_s=100.0)
    with sqlite3.connect(registry.path) as db:
        db.execute("UPDATE runs SET updated_at = ? WHERE id = ?", (time.time() - 30, run_id))
    (listed,) = (await fetch_json(jp_fetch, "GET", "runs"))[1]["runs"]
    detail = (await fetch_json(jp_fetch, "GET", "runs", run_id))[1]
    assert 69 < listed["eta_s"] <= 70 and 69 < detail["eta_s"] <= 70


async def test_runs_is_empty_without_a_registry_file(jp_fetch, gpunb_home):
    code, body = await fetch_json(jp_fetch, "GET", "runs")
    assert (code, body) == (200, {"runs": [], "sweeps": []})


async def test_run_detail_has_history(jp_fetch, running_run):
    code, body = await fetch_json(jp_fetch, "GET", "runs", running_run)
    assert code == 200 and body["id"] == running_run and 11.5 < body["eta_s"] <= 12.5  # as of now
    assert [(row["step"], row["loss"]) for row in body["history"]] == [(10, 2.0), (20, 1.2), (30, 0.7)]


async def test_run_detail_unknown_is_404(jp_fetch):
    error = await expect_error(jp_fetch, 404, "GET", "runs", "0" * 32)
    assert "No run with id" in json.loads(error.response.body)["message"]


async def test_stop_requests_a_clean_stop(jp_fetch, registry, running_run):
    code, body = await fetch_json(jp_fetch, "POST", "runs", running_run, "stop")
    assert code == 202 and body == {"id": running_run, "stop_requested": True}
    assert registry.stop_requested(running_run)
    _, run = await fetch_json(jp_fetch, "GET", "runs", running_run)
    assert run["stop_requested"] is True and run["status"] == "running"  # until the loop notices


async def test_stop_unknown_run_is_404(jp_fetch):
    await expect_error(jp_fetch, 404, "POST", "runs", "f" * 32, "stop")


async def test_stop_finished_run_is_409(jp_fetch, registry):
    run_id = registry.start_run("done")
    registry.finish(run_id, "completed")
    error = await expect_error(jp_fetch, 409, "POST", "runs", run_id, "stop")
    assert "completed" in json.loads(error.response.body)["message"]
    assert not registry.stop_requested(run_id)


async def test_delete_removes_a_finished_run_and_its_metrics(jp_fetch, registry):
    run_id = registry.start_run("done")
    registry.add_metrics(run_id, 1, {"loss": 1.0})
    registry.finish(run_id, "completed")
    response = await fetch(jp_fetch, "DELETE", "runs", run_id)
    assert response.code == 204
    assert registry.get_run(run_id) is None and registry.list_runs() == []
    await expect_error(jp_fetch, 404, "DELETE", "runs", run_id)


async def test_delete_refuses_a_running_run(jp_fetch, registry, running_run):
    error = await expect_error(jp_fetch, 409, "DELETE", "runs", running_run)
    message = json.loads(error.response.body)["message"]
    assert "stop it before removing it" in message and "on this host" in message
    assert registry.get_run(running_run)["status"] == "running"


async def test_a_delete_that_loses_the_race_to_another_delete_answers_404(jp_fetch, registry, monkeypatch):
    run_id = registry.start_run("done")
    registry.finish(run_id, "completed")
    real_remove = Registry.remove

    def remove_after_a_concurrent_request(self, run_ids):
        monkeypatch.setattr(Registry, "remove", real_remove)
        real_remove(Registry(self.path), run_ids)  # the other request gets in between our read and delete
        return real_remove(self, run_ids)

    monkeypatch.setattr(Registry, "remove", remove_after_a_concurrent_request)
    error = await expect_error(jp_fetch, 404, "DELETE", "runs", run_id)
    assert f"No run with id {run_id}" in json.loads(error.response.body)["message"]


async def test_concurrent_deletes_of_a_finished_run_answer_204_once_and_404_after(jp_fetch, registry):
    run_id = registry.start_run("done")
    registry.finish(run_id, "completed")

    async def delete():
        try:
            return (await fetch(jp_fetch, "DELETE", "runs", run_id)).code
        except HTTPClientError as error:
            return error.code

    codes = await asyncio.gather(*(delete() for _ in range(20)))
    assert sorted(codes) == [204] + [404] * 19


# --------------------------------------------------------------------- bad input and auth
BAD_IDS = ["not-a-run", "A" * 32, "0" * 31, "0" * 33, "..", "..%2F..%2Fetc%2Fpasswd", "0" * 31 + "g"]


@pytest.mark.parametrize("bad_id", BAD_IDS)
@pytest.mark.parametrize("method,route", RUN_ROUTES)
async def test_malformed_run_ids_are_rejected(jp_fetch, method, route, bad_id):
    error = await expect_error(jp_fetch, 400, method, *route.format(bad_id).split("/"))
    assert "32 lowercase hex" in json.loads(error.response.body)["message"]


@pytest.mark.parametrize("method,route", ALL_ROUTES)
async def test_every_route_needs_credentials(jp_fetch, registry, running_run, method, route):
    parts = route.format(running_run).split("/")
    await expect_error(jp_fetch, 403, method, *parts, headers={"Authorization": ""})
    assert not registry.stop_requested(running_run) and registry.get_run(running_run) is not None


async def test_blocking_work_runs_off_the_event_loop(jp_fetch, monkeypatch):
    threads = []

    def snapshot():
        threads.append(threading.current_thread())
        return {"time": time.time(), "nvidia": False, "reason": "fake", "host": {}, "gpus": []}

    monkeypatch.setattr("gpunb.telemetry.snapshot", snapshot)
    await fetch(jp_fetch, "GET", "devices")
    assert threads and threads[0] is not threading.main_thread()


# --------------------------------------------------------------------- a locked or damaged registry
def _hold_write_lock(registry) -> sqlite3.Connection:
    registry.list_runs()  # the file exists
    holder = sqlite3.connect(registry.path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # another process writing, or a database browser
    return holder


async def test_devices_answer_while_registry_requests_wait_on_its_lock(jp_fetch, registry, running_run,
                                                                      monkeypatch):
    no_nvml(monkeypatch)
    holder = _hold_write_lock(registry)
    try:
        # More waiting writes than the registry's thread pool has threads.
        stops = [asyncio.ensure_future(fetch(jp_fetch, "POST", "runs", running_run, "stop")) for _ in range(6)]
        await asyncio.sleep(0)
        code, body = await fetch_json(jp_fetch, "GET", "devices")
        assert code == 200 and body["nvidia"] is False
        assert not any(stop.done() for stop in stops)  # still waiting for the lock
        code, body = await fetch_json(jp_fetch, "GET", "runs")  # WAL: reads go on meanwhile
        assert code == 200 and [run["id"] for run in body["runs"]] == [running_run]
        answers = await asyncio.gather(*stops, return_exceptions=True)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert {getattr(answer, "code", None) for answer in answers} == {503}


async def test_a_locked_registry_answers_503_with_a_message(jp_fetch, registry, running_run):
    holder = _hold_write_lock(registry)
    try:
        error = await expect_error(jp_fetch, 503, "POST", "runs", running_run, "stop")
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    body = json.loads(error.response.body)
    assert body["reason"] == "Run registry locked"
    assert f"The run registry {registry.path} is locked" in body["message"] and "try again" in body["message"]
    assert not registry.stop_requested(running_run)


@pytest.mark.parametrize("method,route", [("GET", "runs"), *RUN_ROUTES])
async def test_a_damaged_registry_answers_500_saying_how_to_recover(jp_fetch, gpunb_home, method, route):
    gpunb_home.mkdir()
    path = gpunb_home / "runs.sqlite"
    path.write_bytes(b"not a database " * 200)
    error = await expect_error(jp_fetch, 500, method, *route.format("0" * 32).split("/"))
    body = json.loads(error.response.body)
    assert body["reason"] == "Run registry damaged" and "Unhandled" not in body["message"]
    assert f"The run registry {path} is damaged" in body["message"] and f"mv '{path}'" in body["message"]


def test_extension_points_name_the_server_module():
    from gpunb.server import _jupyter_labextension_paths, _jupyter_server_extension_points

    assert _jupyter_server_extension_points() == [{"module": "gpunb.server"}]
    assert _jupyter_labextension_paths() == [{"src": "labextension", "dest": "gpunb"}]


async def test_a_jobs_first_stop_asks_it_to_stop_and_a_second_cancels_it(jp_fetch, registry, tmp_path):
    import subprocess
    import sys

    from gpunb.jobs.spec import JobSpec

    # A stand-in for a detached job's controller: a process of its own session, as gpunb starts it.
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        folder = tmp_path / "job"
        folder.mkdir()
        spec = JobSpec(run_id="a" * 32, name="job", key=None, cluster="local", folder=str(folder), nodes=1,
                       tasks_per_node=1, gpus_per_node=0, accelerator="cpu", entry="gpunb.trainer:_rank_entry",
                       registry=str(registry.path), job_id=str(process.pid),
                       job_started=psutil.Process(process.pid).create_time())
        spec.save()
        registry.start_run("job", run_id=spec.run_id, job={"cluster": "local", "folder": str(folder), "id": spec.job_id,
                                                           "nodes": 1, "tasks_per_node": 1, "gpus_per_node": 0})
        code, _ = await fetch_json(jp_fetch, "POST", "runs", spec.run_id, "stop")
        assert code == 202 and (folder / "stop").exists() and registry.stop_requested(spec.run_id)
        assert process.poll() is None  # asked to stop, not killed
        _, runs = await fetch_json(jp_fetch, "GET", "runs")
        assert runs["runs"][0]["job"]["cluster"] == "local" and runs["runs"][0]["stop_requested"] is True
        code, _ = await fetch_json(jp_fetch, "POST", "runs", spec.run_id, "stop")
        assert code == 202 and process.wait(10) != 0  # the second stop cancels it
        _, run = await fetch_json(jp_fetch, "GET", "runs", spec.run_id)
        assert run["status"] == "cancelled"
    finally:
        process.kill()
        process.wait()
