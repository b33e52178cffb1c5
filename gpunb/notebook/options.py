"""The magics' options: TrainConfig's fields, the job backends' settings and fit's variables as
options, strict parsing with "did you mean" for typos, and the one place a GpunbError becomes a
UsageError."""

from __future__ import annotations

import contextlib
import difflib

from IPython.core.error import UsageError
from IPython.core.magic_arguments import ArgDecorator

from gpunb.errors import GpunbError


class config_options(ArgDecorator):
    """Decorator: every TrainConfig field a command line can hold, as an option of the magic,
    grouped by the config's sections (gpunb.config_flags makes them)."""

    def add_to_parser(self, parser, group):
        from gpunb.config_flags import add_config_flags

        add_config_flags(parser)


class cluster_options(ArgDecorator):
    """Decorator: every job backend's settings a command line can hold (`--detach`, `--partition`,
    `--slurm KEY=VALUE` ...), made from the backends' table (gpunb.jobs.backends.flags)."""

    def add_to_parser(self, parser, group):
        from gpunb.jobs.backends.flags import add_cluster_flags

        add_cluster_flags(parser)


class role_options(ArgDecorator):
    """Decorator: `--model net`, `--train-data data`, ...: the variable that holds each of fit's
    objects (runtime/roles.py names them); `args.<role>_name` holds the choice."""

    def add_to_parser(self, parser, group):
        from gpunb.runtime.roles import ROLES

        variables = parser.add_argument_group("variables the cell defines")
        for role in ROLES:
            variables.add_argument(f"--{role.name.replace('_', '-')}", dest=f"{role.name}_name", default=role.name,
                                   metavar="NAME", help=f"the variable holding {role.what} (default: {role.name})")


@contextlib.contextmanager
def usage_errors(args=None):
    """Turn a GpunbError raised inside into a UsageError (IPython shows it without a traceback).

    Fixes that name a config field (`batch_size=32`) are given as the option (`--batch-size 32`);
    an object of the wrong kind is named by the variable that holds it (`args.<role>_name`).
    """
    try:
        yield
    except GpunbError as error:
        from gpunb.config_flags import as_flag_hints

        message = as_flag_hints(str(error))
        role = getattr(error, "role", None)
        if role is not None and args is not None:
            message = f"`{getattr(args, f'{role}_name', role)}`: {message}"
        raise UsageError(message) from None


def make_strict(magic, prog: str | None = None) -> None:
    """Tighten the parser `magic_arguments` built for `magic`.

    argparse takes any unique prefix (`--epoch 3` would silently mean `--epochs 3`) and says
    only "unrecognized arguments" for a typo; here a prefix is unknown and a typo gets the
    closest known option. `prog` renames the magic in the usage line (`%%gputrain`).
    """
    parser = magic.parser
    parser.allow_abbrev = False
    parser.error = lambda message: _error(parser, message)
    if prog is not None:
        parser.prog = prog
        magic.__doc__ = parser.format_help()  # the `%%gputrain?` text, with the new usage line


def _error(parser, message: str):
    known = [option for action in parser._actions for option in action.option_strings]
    unknown = [token.split("=")[0] for token in message.split() if token.startswith("--")]
    hints = []
    for token in unknown:
        close = difflib.get_close_matches(token, known, n=1, cutoff=0.6)
        if close:
            hints.append(f"did you mean `{close[0]}` (for `{token}`)?")
    if not hints and unknown:
        hints.append(f"`%{parser.prog.lstrip('%')}?` lists the options.")
    raise UsageError(message + ("\nHINT: " + " ".join(hints) if hints else ""))
