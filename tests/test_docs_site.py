"""The documentation site (mkdocs.yml, ``make docs``): every page under docs/ is in the
navigation, and the strict build fails naming the page for a page missing from the navigation,
a link to a missing page, anchor or repository file, and a reference to a Python name that does
not exist.

The failing builds run mkdocs on a small project in a temporary directory, configured as the
real mkdocs.yml is (its strictness, its validation, its plugins and the docstring-role
extension), so each takes a few seconds rather than the whole site's build.
"""

from __future__ import annotations

import copy
import importlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "mkdocs.yml"
DOCS = ROOT / "docs"


def _load(path: Path) -> dict[str, Any]:
    yaml = pytest.importorskip("yaml")

    class Loader(yaml.SafeLoader):
        """Safe, and tolerant of tags such as ``!!python/name:`` (read as None): only the
        navigation and the settings named below are used."""

    Loader.add_multi_constructor("", lambda loader, suffix, node: None)
    config: dict[str, Any] = yaml.load(path.read_text(), Loader=Loader)
    return config


def _nav_pages(nav: Any) -> list[str]:
    if isinstance(nav, str):
        return [] if "://" in nav else [nav]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in _nav_pages(value)]
    if isinstance(nav, list):
        return [page for item in nav for page in _nav_pages(item)]
    return []


def test_the_navigation_lists_every_page_under_docs_once() -> None:
    listed = _nav_pages(_load(CONFIG)["nav"])
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert sorted(pages - set(listed)) == [], "pages under docs/ missing from mkdocs.yml's nav"
    assert sorted(set(listed) - pages) == [], "mkdocs.yml's nav lists pages that do not exist"
    assert len(listed) == len(set(listed)), "a page is listed twice in mkdocs.yml's nav"


def test_every_public_module_has_a_reference_page() -> None:
    from test_public_api import PUBLIC

    listed = set(_nav_pages(_load(CONFIG)["nav"]))
    for module in sorted(PUBLIC):
        page = f"reference/{module}.md"
        assert page in listed, page
        assert f"::: {module}\n" in (DOCS / page).read_text(), page


def test_a_reference_page_listing_its_members_lists_every_exported_name() -> None:
    """A page may order its module's names with a ``members:`` list (the trainbus page puts
    ``Trainer`` first); a name left out of the list would be missing from the reference."""
    yaml = pytest.importorskip("yaml")
    from test_public_api import PUBLIC

    ordered = 0
    for module in sorted(PUBLIC):
        text = (DOCS / f"reference/{module}.md").read_text()
        block = text.split(f"::: {module}\n", 1)[1]
        options = yaml.safe_load(block) if block.strip() else None
        members = (options or {}).get("options", {}).get("members")
        if members is None:
            continue
        ordered += 1
        exported = importlib.import_module(module).__all__
        assert sorted(members) == sorted(exported), module
        assert len(members) == len(set(members)), module
    assert ordered >= 1


def test_the_real_build_is_strict_and_every_link_problem_is_a_warning() -> None:
    config = _load(CONFIG)
    assert config["strict"] is True
    assert config["validation"] == {
        "omitted_files": "warn",
        "not_found": "warn",
        "absolute_links": "warn",
        "unrecognized_links": "warn",
        "anchors": "warn",
    }


# A small package for the reference of the temporary project: one documented name, whose
# docstring cross-references its own method the way the package's docstrings do.
GOOD_MODULE = '''"""A module for the docs tests."""

__all__ = ["Good"]


class Good:
    """A class; see :meth:`run` and :meth:`~fixturepkg.Good.run`, not :func:`_helper`; it
    raises :class:`ValueError` and calls :func:`time.monotonic`. For example::

        Good().run()
    """

    def run(self) -> None:
        """Run."""

    def __enter__(self) -> "Good":
        return self

    def __repr__(self) -> str:
        return "Good()"


def _helper() -> None:
    """Private: the reference does not show it."""
'''

BROKEN_MODULE = '''"""A module whose docstring names something that does not exist."""

__all__ = ["Broken"]


class Broken:
    """A class.

    It returns a :class:`NoSuchThing`.
    """
'''


def _build(root: Path, pages: dict[str, str], nav: list[Any]) -> subprocess.CompletedProcess[str]:
    """``mkdocs build --strict`` of a project in ``root``: ``pages`` under docs/, configured as
    the real mkdocs.yml (its validation, plugins, docstring options) but for the navigation and
    the source paths (the temporary package first, then the real one)."""
    pytest.importorskip("mkdocs")
    config = copy.deepcopy(_load(CONFIG))
    for plugin in config["plugins"]:
        if isinstance(plugin, dict) and "mkdocstrings" in plugin:
            python = plugin["mkdocstrings"]["handlers"]["python"]
            python["paths"] = [str(root / "src"), str(ROOT / "src")]
            options = python["options"]
            options["extensions"] = [str(ROOT / e) for e in options["extensions"]]
    config["hooks"] = [str(ROOT / hook) for hook in config["hooks"]]
    config.update(docs_dir=str(root / "docs"), site_dir=str(root / "site"), nav=nav)
    config.pop("exclude_docs", None)
    (root / "src" / "fixturepkg").mkdir(parents=True)
    (root / "src" / "fixturepkg" / "__init__.py").write_text(GOOD_MODULE)
    (root / "src" / "fixturepkg" / "broken.py").write_text(BROKEN_MODULE)
    (root / "examples").mkdir()
    (root / "examples" / "script.py").write_text("print('an example')\n")
    for name, text in pages.items():
        (root / "docs" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "docs" / name).write_text(text)
    yaml = pytest.importorskip("yaml")
    (root / "mkdocs.yml").write_text(yaml.safe_dump(config))
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(root / "mkdocs.yml")],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT / "src")},
    )


