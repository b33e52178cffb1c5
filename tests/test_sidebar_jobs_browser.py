"""Jobs in the sidebar, in a real JupyterLab driven in headless Chromium (tests/browser_support.py).

Slurm is faked at its command line: `squeue`, `sacct` and `scancel` on the server's PATH are
scripts of this test that answer for jobs 42 and 43 and log what they were asked. A real
cluster's job 42 (one of another test, say) is never looked at nor cancelled.
"""

from __future__ import annotations

import os
import stat
import time

import pytest
from browser_support import BUILT, chromium_page, jupyter_lab, require_browser

from gpunb.jobs.spec import JobSpec
from gpunb.runs import Registry

pytestmark = pytest.mark.browser

SQUEUE = """#!/bin/sh
echo "squeue $*" >> "{log}"
case "$*" in
  *"-j 42 "*) echo "PENDING|Priority|waiting-job|$(id -u)" ;;
  *"-j 43 "*) echo "RUNNING|None|training-job|$(id -u)" ;;
esac
"""
SACCT = """#!/bin/sh
echo "sacct $*" >> "{log}"
"""
SCANCEL = """#!/bin/sh
echo "scancel $*" >> "{log}"
"""


def _fake_slurm(tmp_path):
    """A folder of squeue/sacct/scancel scripts to put first on PATH, and the log they append to."""
    bin_dir, log = tmp_path / "bin", tmp_path / "slurm.log"
    bin_dir.mkdir()
    log.touch()
    for name, script in (("squeue", SQUEUE), ("sacct", SACCT), ("scancel", SCANCEL)):
        path = bin_dir / name
        path.write_text(script.format(log=log))
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return bin_dir, log


def _job(tmp_path, registry: Registry, name: str, job_id: str, *, nodes: int, gpus: int, status: str,
         state: str, reason: str | None = None) -> tuple[str, JobSpec]:
    """A job's folder (job.json) and its registry row, as gpunb.jobs.submit writes them."""
    run_id = f"{job_id:0>32}"
    folder = tmp_path / "jobs" / f"{name}-{run_id[:8]}"
    folder.mkdir(parents=True)
    spec = JobSpec(run_id=run_id, name=name, key=None, cluster="slurm", folder=str(folder), nodes=nodes,
                   tasks_per_node=gpus, gpus_per_node=gpus, accelerator="cuda", entry="gpunb.trainer:rank_entry",
                   registry=str(registry.path), job_id=job_id)
    spec.save()
    job = {"cluster": "slurm", "id": job_id, "folder": str(folder), "key": None, "nodes": nodes,
           "tasks_per_node": gpus, "gpus_per_node": gpus, "state": state, "reason": reason,
           "submitted_at": time.time()}
    # A running job's row is written by its rank 0; this test's process stands in for it (alive).
    registry.start_run(name, run_id=run_id, status=status, device=f"slurm: {nodes} x {gpus}", job=job,
                       total_steps=1000 if status == "running" else None)
    return run_id, spec


