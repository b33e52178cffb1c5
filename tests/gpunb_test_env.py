"""What every pytest run of this repository sets first, for the tests in tests/ and the
tutorials in notebooks/ (nbval) alike, whichever of them a command collects: pyproject's
pytest options load this module as a plugin (`-p gpunb_test_env`, found on `pythonpath`), and
tests/conftest.py imports it too (for runs that override those options).

The environment set here is inherited by every process a test starts, Jupyter kernels included.
"""

import os
import tempfile
from pathlib import Path

# Never the user's real run registry, even when the user's shell sets GPUNB_HOME (a default
# would keep theirs). tests/conftest.py gives each test a home of its own on top of this.
os.environ["GPUNB_HOME"] = tempfile.mkdtemp(prefix="gpunb-test-home-")

# Kernels quiet about optional libraries' notices when the tutorial itself imports them. With
# torchao installed, building any transformers model imports it; torchao then logs a warning for
# each of its compiled extensions that does not match this torch build, and torch logs about the
# enums it registers; bitsandbytes logs one for an optional kernel package it lacks. Those lines
# depend on the machine's packages, not on the tutorial, so the kernels set those loggers to
# ERROR through an IPython startup file in a temporary IPYTHONDIR (gpunb's own imports of them
# are quiet already: gpunb/quiet.py). Everything else a tutorial prints is compared.
_QUIET_IMPORTS = """\
import logging
for name in ("torchao", "torch.utils._pytree", "bitsandbytes"):
    logging.getLogger(name).setLevel(logging.ERROR)
"""
_startup = Path(tempfile.mkdtemp(prefix="gpunb-test-ipython-")) / "profile_default" / "startup"
_startup.mkdir(parents=True)
(_startup / "00-quiet-imports.py").write_text(_QUIET_IMPORTS)
os.environ["IPYTHONDIR"] = str(_startup.parent.parent)

# A forced compile in one process compiles in a worker beside the eager steps, and switches
# when that is done: on a loaded CPU, after the short runs of most tests. Those tests pin what
# compiled steps do, so they compile inline, as before; tests/test_compile_beside.py turns the
# worker on (and kernels started by tests inherit this).
os.environ.setdefault("GPUNB_COMPILE_BESIDE", "0")
