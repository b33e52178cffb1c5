"""Job backends are classes chosen from one table (gpunb/jobs/backends).

The first tests read the code: no module outside gpunb/jobs/backends branches on a cluster's name,
and each Slurm setting is named in one module. The others pin what the table gives the rest of
gpunb: the magic's options, the settings each backend accepts, and the refusal of a cluster the
table does not hold, before any work.
"""

import ast
import argparse
from pathlib import Path

import pytest
from IPython.core.error import UsageError

from gpunb import Trainer
from gpunb.errors import GpunbError
from gpunb.jobs import backends
from gpunb.jobs.backends.base import JobBackend, Setting

PACKAGE = Path(__file__).resolve().parent.parent / "gpunb"
BACKENDS_DIR = PACKAGE / "jobs" / "backends"
NAMES = {"local", "slurm", "detach"}  # the table's names and aliases


def _names_in(node) -> list:
    """The string constants of `node`, or of its elements (a tuple, list or set of them)."""
    parts = [node] if isinstance(node, ast.Constant) else list(getattr(node, "elts", ()))
    return [part.value for part in parts if isinstance(part, ast.Constant) and part.value in NAMES]


def cluster_branches(tree: ast.AST) -> list:
    """(line, name) of each place in `tree` that decides by a cluster's name: a comparison or a
    `match` case with one, a table keyed by them, `cluster="local"` given or assigned."""
    found = []
    for node in ast.walk(tree):
        named = []
        if isinstance(node, ast.Compare):
            named = [name for operand in (node.left, *node.comparators) for name in _names_in(operand)]
        elif isinstance(node, ast.MatchValue):
            named = _names_in(node.value)
        elif isinstance(node, ast.Dict):
            named = [name for key in node.keys if key is not None for name in _names_in(key)]
            named += [name for key, value in zip(node.keys, node.values)
                      if isinstance(key, ast.Constant) and key.value == "cluster" for name in _names_in(value)]
        elif isinstance(node, ast.keyword) and node.arg == "cluster":
            named = _names_in(node.value)
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Attribute) and t.attr == "cluster"
                                                  for t in node.targets):
            named = _names_in(node.value)
        found += [(getattr(node, "lineno", 0), name) for name in named]
    return found


def test_no_module_outside_the_backends_branches_on_a_cluster_name():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if BACKENDS_DIR in path.parents:
            continue
        found += [(str(path.relative_to(PACKAGE)), line, name)
                  for line, name in cluster_branches(ast.parse(path.read_text(), filename=str(path)))]
    assert not found, ("a cluster's name decides outside gpunb/jobs/backends (ask the backend instead: "
                       "spec.backend, backends.chosen(config)):\n" + "\n".join(map(str, found)))


@pytest.mark.parametrize("source", [
    "if spec.cluster == 'local':\n    pass\n",
    "if config.cluster != \"slurm\":\n    pass\n",
    "ok = job.get('cluster') in ('slurm', 'local')\n",
    "match cluster:\n    case 'slurm':\n        pass\n",
    "executor = {'local': Local, 'slurm': Slurm}[cluster]\n",
    "chosen = {'cluster': 'local'} if args.detach else {}\n",
    "config = TrainConfig(cluster='detach')\n",
    "spec.cluster = 'local'\n",
])
def test_a_branch_on_a_cluster_name_is_seen(source):
    assert cluster_branches(ast.parse(source))


@pytest.mark.parametrize("source", [
    "raise GpunbError('pass `cluster=\\'slurm\\'` too')\n",
    "if config.cluster is None:\n    pass\n",
    "if backend.several_nodes:\n    pass\n",
    "where = 'local file system'\n",
])
def test_what_is_not_a_branch_is_left_alone(source):
    assert not cluster_branches(ast.parse(source))


def test_each_slurm_setting_is_named_in_one_module():
    from gpunb.jobs.backends.slurm import SBATCH_SETTINGS

    for setting in SBATCH_SETTINGS:
        holders = sorted(str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
                         if any(isinstance(node, ast.Constant) and node.value == setting.name
                                for node in ast.walk(ast.parse(path.read_text()))))
        assert holders == ["jobs/backends/slurm.py"], (setting.name, holders)


# --------------------------------------------------------------------------- what the table gives

class Sketch(JobBackend):
    """A backend with a switch, a flagged setting and a table of other settings (never submits)."""

    name = "sketch"
    what = "a sketch"
    title = "Sketch"
    switch = Setting("sketch-it", "run on the sketch")
    settings = (Setting("pool", "the sketch's pool", flag=True),)
    extra_table = "more"


