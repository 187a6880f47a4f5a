"""mkdocs hook: the architecture page's code map, generated at build time from the package's docstrings.

A page that holds the marker `<!-- code-map -->` gets it replaced by the map of `hpcinfer/`: one section per
package folder, with the opening paragraph of its `__init__.py` docstring, then a line per module with the
opening paragraph of the module's docstring (the summary every module of the project starts with).

Docstrings are read from the source with `ast.get_docstring`; the package is never imported, so the build
needs no torch and shows the code as it is on disk. A module that does not parse fails the build with its
path named (the map would otherwise describe code that cannot run).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

MARKER = "<!-- code-map -->"
TASKS_MARKER = "<!-- tasks -->"
PACKAGE = "hpcinfer"
NO_DOCSTRING = "(no docstring)"


def summary(path: Path) -> str:
    """The opening paragraph of a module's docstring, on one line (empty when it has none)."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except SyntaxError as exc:
        raise PluginError(f"code map: {path} does not parse: {exc}") from exc
    doc = ast.get_docstring(tree) or ""
    return " ".join(doc.split("\n\n", 1)[0].split())


def package_dirs(root: Path) -> list[Path]:
    """The package and every folder below it that is a package (has `__init__.py`), parents first."""
    dirs = [root] + [p.parent for p in root.rglob("__init__.py") if p.parent != root]
    return sorted(dirs, key=lambda d: d.relative_to(root.parent).parts)


def code_map(root: Path) -> str:
    """Markdown for the map of the package at `root`."""
    out: list[str] = []
    for folder in package_dirs(root):
        rel = folder.relative_to(root.parent).as_posix()
        out += [f"### `{rel}/`", "", summary(folder / "__init__.py") or NO_DOCSTRING, ""]
        modules = sorted(p for p in folder.glob("*.py") if p.name != "__init__.py")
        # NOTE: a list, not a table: docstrings quote options such as `auto|off|LIST`, whose pipes a table splits.
        out += [f"- **`{m.name}`**: {summary(m) or NO_DOCSTRING}" for m in modules]
        out.append("")
    return "\n".join(out)


def _root(config: Any) -> Path:
    return Path(config["config_file_path"]).resolve().parent / PACKAGE


def on_config(config: Any) -> Any:
    """`mkdocs serve` rebuilds when a module's docstring changes."""
    config["watch"].append(str(_root(config)))
    return config


def registered_tasks(root: Path) -> list[tuple[str, str, str]]:
    """(name, module, the first line of its task.py's docstring) of each task in `registry.TASKS`,
    in its order, read from the source (the one list of tasks: the docs never list them by hand)."""
    tree = ast.parse((root / "registry.py").read_text(encoding="utf-8"))
    found = next(
        (n.value for n in ast.walk(tree) if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "TASKS"),
        None,
    )
    if not isinstance(found, ast.Dict):
        raise PluginError("code map: registry.py has no TASKS dict")
    out = []
    for key, value in zip(found.keys, found.values, strict=True):
        name, path = ast.literal_eval(key), ast.literal_eval(value)
        module = path.partition(":")[0]
        file = root.parent / (module.replace(".", "/") + ".py")
        out.append((name, module, summary(file).split(". ")[0].rstrip(".")))
    return out


def tasks_table(root: Path) -> str:
    rows = [f"| `{name}` | `{module}` | {what} |" for name, module, what in registered_tasks(root)]
    return "\n".join(["| task | module | what it is |", "|---|---|---|", *rows])


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if TASKS_MARKER in markdown:
        markdown = markdown.replace(TASKS_MARKER, tasks_table(_root(config)))
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, code_map(_root(config)))
