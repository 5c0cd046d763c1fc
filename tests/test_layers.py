"""The layer rules of ARCHITECTURE.md, enforced: a module importing across a forbidden edge
fails here, naming the module, the import and the rule.

Imports under ``if TYPE_CHECKING:`` count too (a type-only edge is still a dependency a reader
must follow), except where ``TYPES_ONLY`` allows one; "knows no torch" means no torch at run
time (a type-only ``import torch`` for annotations loads nothing).
"""

from __future__ import annotations

import ast
import importlib
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "trainbus"

# Leaf utilities every layer may use: they import nothing of trainbus but each other.
LEAF = {
    "_exceptions",
    "_validate",
    "_log",
    "_tensors",
    "_hookpoints",
    "_durable",
    "_signals",
    "_moved",
}

# layer -> the trainbus layers it may import (besides itself and LEAF).
ALLOWED: dict[str, set[str]] = {
    "events": set(),
    "commands": set(),
    "bus": {"events", "commands"},
    "operators": {"events", "commands", "bus"},
    "checkpoint": {"events"},
    "loop": {"events", "commands", "checkpoint", "operators"},
    "wire": {"events", "commands"},
    "distributed": {"events", "commands", "wire"},
    "callbacks": {"bus", "events", "commands", "operators", "wire"},
    # trainbus.integrations.<tool>: callbacks for other tools (Optuna), built like callbacks/.
    "integrations": {"callbacks", "bus", "events", "commands", "operators"},
    # "top": the facades and tools (trainer, cli, testing, replay and the run folders,
    # __init__) may use every layer.
}
# Edges allowed only inside `if TYPE_CHECKING:` (annotations): the loop is handed a bus.
# (events name the Command type of CommandApplied.)
# (Callback.after_fit names the FitResult, which the loop defines and the Trainer hands it.)
TYPES_ONLY: dict[str, set[str]] = {
    "loop": {"bus", "distributed"},
    "events": {"commands"},
    "callbacks": {"loop"},
    "integrations": {"loop"},
}
NO_TORCH = {"bus", "events", "commands", "operators"}
TOP = {
    "__init__",
    "trainer",
    "_cli",
    "testing",
    "_replay",
    "__main__",
    "_launcher",
    "_seeding",
    "ray",
    "_trainer",
    "_attachment",
}
# The Trainer's own rooms live in trainbus/_trainer/ (one package of the top layer); the
# package's hall holds public modules and the internals several layers share.
HALL_INTERNALS = {
    "_exceptions",
    "_validate",
    "_log",
    "_tensors",
    "_durable",
    "_signals",
    "_moved",
    "_hookpoints",
    "_attachment",
    "_launcher",
    "_replay",
    "_seeding",
    "_wire",
}
# The private packages of a layer: trainbus._bus is the bus layer (trainbus.bus its public face).
PRIVATE_LAYERS = {"_bus": "bus", "_loop": "loop", "_distributed": "distributed", "_wire": "wire"}


@dataclass(frozen=True)
class Import:
    target: str  # dotted module name, absolute
    type_only: bool
    line: int


