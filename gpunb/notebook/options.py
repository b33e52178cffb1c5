"""Strict option parsing for the magics: no abbreviations, and "did you mean" for typos."""

from __future__ import annotations

import difflib

from IPython.core.error import UsageError


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
