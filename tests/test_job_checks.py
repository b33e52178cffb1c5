"""What a job is checked for before anything is written or sent to Slurm, and what a Stop may
reach: Slurm settings that would break out of their line of the sbatch script are refused on
every way in; the script made from legitimate ones keeps every directive; an unreachable Slurm
is said first and once; data over the shipping limit is refused from its sizes, unpickled; and a
cancel reaches only gpunb's own job (the Slurm ones on the local cluster, `source /tmp/slurm-env.sh`)."""

import os
import shlex
import time
import uuid

import pytest
import torch
from conftest import classification_data, mlp
from torch import nn

from gpunb import Trainer
from gpunb.errors import GpunbError
from gpunb.runs import Registry

pytest.importorskip("submitit")

SETTINGS = dict(accelerator="cpu", batch_size=16, log_every=4, seed=0, max_steps=2)
HOSTILE_KEYS = ["mail-type\ntouch {marker}", "a;touch {marker}", "$(touch {marker})", "`touch {marker}`",
                "a b", "", "-", "--comment"]
HOSTILE_VALUES = ["x\ntouch {marker}", "x\r\ntouch {marker}", "x\0y"]


def refused(caught, what, marker, gpunb_home):
    message = str(caught.value)
    assert "Slurm setting(s) refused before anything was written" in message and repr(what) in message
    assert "HINT: write each key as sbatch's option name" in message and message.count("HINT:") == 1
    assert not (gpunb_home / "jobs").exists() and Registry().list_runs() == [] and not marker.exists()


@pytest.mark.parametrize("key", HOSTILE_KEYS)
def test_a_hostile_slurm_key_is_refused_before_anything_is_written(key, tmp_path, gpunb_home):
    marker = tmp_path / "ran"
    key = key.format(marker=marker)
    with pytest.raises(GpunbError) as caught:
        Trainer(**SETTINGS, cluster="slurm", slurm={"partition": "debug", key: "1"}).fit(
            mlp(), classification_data(n=64), loss_fn=nn.CrossEntropyLoss())
    refused(caught, key, marker, gpunb_home)
    with pytest.raises(GpunbError) as caught:  # inside slurm={"sbatch": {...}} too
        Trainer(**SETTINGS, cluster="slurm", slurm={"sbatch": {key: "1"}}).fit(
            mlp(), classification_data(n=64), loss_fn=nn.CrossEntropyLoss())
    refused(caught, key, marker, gpunb_home)


@pytest.mark.parametrize("value", HOSTILE_VALUES)
def test_a_slurm_value_with_a_line_break_is_refused_before_anything_is_written(value, tmp_path, gpunb_home):
    marker = tmp_path / "ran"
    value = value.format(marker=marker)
    for given in ({"comment": value}, {"partition": value}, {"time": value}, {"setup": ["echo ok", value]},
                  {"sbatch": {"mail-type": value}}):
        with pytest.raises(GpunbError) as caught:
            Trainer(**SETTINGS, cluster="slurm", slurm=given).fit(mlp(), classification_data(n=64),
                                                                  loss_fn=nn.CrossEntropyLoss())
        refused(caught, value, marker, gpunb_home)


def test_the_cluster_files_settings_are_checked_too(tmp_path, monkeypatch, gpunb_home):
    marker = tmp_path / "ran"
    clusters = tmp_path / "clusters.toml"
    monkeypatch.setenv("GPUNB_CLUSTERS", str(clusters))
    for text, what in [(f'[slurm.sbatch]\n"mail-type\\ntouch {marker}" = "END"\n', f"mail-type\ntouch {marker}"),
                       ('[slurm.sbatch]\n"a;b" = "1"\n', "a;b"),
                       (f'[slurm.sbatch]\ncomment = "x\\ntouch {marker}"\n', f"x\ntouch {marker}"),
                       (f'[slurm.sbatch]\nsetup = ["module load cuda", "x\\ntouch {marker}"]\n', f"x\ntouch {marker}"),
                       (f'[slurm]\npython = "python\\ntouch {marker}"\n', f"python\ntouch {marker}"),
                       (f'[slurm]\njob_dir = "/shared\\ntouch {marker}"\n', f"/shared\ntouch {marker}")]:
        clusters.write_text(text)
        with pytest.raises(GpunbError) as caught:
            Trainer(**SETTINGS, cluster="slurm").fit(mlp(), classification_data(n=64), loss_fn=nn.CrossEntropyLoss())
        refused(caught, what, marker, gpunb_home)
        assert str(clusters) in str(caught.value)


