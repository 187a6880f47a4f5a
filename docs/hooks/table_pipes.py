"""mkdocs hook: `\\|` inside a code span of a table row shows as `|` on the site, as it does on GitHub.

GitHub's tables split a row on every unescaped pipe, code spans included, so the pages write `\\|` there
(`--quantize none\\|int8\\|auto`); Python-Markdown never splits inside a code span and would show the
backslash. The page sources stay right for GitHub; this hook makes the site match.
"""

from __future__ import annotations

import re
from typing import Any

CODE_SPAN = re.compile(r"`[^`\n]*`")


def unescape_table_pipes(markdown: str) -> str:
    """Every table row's code spans with `\\|` turned into `|` (fenced code left as it is)."""
    out: list[str] = []
    fenced = False
    for line in markdown.split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("|"):
            line = CODE_SPAN.sub(lambda m: m.group(0).replace("\\|", "|"), line)
        out.append(line)
    return "\n".join(out)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return unescape_table_pipes(markdown)
