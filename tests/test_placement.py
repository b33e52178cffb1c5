"""The TrainConfig a user gave reaches every process of the run unchanged, and is what the run
registry records; how a process is placed travels beside it (gpunb/runtime/placement.py).

The first tests read the code: no module outside gpunb/config.py assigns or `replace`s a field of a
TrainConfig. The others run a launched run and a local job and compare their registry rows with
the config the user gave.
"""

import ast
import dataclasses
import sys
import time
from pathlib import Path

import cloudpickle
import pytest
from conftest import classification_data, mlp
from torch import nn

import gpunb
from gpunb import TrainConfig, Trainer
from gpunb.runs import Registry
from gpunb.runs.registry import json_safe

PACKAGE = Path(__file__).resolve().parent.parent / "gpunb"
FIELDS = {f.name for f in dataclasses.fields(TrainConfig)}

# (module, the fields it sets) of the changed copies that steer no process of the user's run. This
# list only shrinks.
ALLOWED = {
    # The probes' trial stepper takes one micro-batch per step (the batch-size probe and the LR
    # finder time single batches), then is thrown away with its rewind.
    ("gpunb.runtime.probes.batch_size", ("grad_accum",)),
    ("gpunb.runtime.probes.lr_find", ("grad_accum",)),
    # The user's own keywords and flags on the user's config: building it, before any run.
    ("gpunb.trainer", ("**",)),
    ("gpunb.config_flags", ("**",)),
    # %gpuprofile's session is a run of its own (a few steps, one process, no checkpoints, recorded
    # nowhere) made from the user's config; the user's run is not it.
    ("gpunb.profiling.api", ("**",)),
    # A sweep's packing measures each trial before placing it: a dry run of the trial's config on
    # the CPU (one process, nothing resumed, within the GPU's budget); the trial's job gets its own.
    ("gpunb.sweeps.packing", ("accelerator", "devices", "memory_budget", "precision", "resume")),
}