def _wait_for(condition, what: str, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_sidebar_shows_a_waiting_slurm_job_and_cancels_it_and_stops_then_cancels_a_running_one(tmp_path, screenshots):
    require_browser()
    if not (BUILT / "package.json").exists():
        pytest.skip("the sidebar is not built: `pip install -e .` or `cd labextension && jlpm build`")
    screenshots.mkdir(parents=True, exist_ok=True)
    bin_dir, slurm_log = _fake_slurm(tmp_path)
    registry = Registry(tmp_path / "gpunb" / "runs.sqlite")
    waiting_id, waiting = _job(tmp_path, registry, "waiting-job", "42", nodes=2, gpus=4, status="queued",
                               state="PENDING")
    # Started: its row keeps the scheduler's last answer from its wait (nothing writes RUNNING there).
    training_id, training = _job(tmp_path, registry, "training-job", "43", nodes=2, gpus=8, status="running",
                                 state="PENDING", reason="Priority")
    registry.update(training_id, step=250, progress=0.25, latest={"loss": 0.5})
    path = os.pathsep.join([str(bin_dir), os.environ.get("PATH", "")])
    with jupyter_lab(tmp_path, env={"PATH": path}) as url, chromium_page(url) as page:
        page.locator(".jp-SideBar.jp-mod-left [data-id='gpunb-sidebar']").click()
        panel = page.locator("#gpunb-sidebar")

        # The waiting job: queued, where, how large, and Slurm's state and reason (asked of squeue).
        queued = panel.locator(f".jp-gpunb-run[data-run-id='{waiting_id}']")
        queued.locator(".jp-gpunb-job", has_text="(Priority)").wait_for()
        assert queued.get_attribute("data-status") == "queued"
        assert queued.locator(".jp-gpunb-status").inner_text().lower() == "queued"
        assert queued.locator(".jp-gpunb-job").inner_text() == "slurm job 42 · 2 nodes × 4 GPUs · PENDING (Priority)"
        assert "squeue -h -j 42" in slurm_log.read_text()
        assert registry.get_run(waiting_id, with_history=False)["job"]["reason"] == "Priority"  # kept for gpunb.runs()

        # The running job: its size (no stale PENDING from its wait), and the progress of its steps.
        running = panel.locator(f".jp-gpunb-run[data-run-id='{training_id}']")
        assert running.get_attribute("data-status") == "running"
        assert running.locator(".jp-gpunb-job").inner_text() == "slurm job 43 · 2 nodes × 8 GPUs"
        assert "step 250 / 1000" in running.inner_text()
        # Jobs that wait or run come first, ahead of runs that ended.
        assert panel.locator(".jp-gpunb-run").nth(0).get_attribute("data-status") in ("running", "queued")
        page.locator(".jp-Launcher").wait_for()
        page.screenshot(path=screenshots / "sidebar-jobs.png")

        # A waiting job has nothing to stop cleanly: its button cancels it (scancel), after a confirmation.
        cancel = queued.locator(".jp-gpunb-stop")
        assert cancel.inner_text() == "Cancel"
        cancel.click()
        dialog = page.locator(".jp-Dialog")
        assert "leaves the queue" in dialog.inner_text()
        dialog.get_by_role("button", name="Cancel job").click()
        panel.locator(f".jp-gpunb-run[data-run-id='{waiting_id}'][data-status='cancelled']").wait_for()
        # only once Slurm names the id this run's job and user, and scancel is told both too
        assert f"scancel --name=waiting-job --user={os.getuid()} 42" in slurm_log.read_text().splitlines()
        row = registry.get_run(waiting_id, with_history=False)
        assert (row["status"], row["job"]["state"], row["job"]["reason"]) == ("cancelled", "CANCELLED", None)
        assert queued.locator(".jp-gpunb-job").inner_text() == "slurm job 42 · 2 nodes × 4 GPUs"
        assert (waiting.path / "cancelled").exists()  # how the job's follower tells a cancel from a crash
        assert queued.locator(".jp-gpunb-remove").is_visible()

        # A running job: the first Stop asks it to stop at its next step (the registry and its stop file) ...
        stop = running.locator(".jp-gpunb-stop")
        assert stop.inner_text() == "Stop"
        stop.click()
        page.locator(".jp-Dialog").get_by_role("button", name="Stop run").click()
        running.locator(".jp-gpunb-status", has_text="stopping").wait_for()
        assert registry.get_run(training_id, with_history=False)["stop_requested"]
        assert training.stop_path.exists()
        assert "scancel" not in slurm_log.read_text().split("42\n", 1)[1]

        # ... and the button then offers to cancel it now, which a second request does.
        _wait_for(lambda: stop.inner_text() == "Cancel", "the Stop button to become Cancel")
        assert stop.is_enabled()
        page.screenshot(path=screenshots / "sidebar-job-stopping.png")
        stop.click()
        dialog = page.locator(".jp-Dialog")
        assert "newest checkpoint" in dialog.inner_text()
        dialog.get_by_role("button", name="Cancel job").click()
        panel.locator(f".jp-gpunb-run[data-run-id='{training_id}'][data-status='cancelled']").wait_for()
        assert f"scancel --name=training-job --user={os.getuid()} 43" in slurm_log.read_text().splitlines()
        row = registry.get_run(training_id, with_history=False)
        assert (row["status"], row["job"]["state"]) == ("cancelled", "CANCELLED")
        page.screenshot(path=screenshots / "sidebar-jobs-cancelled.png")


def _trial(registry: Registry, sweep: str, number: int, status: str, value: float | None = None,
           stop_reason: str | None = None) -> str:
    """A sweep's trial as its recorder writes it (this test's process stands in for the live one)."""
    tag = {"name": sweep, "trial": number, "trials": 4, "monitor": "val_loss", "direction": "minimize"}
    run_id = registry.start_run(f"{sweep}-t{number}", config={"sweep": tag}, total_steps=1000)
    registry.update(run_id, step=120, progress=0.12, latest={"loss": 0.5, **({"val_loss": value} if value else {})})
    if status != "running":
        registry.finish(run_id, status, stop_reason=stop_reason)
    return run_id


def test_sidebar_shows_a_sweep_as_one_card_with_its_trials_and_stops_the_whole_sweep(tmp_path, screenshots):
    require_browser()
    if not (BUILT / "package.json").exists():
        pytest.skip("the sidebar is not built: `pip install -e .` or `cd labextension && jlpm build`")
    screenshots.mkdir(parents=True, exist_ok=True)
    registry = Registry(tmp_path / "gpunb" / "runs.sqlite")
    alone = registry.start_run("alone", total_steps=1000)
    best = _trial(registry, "lr search", 0, "completed", value=0.4)
    _trial(registry, "lr search", 1, "stopped", value=0.9, stop_reason="pruned by the sweep at step 40 (val_loss=0.9)")
    running = _trial(registry, "lr search", 2, "running")
    with jupyter_lab(tmp_path) as url, chromium_page(url) as page:
        page.locator(".jp-SideBar.jp-mod-left [data-id='gpunb-sidebar']").click()
        panel = page.locator("#gpunb-sidebar")
        card = panel.locator(".jp-gpunb-sweep[data-sweep='lr search']")
        card.wait_for()
        # One card for the sweep, its trials inside (not cards of their own); other runs as before.
        assert card.get_attribute("data-state") == "running"
        assert card.locator(".jp-gpunb-sweep-summary").inner_text() == "2 / 4 trials · best val_loss 0.4 (trial 0)"
        states = [(t.get_attribute("data-run-id"), t.get_attribute("data-state"))
                  for t in card.locator(".jp-gpunb-trial").all()]
        assert [state for _, state in states] == ["complete", "pruned", "running"]
        assert panel.locator(f".jp-gpunb-run[data-run-id='{running}']").count() == 0
        assert panel.locator(f".jp-gpunb-run[data-run-id='{alone}']").count() == 1
        assert "jp-mod-best" in card.locator(f".jp-gpunb-trial[data-run-id='{best}']").get_attribute("class")
        assert card.locator(f".jp-gpunb-trial[data-run-id='{running}'] .jp-gpunb-stop").inner_text() == "Stop"
        page.locator(".jp-Launcher").wait_for()
        page.screenshot(path=screenshots / "sidebar-sweep.png")

        # The sweep's own Stop: after a confirmation, the sweep is asked to stop and its running trial too.
        card.locator(".jp-gpunb-stop-sweep").click()
        dialog = page.locator(".jp-Dialog")
        assert "no more trials" in dialog.inner_text()
        dialog.get_by_role("button", name="Stop sweep").click()
        panel.locator(".jp-gpunb-sweep[data-sweep='lr search'][data-state='stopping']").wait_for()
        assert registry.sweep_stops() == {"lr search": "the sweep was stopped from the sidebar"}
        assert registry.get_run(running, with_history=False)["stop_requested"]
        assert not registry.get_run(alone, with_history=False)["stop_requested"]
        card.locator(f".jp-gpunb-trial[data-run-id='{running}'][data-state='stopping']").wait_for()

        # The trial stops at its next step (its recorder ends the row): the sweep has stopped.
        registry.finish(running, "stopped", stop_reason="stopped from the sidebar")
        panel.locator(".jp-gpunb-sweep[data-sweep='lr search'][data-state='stopped']").wait_for()
        assert card.locator(".jp-gpunb-stop-sweep").count() == 0
