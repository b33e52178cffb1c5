"""MLflowLogger: a run in an MLflow tracking store (a local file store by default)."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname

from gpunb.loggers.base import Logger, final_metrics, flat_config, log_root, require

_STATUS = {"completed": "FINISHED", "stopped": "FINISHED", "interrupted": "KILLED", "failed": "FAILED"}
_BATCH = 1000  # MLflow's limit of metrics in one log_batch


class MLflowLogger(Logger):
    """Params (the flattened config), metrics by step, the final metrics (`final/<name>`),
    and the run ended FINISHED, KILLED (interrupted) or FAILED.

    `tracking_uri`: None is MLFLOW_TRACKING_URI when set, else a file store at `<log root>/mlruns`
    (see TrainConfig.log_dir); view that with
    `MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri <that folder>`.
    `experiment`: the experiment's name.
    """

    def __init__(self, tracking_uri: str | None = None, experiment: str = "gpunb", run_name: str | None = None,
                 tags: dict | None = None):
        require("mlflow", "mlflow")
        self.tracking_uri, self.experiment, self.run_name = tracking_uri, experiment, run_name
        self.tags = dict(tags or {})
        self.run_id = None

    def start(self, state) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = self.uri = self._uri(state.config, state)
        with _file_store_allowed(uri):
            self.client = MlflowClient(tracking_uri=uri)
        found = self.client.get_experiment_by_name(self.experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(self.experiment)
        run = self.client.create_run(experiment_id, run_name=self.run_name or state.run_name, tags=self.tags)
        self.run_id = run.info.run_id
        params = [Param(k, str(v)) for k, v in flat_config(state).items()]
        for i in range(0, len(params), 100):  # MLflow's limit of params in one log_batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def write(self, step: int, metrics: dict, state) -> None:
        self._log(metrics, step)  # a file store writes each call through: nothing waits in memory

    def directory(self, config) -> Path | None:
        """A local file store's folder; a tracking server or database: None (not checked here)."""
        uri = self._uri(config)
        parts = urlparse(uri)
        if parts.scheme == "file":
            return Path(url2pathname(parts.path))
        return Path(uri) if not parts.scheme and "/" in uri else None  # a bare path; "databricks" is not one

    def destination(self) -> str:
        return getattr(self, "uri", None) or "its tracking store"

    def abandon(self) -> None:
        if self.run_id is not None:
            self.client.set_terminated(self.run_id, status="FAILED")  # may fail too: then it stays RUNNING

    def _uri(self, config, state=None) -> str:
        uri = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if uri is None:
            uri = (log_root(config, state).resolve() / "mlruns").as_uri()  # file:///...: a local file store
        return uri

    def finish(self, state, status: str) -> None:
        try:
            if state.result is not None:
                self._log({f"final/{k}": v for k, v in final_metrics(state).items()}, state.step)
        finally:
            self.client.set_terminated(self.run_id, status=_STATUS[status])

    def _log(self, metrics: dict, step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        entries = [Metric(k, v, now, step) for k, v in metrics.items()]
        for i in range(0, len(entries), _BATCH):
            self.client.log_batch(self.run_id, metrics=entries[i:i + _BATCH])


@contextlib.contextmanager
def _file_store_allowed(uri: str):
    """MLflow 3 refuses a file store unless MLFLOW_ALLOW_FILE_STORE is set; a `file:` URI asks for
    one, so allow it while this client creates its store (MLflow keeps the store per URI)."""
    if not uri.startswith("file:") or "MLFLOW_ALLOW_FILE_STORE" in os.environ:
        yield
        return
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    try:
        yield
    finally:
        os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)