@pytest.fixture
def sketch(monkeypatch):
    monkeypatch.setitem(backends.TABLE, Sketch.name, f"{__name__}:Sketch")
    monkeypatch.setattr(backends, "_made", dict(backends._made))
    return Sketch


def parsed(line: str):
    from gpunb.jobs.backends.flags import add_cluster_flags

    parser = argparse.ArgumentParser()
    parser.add_argument("--cluster")
    add_cluster_flags(parser)
    return parser.parse_args(line.split())


def test_the_magics_job_options_come_from_the_backends_settings(sketch):
    from gpunb.jobs.backends.flags import cluster_values

    args = parsed("--sketch-it --pool deep --sketch a=1 --sketch b=")  # the table: named after the backend
    assert cluster_values(args) == {"cluster": "sketch", "slurm": {"pool": "deep", "a": "1", "b": ""}}
    args = parsed("--detach --time 90 --partition gpu --slurm mem=8G")  # gpunb's own, from the same table
    assert cluster_values(args) == {"cluster": "local", "slurm": {"time": "90", "partition": "gpu", "mem": "8G"}}
    with pytest.raises(GpunbError, match="--sketch-it runs a sketch, and another cluster is named too: pick one"):
        cluster_values(parsed("--sketch-it --cluster slurm"))
    with pytest.raises(GpunbError, match="--sketch .x. is not KEY=VALUE"):
        cluster_values(parsed("--sketch x"))


def test_the_magic_shows_every_backends_options():
    from gpunb.notebook.magics import GpuMagics

    shown = GpuMagics.gputrain.__doc__
    for option in ("--detach", "--time", "--partition", "--account", "--qos", "--constraint", "--slurm"):
        assert option in shown, option


def test_an_unknown_cluster_is_refused_before_any_work(gpunb_home):
    with pytest.raises(GpunbError, match=r"cluster='slurmm' is not a cluster gpunb knows \(did you mean 'slurm'\?\)"
                                         r"\.\nHINT: use `cluster='local'`"):
        Trainer(cluster="slurmm")
    assert not gpunb_home.exists()


def test_the_magic_refuses_an_unknown_cluster_before_the_cell_runs(ip):
    ip.user_ns.pop("ran", None)
    with pytest.raises(UsageError, match="cluster='lcoal' is not a cluster gpunb knows"):
        ip.run_cell_magic("gputrain", "--cluster lcoal", "ran = True")
    assert "ran" not in ip.user_ns


def test_nodes_a_backend_cannot_give_are_refused():
    with pytest.raises(GpunbError, match=r"nodes=2 asks for several machines, and cluster='local' runs a detached job "
                                         r"on this machine.*\nHINT: pass `cluster='slurm'` too"):
        Trainer(cluster="local", nodes=2)
    with pytest.raises(GpunbError, match="nodes=2 needs a cluster"):
        Trainer(nodes=2)
    assert backends.chosen(Trainer(cluster="slurm", nodes=2).config).name == "slurm"
    assert backends.chosen(Trainer(cluster="detach").config).name == "local"  # an alias


def test_a_setting_a_backend_does_not_have_is_refused(tmp_path, monkeypatch):
    from gpunb.config import TrainConfig
    from gpunb.jobs.submit import job_settings

    monkeypatch.setenv("GPUNB_CLUSTERS", str(tmp_path / "none.toml"))
    assert job_settings(TrainConfig(cluster="local", slurm={"time": "30"})) == {"time": "30"}
    with pytest.raises(GpunbError, match=r"The setting 'partition' means nothing to cluster='local'.*\n"
                                         r"HINT: drop it; the settings of 'local' are .*job_dir"):
        job_settings(TrainConfig(cluster="local", slurm={"partition": "gpu"}))
    (tmp_path / "clusters.toml").write_text('[local]\npartition = "gpu"\n')
    monkeypatch.setenv("GPUNB_CLUSTERS", str(tmp_path / "clusters.toml"))
    with pytest.raises(GpunbError, match=r"\[local\] has unknown key\(s\) 'partition'"):
        job_settings(TrainConfig(cluster="local"))


def test_every_backend_checks_settings_by_the_same_rules():
    for backend in backends.every():
        with pytest.raises(GpunbError, match="refused before anything was written"):
            backend.check_settings({"time": "1\nrm -rf /"}, "slurm={...}")
        backend.check_settings({"time": "2:00:00", "signal_delay_s": 60}, "slurm={...}")