def test_the_magics_slurm_option_is_checked_too(ip, tmp_path, gpunb_home):
    from IPython.core.error import UsageError

    marker = tmp_path / "ran"
    cell = "model = mlp()\ntrain_data = (x, y)\nloss_fn = nn.CrossEntropyLoss()"
    for key in (f"a;touch{marker}", f"$(touch{marker})", f"`touch{marker}`", "x|y"):  # the magic's words have no spaces
        with pytest.raises((GpunbError, UsageError)) as caught:
            ip.run_cell_magic("gputrain", f"--cluster slurm --max-steps 2 --slurm {key}=1", cell)
        refused(caught, key, marker, gpunb_home)


def test_legitimate_settings_make_a_script_with_every_directive(tmp_path, monkeypatch):
    script, expected = sbatch_script(tmp_path, monkeypatch)
    lines = script.splitlines()
    body = next(i for i, line in enumerate(lines) if line.strip() and not line.startswith("#"))
    directives = [line for line in lines if line.startswith("#SBATCH")]
    assert all(lines.index(line) < body for line in directives)  # sbatch reads directives up to the first command
    given = {}
    for line in directives:
        option, _, value = line.removeprefix("#SBATCH --").partition("=")
        given[option] = shlex.split(value)[0] if value else True
    for option, value in expected.items():
        assert given[option] == value, option
    assert lines[body:] == [line for line in lines[body:] if "touch" not in line]  # values stay in their directive


def sbatch_script(tmp_path, monkeypatch):
    """The sbatch script gpunb's executor writes for legitimate settings from the run and the
    cluster file, and the directives it must hold (option -> value)."""
    from gpunb.config import TrainConfig
    from gpunb.jobs.backends import get
    from gpunb.jobs.spec import JobSpec
    from gpunb.jobs.submit import job_settings

    clusters = tmp_path / "clusters.toml"
    clusters.write_text('[slurm]\naccount = "team"\nqos = "normal"\n[slurm.sbatch]\nmail-type = "END"\n'
                        'setup = ["echo set up"]\n')
    monkeypatch.setenv("GPUNB_CLUSTERS", str(clusters))
    comment = f"a; $(touch {tmp_path}/x) `touch {tmp_path}/y` b c"
    settings = job_settings(TrainConfig(cluster="slurm", slurm={"partition": "debug", "time": "1:30:00",
                                                                "comment": comment, "constraint": "a|b",
                                                                "cpus_per_task": 1}))
    folder = tmp_path / f"my-run-{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    spec = JobSpec(run_id=uuid.uuid4().hex, name="my run", key=None, cluster="slurm", folder=str(folder), nodes=1,
                   tasks_per_node=1, gpus_per_node=0, accelerator="cpu", entry="m:f", registry=None,
                   job_name=folder.name)
    slurm = get("slurm")
    executor = slurm.executor(spec, settings, slurm.time_limit_min(settings))
    script = executor._make_submission_file_text("true", "test")
    expected = {"job-name": folder.name, "partition": "debug", "account": "team", "qos": "normal",
                "constraint": "a|b", "time": "90", "comment": comment, "mail-type": "END", "nodes": "1",
                "ntasks-per-node": "1", "cpus-per-task": "1"}
    return script, expected