GOOD_PAGES = {
    "index.md": "# Home\n\n[The reference](api.md#fixturepkg.Good), [Good][fixturepkg.Good], "
    "[the script](../examples/script.py).\n",
    "api.md": "# API\n\n::: fixturepkg\n",
}


@pytest.mark.slow
def test_a_sound_project_builds_and_a_docstring_role_becomes_a_link(tmp_path: Path) -> None:
    """The control for the failing builds below: the same project without their defect builds;
    and what tools/griffe_reference.py does: ``:meth:`run``` in a docstring links to the method's
    entry, reST's ``::`` reads as Sphinx shows it, ``__repr__`` is left out."""
    proc = _build(tmp_path, GOOD_PAGES, ["index.md", "api.md"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    html = (tmp_path / "site" / "api" / "index.html").read_text()
    assert html.count('href="#fixturepkg.Good.run"') >= 2
    # A private name, Python's and another module's: shown as code, without a link.
    for shown in ("_helper()", "ValueError", "time.monotonic()"):
        assert f"<code>{shown}</code>" in html, shown
    assert ":meth:" not in html and ":func:" not in html and ":class:" not in html
    # A link to a repository file outside docs/: its path, as code.
    index = (tmp_path / "site" / "index.html").read_text()
    assert "the script (<code>examples/script.py</code>)" in index
    # Special members: the ones that say how the object is used, not the others.
    assert 'id="fixturepkg.Good.__enter__"' in html
    assert 'id="fixturepkg.Good.__repr__"' not in html
    # reST's literal block: the paragraph ends in one colon, the block is code.
    assert "For example:</p>" in html
    assert "Good().run()" in html.split("For example:</p>", 1)[1].split("</pre>", 1)[0]


@pytest.fixture(scope="module")
def broken_build(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One build with every defect at once: strict mkdocs reports each warning, then fails."""
    root = tmp_path_factory.mktemp("broken-site")
    pages = {
        **GOOD_PAGES,
        "orphan.md": "# Not in the navigation\n",
        "links.md": "# Links\n\n[a](missing.md), [b](api.md#nowhere), [c][fixturepkg.Gone], "
        "[d](../examples/gone.py)\n",
        "broken.md": "# Broken\n\n::: fixturepkg.broken\n",
    }
    proc = _build(root, pages, ["index.md", "api.md", "links.md", "broken.md"])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    return root, proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "message",
    [
        pytest.param(
            'are not included in the "nav" configuration:\n  - orphan.md',
            id="a page missing from the navigation",
        ),
        pytest.param(
            "Doc file 'links.md' contains a link 'missing.md', but the target is not found",
            id="a link to a missing page",
        ),
        pytest.param(
            "Doc file 'links.md' contains a link 'api.md#nowhere', but the doc 'api.md' does "
            "not contain an anchor '#nowhere'",
            id="a link to a missing anchor",
        ),
        pytest.param(
            "Doc file 'links.md' contains a link '../examples/gone.py' to the repository file "
            "'examples/gone.py', which does not exist.",
            id="a link to a repository file that does not exist",
        ),
        pytest.param(
            "links.md: Could not find cross-reference target 'fixturepkg.Gone'",
            id="a page's reference to a name that does not exist",
        ),
        pytest.param(
            "broken.md: from {root}/src/fixturepkg/broken.py:7: (fixturepkg.broken.Broken) "
            "Could not find cross-reference target 'NoSuchThing'",
            id="a docstring's reference to a name that does not exist",
        ),
    ],
)
def test_the_strict_build_fails_naming_the_page(
    broken_build: tuple[Path, str], message: str
) -> None:
    root, output = broken_build
    assert message.format(root=root) in output
    assert "Aborted with 6 warnings in strict mode!" in output


@pytest.mark.slow
def test_a_reference_page_for_a_module_that_does_not_exist_fails_naming_the_page(
    tmp_path: Path,
) -> None:
    pages = {**GOOD_PAGES, "missing.md": "# Missing\n\n::: trainbus.nonexistent\n"}
    proc = _build(tmp_path, pages, ["index.md", "api.md", "missing.md"])
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output
    assert "Error reading page 'missing.md'" in output
    assert "Could not collect 'trainbus.nonexistent'" in output


@pytest.mark.slow
def test_the_real_site_builds_strict(tmp_path: Path) -> None:
    """What ``make docs`` runs, into a temporary directory: every page, the whole reference."""
    pytest.importorskip("mkdocs")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "-f",
            str(CONFIG),
            "-d",
            str(tmp_path / "site"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for module in ("trainbus", "trainbus.bus", "trainbus.integrations.optuna"):
        assert (tmp_path / "site" / "reference" / module / "index.html").is_file(), module
