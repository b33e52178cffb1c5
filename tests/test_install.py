"""The core install: gpunb's runtime and magics work in an environment without Jupyter's server side.

A real venv (no system site-packages) gets exactly the dependency closure of the core
requirements in pyproject.toml, linked from the packages installed here (no download),
and gpunb from this checkout. JupyterLab, jupyter_server, jupyter_core and notebook are
not in it: the test checks that too, so a core dependency that drags one in fails here.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
JUPYTER_SERVER_SIDE = {"jupyterlab", "jupyter-server", "jupyter-core", "jupyter-client", "notebook"}


def closure(requirements: list[str]) -> dict[str, metadata.Distribution]:
    """The installed distributions `requirements` need, transitively (markers evaluated, no extras)."""
    found, todo = {}, list(requirements)
    while todo:
        requirement = Requirement(todo.pop())
        if requirement.marker and not requirement.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(requirement.name)
        if name in found:
            continue
        try:
            found[name] = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            pytest.skip(f"{name} (a core dependency) is not installed here")
        todo.extend(found[name].requires or [])
    return found


def test_the_core_requirements_leave_jupyter_server_side_to_the_lab_extra():
    core = {canonicalize_name(Requirement(r).name) for r in PROJECT["dependencies"]}
    assert core == {"torch", "numpy", "psutil", "nvidia-ml-py", "cloudpickle", "ipython", "ipywidgets"}
    assert Requirement(next(r for r in PROJECT["dependencies"] if "ipywidgets" in r)).specifier.contains("7.6.0")
    assert not JUPYTER_SERVER_SIDE & set(closure(PROJECT["dependencies"]))
    extras = PROJECT["optional-dependencies"]
    assert {canonicalize_name(Requirement(r).name) for r in extras["lab"]} == {"jupyterlab", "jupyter-server"}
    tested = next(Requirement(r).extras for r in extras["test"] if Requirement(r).name == "gpunb")
    assert tested == set(extras) - {"test"}  # the tests need every extra (docs: the build is a test)
    assert any(Requirement(r).name == "notebook" for r in extras["test"])  # the Notebook 7 browser test


@pytest.fixture(scope="module")
def core_venv(tmp_path_factory) -> Path:
    """A venv holding the core closure and gpunb; returns its python."""
    home = tmp_path_factory.mktemp("core-venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(home / "venv")], check=True)
    python = home / "venv" / ("Scripts" if os.name == "nt" else "bin") / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               check=True, capture_output=True, text=True).stdout.strip())
    linked = set()
    for dist in closure(PROJECT["dependencies"]).values():
        if dist.files is None:
            pytest.skip(f"{dist.metadata['Name']} has no RECORD to link it by")
        for file in dist.files:
            top = file.parts[0]
            if top not in ("..", "__pycache__") and top not in linked:
                linked.add(top)
                (site / top).symlink_to(dist.locate_file(top))
    (site / "gpunb").symlink_to(ROOT / "gpunb")
    return python


def run_in(python: Path, code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "JUPYTER", "GPUNB"))}
    env.update(XDG_DATA_HOME=str(tmp_path / "data"), HOME=str(tmp_path), GPUNB_DASHBOARD="text")
    return subprocess.run([python, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=240)


def test_gpunb_trains_in_a_venv_without_jupyterlab(core_venv, tmp_path):
    done = run_in(core_venv, """
        import importlib.util, sys
        missing = [m for m in ("jupyterlab", "jupyter_server", "jupyter_core", "jupyter_client", "notebook")
                   if importlib.util.find_spec(m) is None]
        print("missing:", ",".join(missing))

        import torch
        import gpunb
        g = torch.Generator().manual_seed(0)
        train = val = (torch.randn(256, 64, generator=g), torch.randint(0, 10, (256,), generator=g))
        model = torch.nn.Linear(64, 10)
        result = gpunb.Trainer(epochs=1, batch_size=64, seed=0).fit(
            model, train, val, loss_fn=torch.nn.CrossEntropyLoss())
        print("status:", result.status)
        print("runs:", len(gpunb.runs()))  # the registry in the platform data dir

        from IPython.core.interactiveshell import InteractiveShell
        shell = InteractiveShell.instance()
        shell.run_line_magic("load_ext", "gpunb")
        shell.user_ns.update(torch=torch, train=train)
        cell = shell.run_cell("%%gputrain --epochs 1 --batch-size 64 --name terminal\\n"
                              "model = torch.nn.Linear(64, 10)\\n"
                              "train_data = train\\n"
                              "loss_fn = torch.nn.CrossEntropyLoss()\\n")
        print("cell ok:", cell.success, shell.user_ns["gputrain_result"].status)
        print("jupyter imported:", sorted(m for m in sys.modules if m.split(".")[0] in
                                          ("jupyterlab", "jupyter_server", "jupyter_core", "jupyter_client")))
    """, tmp_path)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "missing: jupyterlab,jupyter_server,jupyter_core,jupyter_client,notebook" in out  # an honest venv
    assert "status: completed" in out
    assert "runs: 1" in out
    assert "cell ok: True completed" in out
    assert "epoch 1:" in out  # the terminal progress line, not a widget
    assert "jupyter imported: []" in out
    assert (tmp_path / "data" / "gpunb" / "runs.sqlite").exists()


def test_the_server_extension_without_jupyter_server_names_the_lab_extra(core_venv, tmp_path):
    done = run_in(core_venv, """
        import gpunb, gpunb.server  # what `import gpunb` loads for Jupyter's discovery: no jupyter import
        try:
            import gpunb.server.handlers
        except Exception as error:
            print(type(error).__name__, error)
    """, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "GpunbError The gpunb server extension needs jupyter_server" in done.stdout
    assert "HINT: `pip install gpunb[lab]`" in done.stdout


def test_a_server_without_jupyterlab_warns_that_the_sidebar_needs_the_lab_extra(monkeypatch):
    import logging

    import gpunb.server
    from tornado.web import Application

    real_find_spec = gpunb.server.importlib.util.find_spec
    monkeypatch.setattr(gpunb.server.importlib.util, "find_spec",
                        lambda name, *a: None if name == "jupyterlab" else real_find_spec(name, *a))
    records = []

    class App:
        base_url = "/"
        web_app = Application(base_url="/")
        log = logging.getLogger("fake-server")

    monkeypatch.setattr(App.log, "warning", lambda message, *args: records.append(message % args))
    monkeypatch.setattr(App.log, "info", lambda *args: None)
    gpunb.server._load_jupyter_server_extension(App)
    assert any("sidebar needs JupyterLab" in r and "`pip install gpunb[lab]`" in r for r in records)


def test_the_demo_without_scikit_learn_names_the_install(core_venv, tmp_path):
    done = run_in(core_venv, "from gpunb.cli import main; raise SystemExit(main(['demo']))", tmp_path)
    assert done.returncode == 2, done.stderr
    assert "digits data comes with scikit-learn" in done.stderr
    assert "HINT: `pip install scikit-learn`" in done.stderr
