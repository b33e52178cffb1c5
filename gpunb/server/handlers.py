"""REST handlers under `<base_url>/gpunb/api/`: devices, runs, one run, stop a run.

NVML and SQLite calls block, so each one runs in a worker thread, never on the
server's event loop. Every verb requires an authenticated user. One `Registry` serves
the whole server: it opens a short-lived connection per call, so threads may share it.
"""

from __future__ import annotations

import asyncio
import json
import re

from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join
from tornado import web

from gpunb import telemetry
from gpunb.runs import Registry

from .kernels import annotate_processes, kernel_notebooks, kernel_root_pids, with_children

RUN_ID = re.compile(r"[0-9a-f]{32}")


class GpunbHandler(APIHandler):
    @property
    def registry(self) -> Registry:
        return self.settings["gpunb_registry"]

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
        self.reply(await asyncio.to_thread(_devices, roots, notebooks))


class RunsHandler(GpunbHandler):
    @web.authenticated
    async def get(self):
        runs = await asyncio.to_thread(self.registry.list_runs)
        self.reply({"runs": runs})


class RunHandler(GpunbHandler):
    @web.authenticated
    async def get(self, run_id: str):
        run_id = self.checked_run_id(run_id)
        run = await asyncio.to_thread(self.registry.get_run, run_id, with_history=True)
        if run is None:
            raise web.HTTPError(404, f"No run with id {run_id}.")
        self.reply(run)


def _request_stop(registry: Registry, run_id: str) -> tuple[bool, dict | None]:
    if registry.request_stop(run_id):
        return True, None
    return False, registry.get_run(run_id, with_history=False)


class StopHandler(GpunbHandler):
    @web.authenticated
    async def post(self, run_id: str):
        run_id = self.checked_run_id(run_id)
        accepted, run = await asyncio.to_thread(_request_stop, self.registry, run_id)
        if accepted:
            self.reply({"id": run_id, "stop_requested": True}, status=202)
        elif run is None:
            raise web.HTTPError(404, f"No run with id {run_id}.")
        else:
            raise web.HTTPError(409, f"Run {run_id} is {run['status']}; only a running run can be stopped.")


def setup_handlers(web_app) -> None:
    web_app.settings["gpunb_registry"] = Registry()  # $GPUNB_HOME/runs.sqlite, opened on first use
    api = url_path_join(web_app.settings["base_url"], "gpunb", "api")
    web_app.add_handlers(
        ".*$",
        [
            (url_path_join(api, "devices"), DevicesHandler),
            (url_path_join(api, "runs"), RunsHandler),
            (url_path_join(api, "runs", r"([^/]+)"), RunHandler),
            (url_path_join(api, "runs", r"([^/]+)", "stop"), StopHandler),
        ],
    )
