"""Where CUDA exists, importing gpunb and asking for %gpustatus never initialise it.

On CPU torch `torch.cuda.is_initialized()` is always False, so the same check in
test_magics.py cannot fail there. Here it runs in a fresh process (an earlier test may
have used the GPU in this one), which then initialises CUDA itself to show that the
check sees an initialisation when there is one.
"""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.cuda

PROBE = """
import json
import torch
import gpunb
from gpunb.notebook.status import Status

status = Status.now()  # all that %gpustatus does after parsing its line
shown = (repr(status), status._repr_html_(), status.json())
try:
    from IPython.testing.globalipapp import start_ipython
except ImportError:
    magic = None  # a GPU host without IPython: the code path above is the magic's
else:
    shell = start_ipython()
    shell.run_line_magic("load_ext", "gpunb")
    magic = repr(shell.run_line_magic("gpustatus", ""))
untouched = not torch.cuda.is_initialized()
torch.ones(1, device="cuda")
names = [gpu.get("name") for gpu in status.snapshot["gpus"]]
print(json.dumps({"untouched": untouched, "seen_when_used": torch.cuda.is_initialized(),
                  "nvidia": bool(status.snapshot["nvidia"]), "gpus": names, "magic": magic}))
"""


def test_gpustatus_and_the_import_never_initialise_cuda_in_a_fresh_process():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, "PYTHONPATH": path},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["nvidia"] and report["gpus"], report  # NVML answered: the GPU path, not the fallback
    assert report["untouched"], "importing gpunb or %gpustatus initialised CUDA"
    assert report["seen_when_used"]  # the check is not vacuous here
    if report["magic"] is not None:  # IPython is installed: the magic itself ran, and showed the GPU
        assert report["gpus"][0] in report["magic"]
