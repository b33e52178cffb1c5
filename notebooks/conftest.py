"""The tutorials' kernels, quiet about optional libraries' notices at import.

With torchao installed, building any transformers model imports it; torchao then logs a
warning for each of its compiled extensions that does not match this torch build, and torch
logs about the enums it registers. bitsandbytes logs one for an optional kernel package it
lacks. Those lines depend on which packages the machine has, not on the tutorial, so the
kernels nbval starts set those loggers to ERROR, through an IPython startup file in a
temporary IPYTHONDIR. Everything else the tutorials print is compared as it is.
"""

import os
import tempfile
from pathlib import Path

_QUIET = """\
import logging
for name in ("torchao", "torch.utils._pytree", "bitsandbytes"):
    logging.getLogger(name).setLevel(logging.ERROR)
"""

_home = Path(tempfile.mkdtemp(prefix="gpunb-test-ipython-"))
(_home / "profile_default" / "startup").mkdir(parents=True)
(_home / "profile_default" / "startup" / "00-quiet-imports.py").write_text(_QUIET)
os.environ["IPYTHONDIR"] = str(_home)
