"""The package's import floors (docs/architecture.md, "Floors"): no file-level import cycle, and imports between
folders only go down entrypoints -> engine -> model_runner_v2 -> sampling -> kernels, with the root-level modules
(config.py, sampling_params.py, outputs.py, step_io.py, ...) as the ground floor that imports no folder, and the
roof (rl.py: `replayllm.rl`, re-exporting entrypoints/rl.py) above them all, imported by nothing in the package.

Reads the source with `ast` (nothing is imported); imports inside functions and under TYPE_CHECKING count too."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repo root is the `replayllm` package
PACKAGE = "replayllm"
NOT_PACKAGE = {"tests", "bench", "docs", "build", "dist"}
FLOORS = ["entrypoints", "engine", "model_runner_v2", "sampling", "kernels"]  # top floor first
GROUND = len(FLOORS)  # root-level modules
ROOF = ("rl",)  # root-level modules above every floor: they re-export entrypoints (replayllm.rl)
ROOF_FLOOR = -1


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted name (without `replayllm.`; "" = the root __init__) -> (file, is a package __init__)."""
    mods = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in NOT_PACKAGE or any(p.startswith(".") for p in rel.parts):
            continue
        parts = list(rel.with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        mods[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return mods


def _resolve(name: str, mods: dict) -> str | None:
    """The longest known module a dotted import target names (`engine.scheduler.Scheduler` -> engine.scheduler)."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name if name in mods else None


def _imports(mod: str, path: Path, is_pkg: bool, mods: dict) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name[len(PACKAGE) + 1:] for a in node.names if a.name.startswith(PACKAGE + ".")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
                pkg = [p for p in pkg[: len(pkg) - (node.level - 1)] if p]
                base = ".".join([*pkg, node.module] if node.module else pkg)
            elif node.module == PACKAGE or (node.module or "").startswith(PACKAGE + "."):
                base = node.module[len(PACKAGE) + 1:]
            else:
                continue
            # `from . import x` may name a module x, or a name defined in the package.
            targets = [f"{base}.{a.name}".strip(".") for a in node.names] or [base]
            targets = [t if _resolve(t, mods) == t else base for t in targets]
        for t in targets:
            resolved = _resolve(t, mods) if t else ""
            if resolved is not None and resolved != mod:
                found.add(resolved)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {mod: _imports(mod, path, is_pkg, mods) for mod, (path, is_pkg) in mods.items()}


def _floor(mod: str) -> tuple[int, str]:
    """(floor index, folder); the roof's modules are above floor 0, the other root-level modules and the root
    package are the ground floor."""
    parts = mod.split(".")
    if mod in ROOF:
        return ROOF_FLOOR, "roof"
    if len(parts) == 1 or not mod:
        if mod in FLOORS:  # a folder's own __init__
            return FLOORS.index(mod), mod
        return GROUND, ""
    return FLOORS.index(parts[0]), parts[0]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_parser_sees_the_package():
    graph = _graph()
    assert {"config", "step_io", "engine.llm_engine", "model_runner_v2.model_runner", "sampling.sampler",
            "kernels.trace_replay", "entrypoints.cli.main"} <= set(graph)
    assert "step_io" in graph["engine.scheduler"] and "sampling.sampler" in graph["model_runner_v2.model_runner"]
    assert "entrypoints.diff" in graph["entrypoints.cli.diff"]  # lazy `from ..diff import ...`
    assert {"entrypoints.score", "entrypoints.diff.trace_file"} <= graph["entrypoints.rl"]
    assert "entrypoints.rl" in graph["rl"] and "entrypoints.rl" in graph["entrypoints.cli.rl_demo"]


def test_no_file_level_import_cycle():
    assert _cycles(_graph()) == []


def test_folder_imports_only_go_down_the_floors():
    wrong = []
    for mod, targets in _graph().items():
        floor, folder = _floor(mod)
        for t in targets:
            t_floor, t_folder = _floor(t)
            if t_folder != folder and t_floor <= floor:
                wrong.append(f"{mod} -> {t}")
    assert wrong == [], "imports against the floor order (docs/architecture.md, 'Floors'):\n" + "\n".join(wrong)


def test_ground_floor_imports_no_folder():
    graph = _graph()
    ground = [m for m in graph if _floor(m)[0] == GROUND]
    assert {"config", "sampling_params", "outputs", "step_io"} <= set(ground)
    wrong = [f"{m} -> {t}" for m in ground for t in graph[m] if _floor(t)[0] != GROUND]
    assert wrong == []


def test_folder_init_imports_only_its_own_folder():
    """The import hazard (docs/architecture.md): with the repo root on sys.path a folder's __init__ runs as a
    top-level package (`kernels`), where reaching out of the folder raises."""
    wrong = [f"{m} -> {t}" for m, targets in _graph().items() if m in FLOORS or m == "entrypoints.diff"
             for t in targets if not t.startswith(m + ".")]
    assert wrong == []
