"""The one exception type gpunb raises for user mistakes.

Every message says what happened, why, and the fix (after "HINT:"), in the style
of Lightning Fabric's errors.
"""

from __future__ import annotations


class GpunbError(ValueError):
    """A mistake in how gpunb was called; the message names the fix."""

    def __init__(self, what: str, hint: str | None = None):
        self.what = what
        self.hint = hint
        super().__init__(what if hint is None else f"{what}\nHINT: {hint}")
