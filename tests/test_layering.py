"""The layout's rules, read from the source with `ast` so they stay true (docs/architecture.md).

Every import counts: module level, inside functions (lazy imports of heavy dependencies) and
under `if TYPE_CHECKING:`; a type-only cycle is still two modules that each need the other.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("contract", "estimator", "policies", "scheduler", "datamanager", "fuse_client", "http_guard", "traces",
            "silod_client")

# What each layer may import from the project (besides itself). The contract and the shared kernel
# (estimator: units, user errors) are neutral; the control plane never imports the data path and
# the data path never imports the control plane.
ALLOWED: dict[str, set[str]] = {
    "estimator": set(),
    "contract": {"estimator"},
    "http_guard": set(),
    "traces": {"estimator"},
    "policies": {"estimator"},
    "scheduler.core": {"estimator", "policies"},
    "scheduler.sim": {"estimator", "policies", "traces", "scheduler.core", "scheduler.outputs", "scheduler.console"},
    "scheduler.backends": {"estimator", "policies", "contract", "datamanager.client", "scheduler.core",
                           # the Kubernetes admission controller records kubectl-created workloads
                           # as jobs of the service's catalogue and reads their measured consumption
                           "scheduler.service.types", "scheduler.service.consumption",
                           "scheduler.service.db"},
    "scheduler.service": {"estimator", "policies", "contract", "http_guard", "traces", "datamanager.client",
                          "scheduler.core", "scheduler.backends",
                          # the CLI's REST commands are the SDK's client; its tables print through
                          # scheduler.console (a leaf: rich only)
                          "silod_client", "scheduler.console"},
    "scheduler": {"estimator", "policies", "contract", "traces", "datamanager.client", "scheduler"},
    "datamanager": {"estimator", "contract", "http_guard"},
    "fuse_client": {"estimator", "contract", "http_guard"},
    # the SDK and the training-loop reporter: what users install beside their training code
    "silod_client": set(),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def project_imports() -> dict[str, set[str]]:
    """module -> the project modules it imports (a `from pkg import sub` names pkg.sub if that is a module)."""
    files = {p: _module_name(p) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
             if "migrations" not in p.parts}
    modules = set(files.values())
    graph: dict[str, set[str]] = {}
    for path, module in files.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(module, node, path.name == "__init__.py")
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for t in targets:
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and t != module:
                    edges.add(t)
        graph[module] = edges
    return graph


def _layer(module: str) -> str:
    best = ""
    for layer in ALLOWED:
        if (module == layer or module.startswith(layer + ".")) and len(layer) > len(best):
            best = layer
    return best


def _allowed(src_layer: str, target: str) -> bool:
    if target == src_layer or target.startswith(src_layer + "."):
        return True
    return any(target == a or target.startswith(a + ".") for a in ALLOWED[src_layer])


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for module, targets in sorted(graph.items()):
        layer = _layer(module)
        assert layer, f"{module} belongs to no layer of ALLOWED: add it"
        out += [f"{module} imports {t}" for t in sorted(targets) if not _allowed(layer, t)]
    return out


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

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
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_layers_import_only_what_they_may():
    assert layering_violations(project_imports()) == []


def test_no_import_cycles_not_even_type_only():
    assert import_cycles(project_imports()) == []


def test_the_planes_do_not_import_each_other():
    graph = project_imports()
    crossing = [f"{m} imports {t}" for m, ts in graph.items() for t in ts
                if (m.startswith(("scheduler", "datamanager")) and t.startswith("fuse_client"))
                or (m.startswith("fuse_client") and t.startswith(("scheduler", "datamanager.app", "datamanager.state")))]
    assert crossing == []


@pytest.mark.parametrize("line, where", [
    ("from fuse_client.remote import RemoteStore\n", "scheduler/core/planner.py"),
    ("    from scheduler.service.types import Principal\n", "fuse_client/mount.py"),
])
def test_the_check_catches_a_forbidden_import(tmp_path, monkeypatch, line, where):
    """The rules bite: one forbidden import added to a copy of the tree is reported."""
    import shutil

    copy = tmp_path / "tree"
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, copy / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    target = copy / where
    target.write_text(target.read_text() + ("\ndef _added():\n" + line if line.startswith(" ") else "\n" + line))
    monkeypatch.setattr(sys.modules[__name__], "ROOT", copy)
    assert any(where.removesuffix(".py").replace("/", ".") in v for v in layering_violations(project_imports()))


def test_scheduler_top_stays_small():
    top = [p for p in (ROOT / "scheduler").glob("*.py")]
    assert len(top) <= 12, sorted(p.name for p in top)
