"""REST handlers under `<base_url>/gpunb/api/`: devices, runs (and the sweeps they are trials of), one
run (read, delete), stop a run, stop a sweep.

NVML and SQLite calls block, so each one runs in a worker thread, never on the
server's event loop, and the two kinds run in separate thread pools: a registry
locked by another process never delays `GET devices`. Every request opens its own
short-lived registry connection and waits `REGISTRY_WAIT_S` at most for a lock. A
locked registry answers 503, a damaged one 500, each with a JSON message that says
what is wrong and what to do. Every verb requires an authenticated user.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
from concurrent.futures import ThreadPoolExecutor

from gpunb import telemetry
from gpunb.errors import GpunbError
from gpunb.runs import Registry, RegistryDamaged, RegistryLocked, default_path
from gpunb.runs.liveness import whereabouts

LAB_HINT = "`pip install gpunb[lab]` (JupyterLab and the Jupyter server behind the GPU sidebar)"

try:
    from jupyter_server.base.handlers import APIHandler
    from jupyter_server.utils import url_path_join
    from tornado import web
except ImportError as error:
    raise GpunbError(f"The gpunb server extension needs jupyter_server, which cannot be imported ({error}).",
                     LAB_HINT) from error

from .kernels import annotate_processes, kernel_notebooks, kernel_root_pids, with_children

RUN_ID = re.compile(r"[0-9a-f]{32}")
REGISTRY_WAIT_S = 2.0  # a request waits this long at most for another process's write lock


class GpunbHandler(APIHandler):
    @property
    def registry(self) -> Registry:
        # A fresh object per request: its operations open and close their own connections.
        return Registry(self.settings["gpunb_registry_path"], timeout=self.settings["gpunb_registry_wait_s"],
                        keep_open=False)

    async def in_thread(self, pool: str, function, *args):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.settings["gpunb_pools"][pool], function, *args)

    async def registry_call(self, function, *args):
        """`function(registry, *args)` in the registry pool; registry errors become JSON answers."""
        try:
            return await self.in_thread("registry", function, self.registry, *args)
        except RegistryLocked as error:
            raise web.HTTPError(503, str(error), reason="Run registry locked") from error
        except RegistryDamaged as error:
            raise web.HTTPError(500, str(error), reason="Run registry damaged") from error

    def reply(self, body, status: int = 200) -> None:
        self.set_status(status)
        self.finish(json.dumps(body))

    def checked_run_id(self, run_id: str) -> str:
        if not RUN_ID.fullmatch(run_id):
            raise web.HTTPError(400, f"A run id is 32 lowercase hex characters; got {run_id[:64]!r}.")
        return run_id


def _devices(roots: dict[int, str], notebooks: dict[str, str]) -> dict:
    return annotate_processes(telemetry.snapshot(), with_children(roots), notebooks)


class DevicesHandler(GpunbHandler):
    @web.authenticated
    async def get(self):
        roots = kernel_root_pids(self.kernel_manager)
        notebooks = await kernel_notebooks(self.session_manager)
        self.reply(await self.in_thread("nvml", _devices, roots, notebooks))


class RunsHandler(GpunbHandler):
    @web.authenticated
    async def get(self):
        runs, sweeps = await self.registry_call(_runs_and_sweeps)
        self.reply({"runs": runs, "sweeps": sweeps})


class RunHandler(GpunbHandler):
    @web.authenticated
    async def get(self, run_id: str):
        run_id = self.checked_run_id(run_id)
        run = await self.registry_call(Registry.get_run, run_id)
        if run is None:
            raise web.HTTPError(404, f"No run with id {run_id}.")
        self.reply(_eta_now(run))

    @web.authenticated
    async def delete(self, run_id: str):
        run_id = self.checked_run_id(run_id)
        removed, run = await self.registry_call(_remove, run_id)
        if removed:
            self.set_status(204)
            self.finish()
        elif run is None:
            raise web.HTTPError(404, f"No run with id {run_id}.")
        else:
            raise web.HTTPError(409, f"Run {run_id} is running ({run['where']}); stop it before removing it.")


def _runs_and_sweeps(registry: Registry) -> tuple[list[dict], list[dict]]:
    """The runs, and one card per sweep that any of them is a trial of (runs/sweep_cards.py)."""
    from gpunb.runs.sweep_cards import sweep_cards

    runs = _list_runs(registry)
    return runs, sweep_cards(registry, runs)


def _list_runs(registry: Registry) -> list[dict]:
    runs = registry.list_runs(series=True)  # running runs carry their newest losses: one request a poll
    if any(run.get("job") and run["status"] == "queued" for run in runs):
        from gpunb.jobs.lookup import refresh_waiting

        runs = refresh_waiting(registry, runs)  # Slurm's state and reason of waiting jobs, no kernel needed
    for run in runs:
        _eta_now(run)
    return runs


def _eta_now(run: dict) -> dict:
    """The ETA counted down from the row's last write to now, by this machine's clock (the run's, or
    one that shares its registry), not the browser's, which may be set otherwise."""
    if run.get("eta_s") is not None and run.get("updated_at"):
        run["eta_s"] = max(0.0, run["eta_s"] - max(0.0, time.time() - run["updated_at"]))
    return run


