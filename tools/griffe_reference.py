"""Griffe extensions for the API reference; mkdocs.yml enables this file under the Python
handler's ``extensions``.

``SphinxRoles``: the docstrings are Google style with Sphinx's cross-reference roles
(``:class:`Trainer```, ``:meth:`~trainbus.EventBus.stream```, ``:func:`.link.connect```), which
mkdocstrings, rendering Markdown, would show as literal text. Before rendering, each becomes:

- a link to the object's entry in the reference, when the name resolves (as Sphinx resolves it:
  the docstring's own object, then its parents, then the module's imports) to an object of the
  package; a private object the reference does not render shows as code, without a link;
- code, when the name is Python's or another library's (``:class:`ValueError```,
  ``:func:`time.monotonic```, ``:class:`torch.nn.Module```), or the role says so (``!name``);
- a cross-reference that fails the build (mkdocs ``--strict``), naming the page and the
  docstring's line, when the name resolves to nothing: a name that does not exist, a typo, a
  name that was renamed or removed.

``~`` shows only the last component, and ``title <target>`` shows the title, as in Sphinx. A
paragraph ending in reST's ``::`` (its indented block follows, which Markdown shows as code as
it is) ends in ``:`` as Sphinx shows it; a ``::`` alone on its line goes.

``QuietSpecialMembers``: the reference shows what each module's ``__all__`` exports and the
public members of each class, special ones included (``__enter__``, ``__call__``, ``__iter__``
say how an object is used); ``__all__``, ``__slots__``, ``__getattr__`` (the names that moved),
``__repr__`` and the like say nothing a user acts on, and are left out.
"""

from __future__ import annotations

import builtins
import importlib.util
import re
from typing import Any

import griffe

PACKAGE = "trainbus"

# reST's literal-block marker: "text::" shows "text:", "text ::" and a lone "::" show nothing.
LITERAL_MARKER = [
    (re.compile(r"^[ \t]*::[ \t]*$", re.M), ""),
    (re.compile(r"(\S)[ \t]+::[ \t]*$", re.M), r"\1"),
    (re.compile(r"(\S)::[ \t]*$", re.M), r"\1:"),
]

ROLE = re.compile(
    r":(?:py:)?(?P<role>class|meth|func|attr|data|mod|exc|obj|const|type):`(?P<body>[^`]+)`"
)


def _exists(collection: griffe.ModulesCollection, path: str) -> bool:
    parts = path.split(".")
    try:
        obj: Any = collection[parts[0]]
        for part in parts[1:]:
            obj = obj.members[part] if part in obj.members else obj.all_members[part]
    except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
        return False
    return True


def _external(head: str) -> bool:
    """Python's builtins and importable modules other than the package: shown as code."""
    if head == PACKAGE:
        return False
    if hasattr(builtins, head):
        return True
    try:
        return importlib.util.find_spec(head) is not None
    except (ImportError, ValueError):
        return False


def _resolve(obj: griffe.Object, target: str) -> str | None:
    """The full path that ``target`` names in ``obj``'s scope, or None for another library's."""
    if target.startswith("."):
        module = obj.module
        candidates = [f"{module.path}{target}"]
        if module.parent is not None:
            candidates.append(f"{module.parent.path}{target}")
        for candidate in candidates:
            if _exists(obj.modules_collection, candidate):
                return candidate
        return candidates[0]
    head, _, rest = target.partition(".")
    # A dotted name starts at the module's names (its imports and definitions: ``time.monotonic``
    # is the module ``time`` even in the docstring of an attribute called ``time``); a bare name
    # at the docstring's own object, then its parents (``close`` in a class is its method).
    scope = obj.module if rest else obj
    try:
        resolved = scope.resolve(head)
    except griffe.NameResolutionError:
        if head == PACKAGE or not _external(head):
            return target
        return None
    if resolved.split(".")[0] != PACKAGE:
        return None
    return f"{resolved}.{rest}" if rest else resolved


def _render(obj: griffe.Object, match: re.Match[str]) -> str:
    role, body = match["role"], match["body"].strip()
    title: str | None = None
    if body.endswith(">") and "<" in body:
        title, _, body = body[:-1].rpartition("<")
        title = title.strip()
    suppressed = body.startswith("!")
    short = body.startswith("~")
    target = body.lstrip("!~").removesuffix("()")
    shown = title or (target.rsplit(".", 1)[-1] if short else target.lstrip("."))
    if role in {"meth", "func"} and title is None:
        shown += "()"
    if suppressed:
        return f"`{shown}`"
    path = _resolve(obj, target)
    if path is None:
        return f"`{shown}`"
    if _exists(obj.modules_collection, path):
        # A link where the reference renders the object; code where it does not (private).
        return f'<autoref optional identifier="{path}"><code>{shown}</code></autoref>'
    return f"[`{shown}`][{path}]"


# Special members a user does not act on (QuietSpecialMembers).
QUIET = {"__all__", "__slots__", "__getattr__", "__repr__", "__str__", "__hash__", "__eq__"}
QUIET |= {"__reduce__", "__reduce_ex__", "__getstate__", "__setstate__", "__init_subclass__"}


class SphinxRoles(griffe.Extension):
    """Rewrite the Sphinx roles of every docstring of the package once it is loaded."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        self._rewrite(pkg, seen=set())

    def _rewrite(self, obj: griffe.Object, seen: set[str]) -> None:
        if obj.path in seen:
            return
        seen.add(obj.path)
        if obj.docstring is not None:
            text = ROLE.sub(lambda m: _render(obj, m), obj.docstring.value)
            for marker, replacement in LITERAL_MARKER:
                text = marker.sub(replacement, text)
            obj.docstring.value = text
        for member in obj.members.values():
            if not member.is_alias:
                self._rewrite(member, seen)  # type: ignore[arg-type]


class QuietSpecialMembers(griffe.Extension):
    """Leave the special members of ``QUIET`` out of the reference, wherever they are defined."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        self._quiet(pkg, seen=set())

    def _quiet(self, obj: griffe.Object, seen: set[str]) -> None:
        if obj.path in seen:
            return
        seen.add(obj.path)
        for name in QUIET & obj.members.keys():
            # Out of the tree, not only marked private: a class re-exported under another path
            # is rendered through an alias, whose members do not see their target's marks.
            del obj.members[name]
        for member in obj.members.values():
            if not member.is_alias:
                self._quiet(member, seen)  # type: ignore[arg-type]
