"""Every ```python block in README.md and docs/**/*.md runs as a test, through Sybil.

A page runs top to bottom in one namespace, as a reader would paste it: its setup is a visible
block on the page, never here. This file only adds what keeps the run honest:

- a block that is not meant to run is marked ``<!-- skip: next "reason" -->``; the reason is
  required, is shown in pytest's skip summary and must also stand in the page's visible text;
- an invisible block (``<!-- invisible-code-block: ... -->``) or a Python block labelled
  ``py``/``python3``/``pycon`` (which Sybil would silently leave unrun) is an error on its line;
- a page must not write into the repository (write into ``tempfile.mkdtemp()``); the working
  directory and the environment variables a page changes are restored after its last block.

How to mark and write blocks: docs/testing.md, "How the docs are tested".
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from sybil import Document, Example, Region, Sybil
from sybil.integration.pytest import SybilFile, SybilItem
from sybil.parsers.abstract.lexers import LexerCollection
from sybil.parsers.markdown import CodeBlockParser, PythonCodeBlockParser, SkipParser
from sybil.parsers.markdown.lexers import FencedCodeBlockLexer

ROOT = Path(__file__).resolve().parent

# What a page may create under the repository without being blamed: caches and environments.
_IGNORED_DIRS = {".git", "__pycache__", "node_modules"}

# Anchored at a line start as Sybil's own directives are, so prose may name them in `code`.
_INVISIBLE = re.compile(r"^[ \t]*<!--+\s*invisible-code(-block)?\b", re.IGNORECASE | re.MULTILINE)
_UNRUN_LABEL = re.compile(r"^[ \t]*(`{3,}|~{3,})[ \t]*(py|python3|pycon|ipython|py3)\b", re.M)
_COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)


class DocRuleBroken(AssertionError):
    """A page breaks one of the rules above; the message says which and how to fix it."""


def _broken(message: str) -> Any:
    def evaluate(example: Example) -> None:
        raise DocRuleBroken(f"{example.path}, line {example.line}: {message}")

    return evaluate


class _FencedOnly(CodeBlockParser):
    """Sybil's Markdown code-block parser without its invisible-block lexer: only what shows."""

    def __init__(self, language: str | None = None, evaluator: Any = None) -> None:
        super().__init__(language, evaluator)
        self.lexers = LexerCollection(
            [
                FencedCodeBlockLexer(
                    language=r".+", mapping={"language": "arguments", "source": "source"}
                )
            ]
        )


class VisiblePythonParser(PythonCodeBlockParser):
    """Every visible ```python block (doctest-style ``>>>`` blocks included)."""

    codeblock_parser_class = _FencedOnly


class DocRulesParser:
    """A Sybil parser whose regions fail where a page breaks the rules of this file."""

    def __call__(self, document: Document) -> Iterable[Region]:
        text = document.text
        for m in _INVISIBLE.finditer(text):
            yield Region(
                m.start(),
                m.end(),
                None,
                _broken(
                    "an invisible code block hides setup from the reader; "
                    "show it in a ```python block the page introduces (e.g. 'Setup for this page:')"
                ),
            )
        for m in _UNRUN_LABEL.finditer(text):
            yield Region(
                m.start(2),
                m.end(2),
                None,
                _broken(
                    f"a block labelled {m.group(2)!r} is never run; label it ```python "
                    "(or ```text for output and shell sessions)"
                ),
            )


class ReasonedSkipParser(SkipParser):
    """Sybil's ``skip`` directive, refused (the directive fails in its place) without a quoted
    reason that the page's visible text also says."""

    def __call__(self, document: Document) -> Iterable[Region]:
        visible = " ".join(_COMMENT.sub("", document.text).split())
        for region in super().__call__(document):
            action, reason = region.parsed
            if action == "end":
                yield region
                continue
            quoted = re.fullmatch(r"""\s*(["'])(?P<text>.+)\1\s*""", reason or "")
            if quoted is None:
                message = (
                    f"'skip: {action}' needs a quoted reason, e.g. "
                    '<!-- skip: next "needs a GPU" -->, and the same words in the page\'s text '
                    "where the reader sees them"
                )
            elif " ".join(quoted.group("text").split()) not in visible:
                message = (
                    f"the skip reason {quoted.group('text')!r} is only in an HTML comment, "
                    "which the reader never sees; say it in the page's text too"
                )
            else:
                yield region
                continue
            yield Region(region.start, region.end, None, _broken(message))


def _repository_files() -> set[str]:
    found: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [
            d
            for d in dirnames
            if d not in _IGNORED_DIRS and not d.startswith(".") and not d.endswith(".egg-info")
        ]
        rel = os.path.relpath(dirpath, ROOT)
        found.update(os.path.normpath(os.path.join(rel, f)) for f in filenames)
    return found


def _page_setup(namespace: dict[str, Any]) -> None:
    namespace["__doc_cwd__"] = os.getcwd()
    namespace["__doc_environ__"] = dict(os.environ)
    namespace["__doc_files__"] = _repository_files()


def _page_teardown(namespace: dict[str, Any]) -> None:
    # What a page changed for its own run (its scratch directory, WANDB_MODE...) ends with it.
    os.chdir(namespace.pop("__doc_cwd__"))
    environ = namespace.pop("__doc_environ__")
    for name in set(os.environ) - set(environ):
        del os.environ[name]
    os.environ.update(environ)
    new = sorted(_repository_files() - namespace.pop("__doc_files__"))
    if new:
        raise DocRuleBroken(
            f"the page wrote into the repository: {', '.join(new[:5])}"
            f"{' ...' if len(new) > 5 else ''}; write into a temporary directory "
            "(tmp = tempfile.mkdtemp()) shown on the page"
        )


DOCS = Sybil(
    parsers=[DocRulesParser(), VisiblePythonParser(), ReasonedSkipParser()],
    patterns=["README.md", "docs/*.md", "docs/**/*.md"],
    setup=_page_setup,
    teardown=_page_teardown,
    name="docs",
)


class _DocItem(SybilItem):
    def _traceback_filter(self, excinfo: pytest.ExceptionInfo[BaseException]) -> Any:
        try:
            return super()._traceback_filter(excinfo)
        except IndexError:
            # Sybil's filter expects the block's own frame below its evaluator; an exception
            # raised outside it (a ResourceWarning turned error when garbage is collected) has
            # none, and Sybil 10.1 would crash pytest (INTERNALERROR) instead of failing the block.
            return excinfo.traceback


class _DocFile(SybilFile):
    """Sybil's pytest file, its items the ones above (the same loop as ``SybilFile.collect``)."""

    def collect(self) -> Iterable[_DocItem]:
        for sybil in self.sybils:
            document = sybil.parse(self.path)
            self.documents.append(document)
            for example in document.examples():
                yield _DocItem.from_parent(self, sybil=sybil, example=example)


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> _DocFile | None:
    if DOCS.should_parse(file_path):
        return _DocFile.from_parent(parent, path=file_path, sybils=[DOCS])
    return None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """A skipped block is reported at its page and line, not where Sybil raised SkipTest."""
    report = yield
    if isinstance(item, SybilItem) and report.skipped and isinstance(report.longrepr, tuple):
        report.longrepr = (str(item.path), item.example.line, report.longrepr[2])
    return report
