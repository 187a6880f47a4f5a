"""The package's import graph is a DAG: every module's imports, read from its source (AST), form no cycle.

Imports inside functions and under `if TYPE_CHECKING:` count too: a lazy import is still a
dependency, and a cycle through one is still two modules that each need the other.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "hpcinfer"


def module_names(package: Path) -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package's __init__) for every module of the package."""
    names = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        names[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return names


def imported(module: str, is_package: bool, node: ast.Import | ast.ImportFrom, known: set[str]) -> set[str]:
    """The package's modules that one import statement names (`from . import x` names module x)."""
    if isinstance(node, ast.Import):
        candidates = [alias.name for alias in node.names]
    else:
        if node.level:
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        candidates = [target, *(f"{target}.{alias.name}" for alias in node.names)]
    return {name for name in candidates if name in known}


def import_graph(package: Path) -> dict[str, set[str]]:
    modules = module_names(package)
    graph: dict[str, set[str]] = {}
    for name, (path, is_package) in modules.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                edges |= imported(name, is_package, node, set(modules))
        edges.discard(name)
        graph[name] = edges
    return graph


@functools.cache
def _package_edges() -> tuple[tuple[str, frozenset[str]], ...]:
    return tuple((name, frozenset(edges)) for name, edges in import_graph(PACKAGE).items())


def package_graph() -> dict[str, set[str]]:
    """hpcinfer's import graph, its sources read once per test session (a fresh copy each call)."""
    return {name: set(edges) for name, edges in _package_edges()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None for a DAG (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in sorted(graph):
        if root in state:
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def test_the_package_imports_form_no_cycle():
    graph = package_graph()
    assert len(graph) > 50  # every module was read
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_a_back_edge_is_found(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "top.py").write_text("from .sub import low\n")
    (package / "sub" / "low.py").write_text("def f():\n    from .. import top  # a lazy back-edge\n")
    assert find_cycle(import_graph(package)) == ["pkg.sub.low", "pkg.top", "pkg.sub.low"]
    (package / "sub" / "low.py").write_text("X = 1\n")
    assert find_cycle(import_graph(package)) is None


ENTRY_POINTS = ("hpcinfer.cli", "hpcinfer.serve")  # the command line, and the server over the same job


def test_nothing_below_the_api_imports_it():
    graph = package_graph()
    users = sorted(name for name, edges in graph.items() if "hpcinfer.api" in edges)
    assert users and all(u.startswith(ENTRY_POINTS) for u in users), users


ENGINE_MAY_NOT_IMPORT = ("hpcinfer.tasks", "hpcinfer.files", "hpcinfer.job", "hpcinfer.cli", "hpcinfer.api")


def layer_violations(graph: dict[str, set[str]], layer: str, forbidden: tuple[str, ...]) -> list[str]:
    """`a -> b` for each import of a module of `layer` that names a module under a forbidden prefix."""
    return sorted(
        f"{a} -> {b}"
        for a, targets in graph.items()
        if a == layer or a.startswith(layer + ".")
        for b in targets
        if any(b == f or b.startswith(f + ".") for f in forbidden)
    )


RUNTIME_MAY_NOT_IMPORT = ("hpcinfer.tasks", "hpcinfer.cli", "hpcinfer.api")


def test_the_engine_imports_no_task_file_job_or_command_line_module():
    """engine/ is the generation engine alone: requests in, finished sequences out. Its runtime
    (engine/runtime/: engines driven across devices) meets the job (its window book, the arrival
    clock of --rate) but knows no task either."""
    graph = package_graph()
    core = {name: edges for name, edges in graph.items() if not name.startswith("hpcinfer.engine.runtime")}
    assert layer_violations(core, "hpcinfer.engine", ENGINE_MAY_NOT_IMPORT) == []
    assert layer_violations(graph, "hpcinfer.engine.runtime", RUNTIME_MAY_NOT_IMPORT) == []


def test_the_layer_check_sees_a_back_edge():
    graph = {"hpcinfer.engine.engine": {"hpcinfer.models.llama", "hpcinfer.tasks.generate.job"}}
    assert layer_violations(graph, "hpcinfer.engine", ENGINE_MAY_NOT_IMPORT) == [
        "hpcinfer.engine.engine -> hpcinfer.tasks.generate.job"
    ]


def folder_of(module: str) -> str:
    """hpcinfer.tasks.embed.job -> tasks; a top-level module (hpcinfer.api) is its own folder."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def folder_cycles(graph: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """Pairs of folders that import each other (a module of each names a module of the other)."""
    edges = {(folder_of(a), folder_of(b)) for a, targets in graph.items() for b in targets}
    return {tuple(sorted((a, b))) for a, b in edges if a != b and (b, a) in edges}


# NOTE: none left (the registry names tasks by import path, so tune/ and ray_engine/ import no task);
# this list only shrinks: a new pair of folders importing each other fails the test.
KNOWN_FOLDER_CYCLES: set[tuple[str, ...]] = set()


def test_folders_import_each_other_no_more_than_known():
    assert folder_cycles(package_graph()) <= KNOWN_FOLDER_CYCLES


def test_the_folder_check_sees_a_back_edge():
    graph = package_graph()
    graph["hpcinfer.files.parts"] = graph["hpcinfer.files.parts"] | {"hpcinfer.job.claim"}  # files -> job
    assert ("files", "job") in folder_cycles(graph) - KNOWN_FOLDER_CYCLES


def cuda_calls(package: Path) -> dict[str, int]:
    """Module file -> how many `torch.cuda.<name>` references it holds outside hpcinfer/device/."""
    found: dict[str, int] = {}
    for path in package.rglob("*.py"):
        if path.relative_to(package).parts[0] == "device":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        hits = sum(
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "cuda"
            and isinstance(node.value.value, ast.Name)
            and node.value.value.id == "torch"
            for node in ast.walk(tree)
        )
        if hits:
            found[str(path.relative_to(package))] = hits
    return found


# NOTE: the profiler's CUDA ranges, Triton's interpreter switch (read when Triton is first imported)
# and the engine's CUDA graph capture; everything else asks device/ (accelerators.py, cuda.py).
CUDA_OUTSIDE_DEVICE = {"obs/profile.py", "engine/attention/triton_kernel.py", "engine/decode_graphs.py"}


def test_torch_cuda_is_asked_through_the_device_layer():
    assert set(cuda_calls(PACKAGE)) <= CUDA_OUTSIDE_DEVICE


def test_the_cuda_check_sees_a_call_outside_the_device_layer(tmp_path):
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "job.py").write_text("import torch\nfree = torch.cuda.mem_get_info(0)\n")
    assert cuda_calls(tmp_path) == {"tasks/job.py": 1}


def task_crossings(graph: dict[str, set[str]]) -> list[str]:
    """`a -> b` for each import from one task folder (tasks/X) into another (tasks/Y)."""

    def task_of(module: str) -> str | None:
        parts = module.split(".")
        return parts[2] if len(parts) > 3 and parts[1] == "tasks" else None

    edges = [(a, b) for a, targets in graph.items() for b in targets]
    return sorted(f"{a} -> {b}" for a, b in edges if task_of(a) and task_of(b) not in (None, task_of(a)))


def test_no_task_imports_another():
    """What two tasks share lives outside tasks/ (the encoder pipeline, the engine), so a task folder
    can be read, changed or removed alone."""
    assert task_crossings(package_graph()) == []
    crossing = {"hpcinfer.tasks.score.task": {"hpcinfer.tasks.classify.labels", "hpcinfer.pipeline.task"}}
    assert task_crossings(crossing) == ["hpcinfer.tasks.score.task -> hpcinfer.tasks.classify.labels"]