@pytest.mark.slurm
def test_slurm_reads_every_directive_of_the_script(slurm_cluster, tmp_path, monkeypatch):
    script, expected = sbatch_script(tmp_path, monkeypatch)
    path = tmp_path / "job.sh"
    path.write_text(script.replace('#SBATCH --account=team\n', "").replace("#SBATCH --qos=normal\n", "")
                    .replace("#SBATCH --constraint='a|b'\n", ""))  # none of those exists on the test cluster
    job_id = slurm_cluster.run(["sbatch", "--hold", "--parsable", str(path)]).strip()
    try:
        shown = slurm_cluster.run(["scontrol", "show", "job", "-o", job_id])
    finally:
        slurm_cluster.run(["scancel", job_id], check=False)
    assert f"JobName={expected['job-name']} " in shown and " Partition=debug " in shown
    assert " TimeLimit=01:30:00 " in shown and f" Comment={expected['comment']} " in shown
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def fake_slurm(tmp_path, monkeypatch, sinfo: str, sbatch: str = "exit 0"):
    """`sinfo` and `sbatch` on the PATH as small scripts (the bodies given), SLURM_CONF unset."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in (("sinfo", sinfo), ("sbatch", sbatch)):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("SLURM_CONF", raising=False)


NO_CONFIG = ("echo 'sinfo: error: resolve_ctls_from_dns_srv: res_nsearch error: Unknown host' >&2; "
             "echo 'sinfo: fatal: Could not establish a configuration source' >&2; exit 1")


def test_no_slurm_here_is_said_before_any_file_system_check(tmp_path, monkeypatch, gpunb_home):
    from gpunb.jobs import checks

    fake_slurm(tmp_path, monkeypatch, sinfo=NO_CONFIG)
    monkeypatch.setattr(checks, "file_system_type", lambda path: "ext4")  # a local folder: would be refused too
    with pytest.raises(GpunbError) as caught:
        Trainer(**SETTINGS, cluster="slurm").fit(mlp(), classification_data(n=64), loss_fn=nn.CrossEntropyLoss())
    message = str(caught.value)
    assert message.startswith("Slurm does not answer here (`sinfo`: fatal: Could not establish a configuration "
                              "source).\nHINT: set SLURM_CONF or run where Slurm is")
    assert "local file system" not in message and not (gpunb_home / "jobs").exists()


@pytest.mark.parametrize("sbatch_says, hint", [
    ("echo 'sbatch: error: resolve_ctls_from_dns_srv: res_nsearch error: Unknown host' >&2; "
     "echo 'sbatch: fatal: Could not establish a configuration source' >&2; exit 1", "set SLURM_CONF"),
    ("echo 'sbatch: error: invalid partition specified: gpu' >&2; echo 'sbatch: error: Batch job submission "
     "failed: Invalid partition name specified' >&2; exit 1", "check the Slurm settings (partition, account")])
def test_sbatchs_refusal_is_said_once_under_the_hint_that_fits_it(sbatch_says, hint, tmp_path, monkeypatch, capsys):
    fake_slurm(tmp_path, monkeypatch, sinfo="exit 0", sbatch=sbatch_says)
    clusters = tmp_path / "clusters.toml"
    clusters.write_text(f'[slurm]\nshared_fs = true\njob_dir = "{tmp_path / "jobs"}"\n')
    monkeypatch.setenv("GPUNB_CLUSTERS", str(clusters))
    with pytest.raises(GpunbError) as caught:
        Trainer(**SETTINGS, cluster="slurm").fit(mlp(), classification_data(n=64), loss_fn=nn.CrossEntropyLoss())
    message, printed = str(caught.value), capsys.readouterr()
    last = sbatch_says.split("echo '")[-1].split("' >&2")[0].removeprefix("sbatch: ")
    assert message.count(last) == 1 and f"HINT: {hint}" in message and message.count("HINT:") == 1
    assert last not in printed.err + printed.out  # not printed beside the error
    assert ("partition, account" in message) == hint.startswith("check")


def test_data_over_the_shipping_limit_is_refused_from_its_size_without_pickling(monkeypatch, gpunb_home):
    from gpunb.distributed import shipping

    pickled = []
    monkeypatch.setattr(shipping._Pickler, "dump", lambda self, obj: pickled.append(obj))
    # 3 GB that are never touched: the allocator maps them, and no page is written (no memory used).
    big = torch.empty(3 * 2**30, dtype=torch.uint8)
    started = time.perf_counter()
    with pytest.raises(GpunbError) as caught:
        Trainer(**SETTINGS, cluster="local").fit(mlp(), (big, big[:10]), loss_fn=nn.CrossEntropyLoss())
    took = time.perf_counter() - started
    message = str(caught.value)
    assert "fit's arguments are 3,072 MB of tensors and arrays ('train_data': 3,072 MB), more than the 1,024 MB" in message
    assert "HINT: save the data once to a file" in message
    assert pickled == [] and took < 2.0 and not (gpunb_home / "jobs").exists()


def test_sizes_count_each_storage_once_and_look_inside_datasets_and_modules():
    import numpy as np
    from torch.utils.data import DataLoader, TensorDataset

    from gpunb.distributed.shipping import tensor_bytes

    x, y = torch.zeros(100, 10), torch.zeros(100, dtype=torch.long)
    assert tensor_bytes((x, y)) == 4000 + 800
    assert tensor_bytes(DataLoader(TensorDataset(x, y), batch_size=4)) == 4800
    assert tensor_bytes([x, x[:10], x.T]) == 4000  # views pickle their whole storage, once
    assert tensor_bytes(nn.Linear(10, 3)) == 4 * (30 + 3)
    assert tensor_bytes({"a": np.zeros((10, 10)), "b": [np.zeros(5, dtype=np.int8)]}) == 805
    assert tensor_bytes(torch.zeros(1).expand(10**9)) == 4 and tensor_bytes(torch.empty(10**9, device="meta")) == 0


def fake_job_row(registry, folder_root, name, job_id, status):
    """A registry row and job folder of a Slurm job `name` said to have Slurm id `job_id`."""
    from gpunb.jobs.spec import JobSpec

    run_id = uuid.uuid4().hex
    folder = folder_root / f"{name}-{run_id[:8]}"
    folder.mkdir()
    JobSpec(run_id=run_id, name=name, key=None, cluster="slurm", folder=str(folder), nodes=1, tasks_per_node=1,
            gpus_per_node=0, accelerator="cpu", entry="m:f", registry=str(registry.path), job_id=job_id,
            job_name=folder.name).save()
    registry.start_run(name, run_id=run_id, status=status,
                       job={"cluster": "slurm", "id": job_id, "folder": str(folder), "state": "PENDING"})
    return run_id, folder


@pytest.mark.slurm
def test_stop_never_reaches_a_slurm_job_that_is_not_gpunbs(slurm_cluster, tmp_path, monkeypatch):
    from gpunb.jobs import lookup
    from gpunb.server.handlers import _list_runs, _request_stop

    other = slurm_cluster.run(["sbatch", "--parsable", "-p", slurm_cluster.partition, "--output=/dev/null",
                               "--wrap", "sleep 120"]).strip()
    try:
        slurm_cluster.wait_for_state(other, "RUNNING")
        registry = Registry()
        # Rows whose Slurm id was reused for another job of the same user, or that Slurm forgot.
        reused, reused_folder = fake_job_row(registry, tmp_path, "reused", other, "running")
        queued, queued_folder = fake_job_row(registry, tmp_path, "queued", other, "queued")
        forgotten, _ = fake_job_row(registry, tmp_path, "forgotten", "67000000", "queued")
        assert _request_stop(registry, reused)[0]  # the first Stop only asks the job (its stop file)
        for run_id in (reused, queued, forgotten):  # the next (a queued job's first) would cancel
            accepted, row = _request_stop(registry, run_id)
            assert accepted and row["status"] == "lost" and row["job"]["state"] == "LOST"
        rows = {row["id"]: row for row in registry.list_runs()}
        assert f"Slurm's job {other} is now 'wrap' of user {os.getuid()}, " in rows[reused]["error"]
        assert rows[reused]["error"].endswith(f"not this run's '{reused_folder.name}'")
        assert rows[forgotten]["error"] == "Slurm no longer knows job 67000000"
        assert slurm_cluster.run(["squeue", "-h", "-j", other, "-o", "%T"]).strip() == "RUNNING"
        assert not (reused_folder / "cancelled").exists() and not (queued_folder / "cancelled").exists()
        # The sidebar's list, which asks Slurm about waiting jobs, marks such a row lost too.
        waiting, _ = fake_job_row(registry, tmp_path, "waiting", other, "queued")
        monkeypatch.setattr(lookup, "_refreshed", {"at": 0.0})
        listed = {row["id"]: row for row in _list_runs(registry)}
        assert listed[waiting]["status"] == "lost" and listed[waiting]["job"]["state"] == "LOST"
        assert slurm_cluster.state(other) == "RUNNING"
    finally:
        slurm_cluster.run(["scancel", other], check=False)


@pytest.mark.slurm
def test_the_sidebars_stop_cancels_gpunbs_own_slurm_job(slurm_cluster):
    from test_jobs_slurm import slurm

    from gpunb.server.handlers import _request_stop

    hold = slurm_cluster.run(["sbatch", "--parsable", "-p", slurm_cluster.partition, "-N2", "--exclusive",
                              "--output=/dev/null", "--wrap", "sleep 120"]).strip()
    try:
        slurm_cluster.wait_for_state(hold, "RUNNING")
        submitted = Trainer(**slurm(slurm_cluster, max_steps=4, name="own")).submit(
            mlp(), classification_data(n=128), loss_fn=nn.CrossEntropyLoss())
        run_id, job_id = submitted.job["run_id"], submitted.job["id"]
        assert slurm_cluster.run(["squeue", "-h", "-j", job_id, "-o", "%T"]).strip() == "PENDING"
        accepted, row = _request_stop(Registry(), run_id)  # a waiting job: the first Stop cancels it
        assert accepted and row["status"] == "cancelled" and row["job"]["state"] == "CANCELLED"
        slurm_cluster.wait_for_state(job_id, "CANCELLED", timeout=30)  # only scancel could end a job that never ran
    finally:
        slurm_cluster.run(["scancel", hold], check=False)


@pytest.mark.parametrize("cluster, settings, asked", [
    ("local", {}, (1, 1)),  # accelerator="auto" with GPUs here: the task gets one
    ("local", dict(devices=2), (2, 2)),
    ("local", dict(devices=3, backend="gloo"), (3, 2)),  # gloo shares the two GPUs
    ("local", dict(accelerator="cpu", devices=2), (2, 0)),
    ("slurm", {}, (1, 0)),  # the nodes are not this machine: auto asks for no GPU
    ("slurm", dict(accelerator="cuda", devices=2), (2, 2)),
    ("slurm", dict(gpus_per_node=4), (4, 4)),
])
def test_a_job_asks_for_the_gpus_it_will_train_on(cluster, settings, asked, monkeypatch):
    from gpunb.config import TrainConfig
    from gpunb.jobs.backends import get

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert get(cluster).tasks_and_gpus(TrainConfig(cluster=cluster, **settings)) == asked


@pytest.mark.parametrize("kernel, gpus, job", [
    (None, 2, "0,1"),  # every GPU visible to the kernel: the first ones
    ("3,5,6", 2, "3,5"),  # the kernel's own, as it names them
    (" GPU-aa , GPU-bb", 1, "GPU-aa"),
    ("MIG-cc", 1, "MIG-cc"),
])
def test_a_local_job_gets_the_first_gpus_of_the_kernels_cuda_visible_devices(kernel, gpus, job, monkeypatch):
    from gpunb.jobs.backends.local import first_gpus

    if kernel is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", kernel)
    assert first_gpus(gpus) == job


def test_a_local_job_asking_more_gpus_than_the_kernel_may_use_is_refused_before_it_is_submitted(monkeypatch):
    from gpunb.config import TrainConfig
    from gpunb.errors import GpunbError
    from gpunb.jobs.backends import get

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(GpunbError, match=r"asks for 2 GPUs per node, and this kernel may use 1 .*'3'.*"
                                         r"\nHINT: ask for at most 1 \(`--gpus-per-node 1`\)"):
        get("local").tasks_and_gpus(TrainConfig(cluster="local", gpus_per_node=2))
    assert get("local").tasks_and_gpus(TrainConfig(cluster="local", gpus_per_node=1)) == (1, 1)