def _dotted(node) -> str:
    """`args.config` for an Attribute chain of Names, '' for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return ""


def _is_config(node) -> bool:
    name = _dotted(node).rsplit(".", 1)[-1].lower()
    return name.endswith("config") or name.endswith("cfg")


def _set_fields(call: ast.Call) -> tuple:
    return tuple(sorted(k.arg if k.arg else "**" for k in call.keywords))


def rewrites(tree: ast.AST) -> list:
    """(line, fields) of each place in `tree` that changes a TrainConfig: `x.replace(field=...)` (the
    config's own method; str.replace takes no keywords), `dataclasses.replace(config, ...)`,
    `make_config(config, field=...)`, `config.field = ...` and `setattr(config, ...)`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr == "replace" and node.keywords \
                    and _dotted(func.value) != "dataclasses":
                found.append((node.lineno, _set_fields(node)))
            elif _dotted(func) in ("replace", "dataclasses.replace") and node.args and _is_config(node.args[0]):
                found.append((node.lineno, _set_fields(node)))
            elif _dotted(func).endswith("make_config") and node.keywords and node.args \
                    and not (isinstance(node.args[0], ast.Constant) and node.args[0].value is None):
                found.append((node.lineno, _set_fields(node)))  # a config given, with fields changed
            elif _dotted(func) in ("setattr", "object.__setattr__") and node.args and _is_config(node.args[0]):
                found.append((node.lineno, ("setattr",)))
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for part in ast.walk(target):
                    if isinstance(part, ast.Attribute) and part.attr in FIELDS and _is_config(part.value):
                        found.append((node.lineno, (part.attr,)))
    return found


def config_rewrites() -> set:
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "config.py":
            continue
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        for line, fields in rewrites(ast.parse(path.read_text(), filename=str(path))):
            found.add((module, line, fields))
    return found


def test_no_module_outside_config_py_rewrites_a_trainconfig():
    unexpected = sorted((m, line, f) for m, line, f in config_rewrites() if (m, f) not in ALLOWED)
    assert not unexpected, ("a TrainConfig changed outside gpunb/config.py (place the process with "
                            "runtime.placement.Placement instead):\n"
                            + "\n".join(f"  {m}:{line} sets {', '.join(f)}" for m, line, f in unexpected))


def test_the_allowed_copies_are_still_there():
    """An allowed copy that is gone is taken off ALLOWED, so that it cannot come back unseen."""
    assert ALLOWED <= {(m, f) for m, _, f in config_rewrites()}


@pytest.mark.parametrize("source", [
    "config = args.config.replace(**_job_settings(args.config, spec))\n",
    "args = FitArgs(config.replace(track=False), model)\n",
    "config = dataclasses.replace(config, devices=1)\n",
    "from dataclasses import replace\nconfig = replace(self.config, cluster=None)\n",
    "config.track = False\n",
    "self.config.devices = 1\n",
    "object.__setattr__(config, 'devices', 1)\n",
    "setattr(state.config, 'nodes', 1)\n",
    "config = make_config(config, track=False, devices=1)\n",
])
def test_a_rewrite_is_seen(source):
    assert rewrites(ast.parse(source))


@pytest.mark.parametrize("source", [
    "text = name.replace('-', '_')\n",
    "os.replace(temporary, target)\n",
    "plan = replace(plan, strategy='ddp')\n",
    "choice = choice._replace(size=4)\n",
    "model.config.use_cache = False\n",  # a Hugging Face model's config, not a TrainConfig field
    "config = make_config(None, **given)\n",  # a new config, from nothing
])
def test_what_is_not_a_trainconfig_is_left_alone(source):
    assert not rewrites(ast.parse(source))


# --------------------------------------------------------------------------- what the registry records

# Filled in by the run's plan (runtime/plan.py RunPlan.settings): the config as the run used it.
DECIDED = {"batch_size", "precision", "log_every", "epochs", "max_steps", "strategy"}


def assert_recorded_as_given(run: dict, config: TrainConfig) -> None:
    given = json_safe(config.to_dict())
    recorded = run["config"]
    assert {k: recorded.get(k) for k in given if k not in DECIDED} == {k: v for k, v in given.items()
                                                                      if k not in DECIDED}
    assert recorded["max_steps"] == config.max_steps and recorded["batch_size"] == config.batch_size


def test_a_launched_run_records_the_config_as_the_user_gave_it():
    config = TrainConfig(devices=2, accelerator="cpu", batch_size=16, log_every=2, max_steps=4, seed=0,
                         name="launched")
    result = Trainer(config).fit(mlp(), classification_data(n=64), loss_fn=nn.CrossEntropyLoss())
    assert result.world_size == 2 and result.status == "completed"
    (run,) = Registry().list_runs()
    assert_recorded_as_given(run, config)
    assert run["config"]["devices"] == 2 and run["config"]["track"] is True and run["config"]["cluster"] is None
    assert run["device"] == str(result.device) == "cpu"  # what it trained on


# The job's processes import nothing from the tests.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _ended(run_id: str, timeout: float = 240.0) -> dict:
    """The job's registry row once its recorder wrote the run's end (its own status)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = Registry().get_run(run_id, with_history=False)
        if run["status"] not in ("queued", "running"):
            return run
        time.sleep(0.2)
    raise AssertionError(f"the job's run {run_id} did not end within {timeout} s: {run}")


def test_a_detached_two_task_job_records_the_config_as_given_and_its_state_to_the_end(tmp_path, monkeypatch):
    pytest.importorskip("submitit")
    monkeypatch.chdir(tmp_path)  # a logger with nowhere else to write uses ./gpunb_logs
    from gpunb.jobs import spec as job_spec
    from gpunb.jobs.backends.base import ENDED

    config = TrainConfig(cluster="local", devices=2, accelerator="cpu", batch_size=16, log_every=4, max_steps=8,
                         seed=0, name="detached", loggers=("csv",))
    submitted = Trainer(config).submit(mlp(), classification_data(n=128), loss_fn=nn.CrossEntropyLoss())
    spec = job_spec.load(submitted.job["folder"])
    run = _ended(spec.run_id)
    deadline = time.monotonic() + 60
    while spec.backend.state(spec)[0] not in ENDED and time.monotonic() < deadline:
        time.sleep(0.2)  # the job's processes leave: nobody follows it now
    run = Registry().get_run(spec.run_id, with_history=False)
    assert run["status"] == "completed" and run["job"]["state"] == "COMPLETED"  # written by the job itself
    assert_recorded_as_given(run, config)
    assert run["config"]["cluster"] == "local" and run["config"]["devices"] == 2
    assert run["config"]["nodes"] == 1 and run["config"]["track"] is True
    assert run["config"]["checkpoint_dir"] is None  # the checkpoints went to the job's folder all the same
    assert list((Path(spec.folder) / "checkpoints").rglob("*.pt"))
    assert list((Path(spec.folder) / "checkpoints" / "logs").rglob("*.csv"))  # and its logs beside them
    result = gpunb.attach("detached")  # a follower replays the job's start, then its end
    assert result.status == "completed" and result.world_size == 2
    run = Registry().get_run(spec.run_id, with_history=False)
    assert run["job"]["state"] == "COMPLETED" and run["status"] == "completed"
    assert run["device"] == str(result.device) == "cpu"  # what it trained on
