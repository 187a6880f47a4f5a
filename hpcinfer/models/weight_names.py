"""A checkpoint's tensor names mapped onto a native module's: the first of a list of (regex,
replacement) rules that matches a name gives its new name; a name none matches is not the module's."""

from __future__ import annotations

import re
from collections.abc import Sequence


def renamed(name: str, rules: Sequence[tuple[str, str]]) -> str | None:
    """`name` under the first rule that matches it, or None where none does."""
    for pattern, replacement in rules:
        new, hits = re.subn(pattern, replacement, name)
        if hits:
            return new
    return None


__all__ = ["renamed"]
