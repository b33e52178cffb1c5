import base64
import re
import signal

import gpunb_test_env  # noqa: F401 - no real GPUNB_HOME, quiet kernels (pyproject loads it first too)
import pytest
import torch
from torch import nn


@pytest.fixture(autouse=True)
def gpunb_home(tmp_path, monkeypatch):
    """Every test gets its own run registry and Jupyter data dir."""
    home = tmp_path / "gpunb-home"
    monkeypatch.setenv("GPUNB_HOME", str(home))
    return home


@pytest.fixture(autouse=True)
def foreground_sigint():
    """Every test sees Ctrl-C as a foreground process does (Python's KeyboardInterrupt), also when
    the suite was started in the background (`cmd &`, `nohup`), which starts it ignoring SIGINT.
    A test of the background case sets SIG_IGN itself."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def classification_data(n=256, features=10, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    w = torch.randn(features, classes, generator=g)
    y = (x @ w).argmax(1)
    return x, y


def mlp(features=10, classes=3, hidden=32, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, classes))


class TinyGPT(nn.Module):
    """nanoGPT's interface: forward(idx, targets) -> (logits, loss), the targets already shifted."""

    def __init__(self, vocab: int):
        super().__init__()
        torch.manual_seed(3)
        self.embed, self.head = nn.Embedding(vocab, 16), nn.Linear(16, vocab)

    def forward(self, idx, targets=None):
        logits = self.head(torch.relu(self.embed(idx)))
        return logits, nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1)


def charts_in(markup: str) -> list[str]:
    """The SVG of each chart image in `markup`: stored HTML holds charts as <img> of their SVG."""
    return [base64.b64decode(data).decode()
            for data in re.findall(r"src=['\"]data:image/svg\+xml;base64,([^'\"]+)", markup)]


def pytest_addoption(parser):
    parser.addoption("--docs-images", action="store_true",
                     help="let the browser tests write their screenshots into docs/ (otherwise they go "
                          "to a temporary directory and the checkout is left as it was)")


@pytest.fixture(scope="session")
def slurm_cluster():
    """The local Slurm cluster (tests/slurm_support.py): `.ci/run`'s, or one started for this
    session where Slurm is installed and this runs as root; skips with the reason otherwise."""
    from slurm_support import session_cluster

    with session_cluster() as cluster:
        yield cluster


@pytest.fixture
def screenshots(request, tmp_path):
    """Where the browser tests save screenshots: docs/ with `--docs-images`, else a temp dir."""
    from browser_support import DOCS

    return DOCS if request.config.getoption("--docs-images") else tmp_path / "screenshots"


@pytest.fixture
def ip():
    """An IPython shell with gpunb loaded, a clean namespace holding torch, nn, mlp and
    `x, y = classification_data(n=96)`, and no earlier %%gputrain remembered (a test module
    may define its own `ip` instead)."""
    import IPython
    from IPython.testing.globalipapp import get_ipython

    from gpunb.notebook import session

    shell = get_ipython() or IPython.get_ipython()  # the first call starts it, later ones return None
    shell.run_line_magic("load_ext", "gpunb")
    shell.user_ns.clear()
    session.LAST_TRAIN = None
    shell.run_cell("import torch\nfrom torch import nn\nfrom conftest import classification_data, mlp\n"
                   "x, y = classification_data(n=96)")
    yield shell
    shell.user_ns.clear()
    session.LAST_TRAIN = None