def layer_of(module: str) -> str:
    """``trainbus._bus.dispatch`` -> ``bus``; ``trainbus._trainer.trainer`` -> ``top``."""
    parts = module.split(".")
    head = parts[1] if len(parts) > 1 else "__init__"
    head = PRIVATE_LAYERS.get(head, head)
    if head in LEAF:
        return "leaf"
    if head in TOP:
        return "top"
    return head


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path: Path) -> list[Import]:
    tree = ast.parse(path.read_text(), filename=str(path))
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, type_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for sub in child.body:
                    visit_stmt(sub, True)
                for sub in child.orelse:
                    visit_stmt(sub, type_only)
                continue
            visit_stmt(child, type_only)

    def visit_stmt(node: ast.AST, type_only: bool) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Import(alias.name, type_only, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            if node.module is None or target in {"trainbus"}:
                # `from . import events` / `from trainbus import events`: the names are modules
                found.extend(
                    Import(f"{target}.{a.name}", type_only, node.lineno) for a in node.names
                )
            else:
                found.append(Import(target, type_only, node.lineno))
        else:
            visit(node, type_only)

    visit(tree, False)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def violations() -> list[str]:
    out: list[str] = []
    for path in sorted(SRC.rglob("*.py")):
        module = module_name(path)
        src_layer = layer_of(module)
        for imp in imports_of(path):
            top = imp.target.split(".")[0]
            if top == "torch" and src_layer in NO_TORCH and not imp.type_only:
                out.append(f"{module}:{imp.line} imports {imp.target}: {src_layer} knows no torch")
            if top != "trainbus" or imp.target == "trainbus":
                continue
            dst_layer = layer_of(imp.target)
            if src_layer == "top" or dst_layer in {src_layer, "leaf"}:
                continue
            if src_layer == "leaf":
                out.append(f"{module}:{imp.line} imports {imp.target}: a leaf imports no layer")
                continue
            if dst_layer in ALLOWED[src_layer]:
                continue
            if imp.type_only and dst_layer in TYPES_ONLY.get(src_layer, set()):
                continue
            out.append(
                f"{module}:{imp.line} imports {imp.target}: {src_layer} may import only "
                f"{sorted(ALLOWED[src_layer]) or 'nothing of trainbus'} (+ leaf utilities)"
            )
    return out


def test_no_module_imports_across_a_forbidden_edge() -> None:
    assert violations() == []


def test_every_layer_is_known() -> None:
    layers = {layer_of(module_name(p)) for p in SRC.rglob("*.py")}
    assert layers <= set(ALLOWED) | {"leaf", "top"}, layers - set(ALLOWED)


@pytest.mark.parametrize(
    ("source", "statement", "rule"),
    [
        ("_bus/dispatch.py", "import torch", "knows no torch"),
        ("_bus/dispatch.py", "from .._loop import loop", "bus may import only"),
        ("events.py", "from .bus import EventBus", "events may import only"),
        ("callbacks/x.py", "from .._loop.control import CommandHandler", "callbacks may import"),
        ("_loop/x.py", "from .._bus import EventBus", "loop may import only"),
    ],
)
def test_the_checker_catches_a_forbidden_edge(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, statement: str, rule: str
) -> None:
    """The rule table bites: a planted forbidden import is reported."""
    fake = tmp_path / "trainbus"
    target = fake / source
    target.parent.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    target.write_text(statement + "\n")
    monkeypatch.setattr(sys.modules[__name__], "SRC", fake)
    found = violations()
    assert len(found) == 1 and rule in found[0], found


# Inside the bus, each module imports only modules earlier in this order: no cycle can form.
BUS_ORDER = [
    "scheduler",
    "commands",
    "watchdog",
    "subscriptions",
    "dispatch",
    "lifecycle",
]


def test_every_bus_module_is_in_the_order() -> None:
    modules = {p.stem for p in (SRC / "_bus").glob("*.py")} - {"__init__"}
    assert modules == set(BUS_ORDER)


def test_bus_modules_import_only_modules_below_them() -> None:
    for i, stem in enumerate(BUS_ORDER):
        below = {f"trainbus._bus.{m}" for m in BUS_ORDER[:i]}
        for imp in imports_of(SRC / "_bus" / f"{stem}.py"):
            if imp.target.startswith("trainbus._bus"):
                assert imp.target in below, f"_bus/{stem}.py imports {imp.target}, not below it"


def test_the_loop_module_keeps_no_copy_of_the_event_order() -> None:
    # docs/events.md is the one written event order; loop.py's docstring points to it.
    events = importlib.import_module("trainbus.events")
    doc = importlib.import_module("trainbus._loop.loop").__doc__ or ""
    named = set(re.findall(r"\b[A-Z]\w+\b", doc)) & {t.__name__ for t in events.EVENT_TYPES}
    assert "docs/events.md" in doc and not named, named


def test_the_hall_holds_public_modules_and_shared_internals_only() -> None:
    # A private module of the Trainer alone belongs in trainbus/_trainer/, not beside the
    # public modules.
    private = {p.stem for p in SRC.glob("_*.py")} - {"__init__", "__main__"}
    assert private == HALL_INTERNALS, private ^ HALL_INTERNALS


def test_src_is_laid_out_by_ruff_format_alone() -> None:
    # A `# fmt: skip` packs a call or a condition into fewer lines than ruff format gives it:
    # the package's size is counted as ruff lays the code out.
    marker = "fmt: " + "skip"
    packed = [
        f"{path.relative_to(SRC)}:{number}"
        for path in sorted(SRC.rglob("*.py"))
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if line.rstrip().endswith(marker)
    ]
    assert not packed, f"lines ruff format may not lay out: {packed}"
