"""Optional libraries imported without their import-time notices, where gpunb imports them.

torchao logs a warning for each of its compiled extensions that does not match the installed
torch (and torch's pytree logs one for each enum torchao registers); bitsandbytes logs one for
an optional kernel package it lacks. Those lines say nothing about the user's run, yet show as
red text under a notebook cell. For the import only, those loggers are set to ERROR and the
libraries' own warnings are ignored; the user's logging and warnings filters are left as they
were, and errors still show.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import warnings

NOISY_LOGGERS = ("torchao", "torch.utils._pytree", "bitsandbytes")
_NOISY_MODULES = r"(torchao|bitsandbytes|peft|transformers|torch\.utils\._pytree)(\.|$)"


@contextlib.contextmanager
def quiet_imports():
    """Hold back the import notices of torchao, bitsandbytes, peft and transformers."""
    loggers = [logging.getLogger(name) for name in NOISY_LOGGERS]
    levels = [logger.level for logger in loggers]
    try:
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module=_NOISY_MODULES)
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def import_quietly(name: str):
    """`importlib.import_module(name)` under `quiet_imports()`."""
    with quiet_imports():
        return importlib.import_module(name)
