"""The code's layout: layers import only downward, nothing imports in a circle, the DHT layer stands
without the peer, few loose modules, light modules stay light and small, and no mixins (a class reads
only members it or its project bases declare: a whole is composed of parts it holds)."""

from __future__ import annotations

import ast
import gc
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("peer", "dht", "monitoring")

#: module-name prefix -> layer (peer/__init__.py lists them); the longest matching prefix wins
LAYERS = {
    "peer": 1,
    "peer.errors": 1,
    "peer.seeding": 1,
    "peer.faults": 1,
    "peer.codecs": 1,
    "peer.checkpoint": 1,
    "peer.artifacts": 1,
    "dht": 1,
    "monitoring": 1,
    "peer.model": 2,
    "peer.data": 3,
    "peer.config": 4,
    "peer.run": 5,
    "peer.scheduler": 6,
    "peer.sync": 7,
    "peer.swarm": 8,
    "peer.training": 9,
    "peer.offline": 10,
    "monitoring.swarm": 10,
    "peer.cli": 11,
    "peer.__main__": 11,
}


def layer_of(module: str) -> int:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LAYERS:
            return LAYERS[".".join(parts[:n])]
    raise AssertionError(f"{module} is in no layer: add it to peer/__init__.py and LAYERS")


def project_modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules `path` imports anywhere in it (top level or inside functions)."""
    found = set()
    # no collection mid-parse: a finalizer of an earlier test's garbage (asyncio transports) run inside
    # CPython 3.11's AST conversion fails it with "AST constructor recursion depth mismatch"
    gc.disable()
    try:
        tree = ast.parse(path.read_text())
    finally:
        gc.enable()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from pkg import sub` imports pkg.sub when sub is a module
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                     for a in node.names]  # fmt: skip
        else:
            continue
        found |= {n for n in names if n.split(".")[0] in PACKAGES}
    return found


def test_every_import_points_down_or_sideways():
    modules = project_modules()
    upward = []
    for name, path in modules.items():
        for target in imports_of(path, modules):
            if layer_of(target) > layer_of(name):
                upward.append(f"{name} (layer {layer_of(name)}) imports {target} (layer {layer_of(target)})")
    assert not upward, "\n".join(upward)


def test_no_module_imports_in_a_circle():
    modules = project_modules()
    graph = {name: {t for t in imports_of(path, modules) if t in modules and t != name}
             for name, path in modules.items()}  # fmt: skip
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt) :] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


@pytest.mark.swarm
def test_config_tree_and_cli_load_without_torch():
    code = (
        "import sys, peer.config, peer.model.grid, peer.codecs.specs, peer.cli.main\n"
        "heavy = sorted(m for m in ('torch', 'hivemind', 'bitsandbytes', 'datasets') if m in sys.modules)\n"
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=60)


def test_modules_stay_small_and_say_what_they_are():
    too_long, undocumented = [], []
    for folder in ("benchmarks", "tests"):  # read as often as the packages: no file over 450 lines there
        for path in (REPO / folder).rglob("*.py"):
            if len(path.read_text().splitlines()) > 450:
                too_long.append(f"{path.relative_to(REPO)}: {len(path.read_text().splitlines())} lines")
    for name, path in project_modules().items():
        text = path.read_text()
        if len(text.splitlines()) > 450:
            too_long.append(f"{name}: {len(text.splitlines())} lines")
        tree = ast.parse(text)
        if text.strip() and not ast.get_docstring(tree):
            undocumented.append(name)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and not ast.get_docstring(node):
                undocumented.append(f"{name}.{node.name}")
    assert not too_long, too_long
    assert not undocumented, undocumented


def test_only_the_cli_imports_the_monitor_and_the_monitor_reads_only_low_layers():
    modules = project_modules()
    allowed = (
        "dht",
        "monitoring",
        "peer.config",
        "peer.errors",
        "peer.model.grid",
        "peer.run",
        "monitoring.swarm",
        # the plan (monitoring/swarm/plan.py): the peers' own planner on their records, and its seed
        "peer.scheduler",
        "peer.swarm.planning",
        "peer.seeding",
    )
    wrong = []
    for name, path in modules.items():
        for target in imports_of(path, modules):
            inside = name == "monitoring.swarm" or name.startswith("monitoring.swarm.")
            if target.startswith("monitoring.swarm") and not (inside or name.startswith("peer.cli")):
                wrong.append(f"{name} imports {target}")
            if inside and not any(target == a or target.startswith(a + ".") for a in allowed):
                wrong.append(f"{name} imports {target}")
    assert not wrong, wrong


def test_the_dht_layer_imports_nothing_from_the_peer():
    modules = project_modules()
    wrong = [
        f"{name} imports {target}"
        for name, path in modules.items()
        if name.split(".")[0] == "dht"
        for target in imports_of(path, modules)
        if target.split(".")[0] != "dht"
    ]
    assert not wrong, wrong


#: modules that may sit loose under peer/ beside __init__ and __main__ (everything else has a folder)
MAX_LOOSE_PEER_MODULES = 4


def test_few_modules_sit_loose_under_peer():
    loose = sorted(
        p.name for p in (REPO / "peer").glob("*.py") if p.name not in ("__init__.py", "__main__.py")
    )
    assert len(loose) <= MAX_LOOSE_PEER_MODULES, loose


def _project_classes() -> dict[str, tuple[ast.ClassDef, str]]:
    """Every class defined in the project, by name (a name defined twice keeps both under module:name)."""
    out: dict[str, tuple[ast.ClassDef, str]] = {}
    for name, path in project_modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                out[node.name if node.name not in out else f"{name}:{node.name}"] = (node, name)
    return out


def _declared(cls: ast.ClassDef) -> set[str]:
    """Names a class body declares: methods, class attributes, and `self.x = ...` anywhere in it."""
    names = set()
    for node in cls.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names |= {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    for node in ast.walk(cls):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        for t in targets:
            for sub in ast.walk(t):
                if (
                    isinstance(sub, ast.Attribute)
                    and isinstance(sub.value, ast.Name)
                    and sub.value.id == "self"
                ):
                    names.add(sub.attr)
    return names


def mixins() -> list[str]:
    """Classes that read `self.x` which neither they nor their project base classes declare: pieces of
    a class assembled elsewhere (a mixin). Classes with a base from outside the project are skipped:
    what such a base provides cannot be seen here."""
    classes = _project_classes()
    found = []
    for cls, module in classes.values():
        declared, todo, external = set(), [cls], False
        while todo:
            c = todo.pop()
            declared |= _declared(c)
            for b in c.bases:
                if isinstance(b, ast.Name) and b.id in classes:
                    todo.append(classes[b.id][0])
                elif not (isinstance(b, ast.Name) and b.id == "object"):
                    external = True
        if external:
            continue
        read = {
            n.attr
            for n in ast.walk(cls)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"
        }
        missing = sorted(read - declared)
        if missing:
            found.append(f"{module}.{cls.name} reads {', '.join(missing[:6])} it never declares")
    return found


def test_no_class_is_a_mixin_that_reads_members_it_never_declares():
    assert not mixins(), mixins()