def _remove(registry: Registry, run_id: str) -> tuple[bool, dict | None]:
    """(removed, the run when it was kept because it lives). Read again after a refused delete:
    the run read before it may have been removed by a concurrent request meanwhile (then 404)."""
    if registry.get_run(run_id, with_history=False) is None:  # first marks it failed if its process died
        return False, None
    if registry.remove([run_id]):
        return True, None
    run = registry.get_run(run_id, with_history=False)
    if run is not None:
        run["where"] = whereabouts(run, socket.gethostname(), time.time())
    return False, run


def _request_stop(registry: Registry, run_id: str) -> tuple[bool, dict | None]:
    run = registry.get_run(run_id, with_history=False)
    if run is not None and run.get("job"):  # a job: stop, and a second request cancels it (gpunb.jobs)
        from gpunb.jobs.lookup import stop_job

        return stop_job(registry, run), registry.get_run(run_id, with_history=False)
    if registry.request_stop(run_id):
        return True, None
    return False, registry.get_run(run_id, with_history=False)


class StopHandler(GpunbHandler):
    @web.authenticated
    async def post(self, run_id: str):
        run_id = self.checked_run_id(run_id)
        accepted, run = await self.registry_call(_request_stop, run_id)
        if accepted:
            self.reply({"id": run_id, "stop_requested": True}, status=202)
        elif run is None:
            raise web.HTTPError(404, f"No run with id {run_id}.")
        else:
            raise web.HTTPError(409, f"Run {run_id} is {run['status']}; only a running run can be stopped.")


def _stop_sweep(registry: Registry, name: str) -> bool | None:
    """True: asked; False: the sweep has ended; None: no sweep of that name."""
    from gpunb.jobs.lookup import stop_sweep

    if not registry.sweep_runs(name):
        return None
    return stop_sweep(registry, name)


class SweepStopHandler(GpunbHandler):
    @web.authenticated
    async def post(self, name: str):
        accepted = await self.registry_call(_stop_sweep, name)
        if accepted:
            self.reply({"sweep": name, "stop_requested": True}, status=202)
        elif accepted is None:
            raise web.HTTPError(404, f"No sweep named {name!r}.")
        else:
            raise web.HTTPError(409, f"Sweep {name!r} has ended (all its trials, or stopped before); "
                                     "there is nothing to stop.")


def setup_handlers(web_app) -> None:
    settings = web_app.settings
    settings["gpunb_registry_path"] = default_path()  # $GPUNB_HOME/runs.sqlite, created on first use
    settings.setdefault("gpunb_registry_wait_s", REGISTRY_WAIT_S)
    # Separate pools: requests stuck on a locked registry never hold up NVML snapshots.
    settings["gpunb_pools"] = {"nvml": ThreadPoolExecutor(2, thread_name_prefix="gpunb-nvml"),
                               "registry": ThreadPoolExecutor(4, thread_name_prefix="gpunb-registry")}
    api = url_path_join(web_app.settings["base_url"], "gpunb", "api")
    web_app.add_handlers(
        ".*$",
        [
            (url_path_join(api, "devices"), DevicesHandler),
            (url_path_join(api, "runs"), RunsHandler),
            (url_path_join(api, "runs", r"([^/]+)"), RunHandler),
            (url_path_join(api, "runs", r"([^/]+)", "stop"), StopHandler),
            (url_path_join(api, "sweeps", r"([^/]+)", "stop"), SweepStopHandler),
        ],
    )
