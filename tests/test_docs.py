"""The docs harness (conftest.py at the repository root): every ```python block of README.md and
docs/ runs as a test through Sybil, and a block that fails, hides its setup or writes into the
repository fails `make test` naming its page and line.

Each test runs pytest in a subprocess on pages of its own, with a copy of the root conftest.py, as
`make test` runs the real pages.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from sybil.evaluators.python import PythonEvaluator

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]


def docs_conftest() -> ModuleType:
    """The root conftest.py, imported under a name of its own (tests/conftest.py is `conftest`)."""
    spec = importlib.util.spec_from_file_location("docs_conftest", ROOT / "conftest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_pages(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, pages: dict[str, str]
) -> pytest.RunResult:
    pytester.makeconftest((ROOT / "conftest.py").read_text())
    pytester.makeini("[pytest]\nfilterwarnings = error\n")
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # only pytest and the conftest
    for name, text in pages.items():
        path = pytester.path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return pytester.runpytest_subprocess("-ra", "-p", "no:cacheprovider")


def test_a_failing_block_fails_the_run_naming_its_page_and_line(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    page = (
        "# A page\n\nSetup for this page:\n\n```python\nx = 1\n```\n\nThen:\n\n"
        "```python\ny = x + 1\nassert y == 3, f'y is {y}'\n```\n"
    )
    # a file left open: a ResourceWarning raised outside the block's frames (Sybil alone would
    # crash pytest with an INTERNALERROR here)
    unclosed = "```python\nopen('out.txt', 'w').write('x')\n```\n"
    result = run_pages(pytester, monkeypatch, {"docs/page.md": page, "docs/unclosed.md": unclosed})
    result.assert_outcomes(passed=1, failed=2, errors=1)  # the error: it wrote out.txt here
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    # the failing line, with the page's own line number, and the test id naming the block's line
    result.stdout.fnmatch_lines(
        [
            "*assert y == 3, f'y is {y}'*",
            "*AssertionError: y is 2*",
            "docs/page.md:13: AssertionError",
            "FAILED docs/page.md::sybil:docs,line:11,column:1 - AssertionError: y is 2*",
            "FAILED docs/unclosed.md::sybil:docs,line:1,column:1 - *Unraisable*",
        ]
    )
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()


def test_the_readme_and_a_nested_page_are_collected_and_run_in_one_namespace_each(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = run_pages(
        pytester,
        monkeypatch,
        {
            "README.md": "```python\nname = 'readme'\n```\n\n```python\nassert name\n```\n",
            "docs/sub/deep.md": "```python\nassert 'name' not in globals()\n```\n",
            "notes/other.md": "```python\nraise SystemExit('not a docs page')\n```\n",
        },
    )
    result.assert_outcomes(passed=3)


def test_a_skipped_block_is_reported_with_its_reason_at_its_page_and_line(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    page = (
        "Not run by the tests: it needs a GPU.\n\n"
        '<!-- skip: next "it needs a GPU" -->\n```python\nraise RuntimeError("ran")\n```\n\n'
        "```python\nassert True\n```\n"
    )
    result = run_pages(pytester, monkeypatch, {"docs/page.md": page})
    result.assert_outcomes(passed=2, skipped=1)  # the directive is an item too
    result.stdout.fnmatch_lines(["SKIPPED [[]1[]] docs/page.md:4: it needs a GPU"])


RULE_BREAKERS = {
    "docs/skip-without-reason.md": (
        "<!-- skip: next -->\n```python\nran = True\n```\n",
        "*docs/skip-without-reason.md, line 1: 'skip: next' needs a quoted reason*",
    ),
    "docs/skip-reason-unseen.md": (
        '<!-- skip: next "slow" -->\n```python\nran = True\n```\n',
        "*docs/skip-reason-unseen.md, line 1: the skip reason 'slow' is only in an HTML comment*",
    ),
    "docs/invisible.md": (
        "<!-- invisible-code-block: python\nx = 1\n-->\n",
        "*docs/invisible.md, line 1: an invisible code block hides setup from the reader*",
    ),
    "docs/py-label.md": (
        "Text.\n\n```py\nraise RuntimeError('never run')\n```\n",
        "*docs/py-label.md, line 3: a block labelled 'py' is never run*",
    ),
}


def test_a_page_breaking_a_rule_fails_naming_page_line_and_rule(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pages = {name: page for name, (page, _) in RULE_BREAKERS.items()}
    result = run_pages(pytester, monkeypatch, pages)
    # each rule fails its page; the blocks after a refused skip directive run (and pass here)
    result.assert_outcomes(failed=len(RULE_BREAKERS), passed=2)
    for _, message in RULE_BREAKERS.values():
        result.stdout.fnmatch_lines([message])


def test_a_page_writing_into_the_repository_fails_and_a_scratch_directory_does_not(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    scratch = (
        "Setup for this page:\n\n```python\nimport os, tempfile\nos.chdir(tempfile.mkdtemp())\n"
        "os.environ['DOC_PAGE_VAR'] = '1'\n```\n\n"
        "```python\nfrom pathlib import Path\nPath('out.txt').write_text('x')\n```\n"
    )
    careless = "```python\nfrom pathlib import Path\nPath('runs-out.txt').write_text('x')\n```\n"
    # b.md runs after a.md: the directory and environment a.md changed are back by then
    after = (
        "```python\nimport os\nassert os.path.exists('conftest.py')\n"
        "assert 'DOC_PAGE_VAR' not in os.environ\n```\n"
    )
    result = run_pages(
        pytester, monkeypatch, {"docs/a.md": scratch, "docs/b.md": after, "docs/c.md": careless}
    )
    result.assert_outcomes(passed=4, errors=1)
    result.stdout.fnmatch_lines(
        ["*the page wrote into the repository: runs-out.txt; write into a temporary directory*"]
    )
    assert not (pytester.path / "out.txt").exists()


def test_every_python_block_of_the_real_docs_is_a_test() -> None:
    """Sybil finds as many Python blocks on each page as the page has ```python fences (an
    indented or quoted fence included), so no block is silently left unrun."""
    docs = docs_conftest().DOCS
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    fence = re.compile(r"^(?:[ \t]*(?:>|[-*+]|\d+[.)])?[ \t]*)```python[ \t]*$", re.M)
    total = 0
    for page in pages:
        assert docs.should_parse(page), page
        expected = len(fence.findall(page.read_text()))
        examples = [
            e
            for e in docs.parse(page).examples()
            if isinstance(e.region.evaluator, PythonEvaluator)
        ]
        assert len(examples) == expected, page
        total += expected
    assert total >= 40


def test_make_test_collects_the_readme_and_every_docs_page(tmp_path: Path) -> None:
    """`python -m pytest` with no arguments (what `make test` and .ci/run run), under the
    project's own pytest configuration, collects README.md and every docs page (here in a copy
    of the repository without tests/, so that collecting stays quick)."""
    for name in ("pyproject.toml", "conftest.py", "README.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        # The project's configuration alone: options from the caller's PYTEST_ADDOPTS (-v
        # changes what --collect-only prints) do not belong to what make test runs.
        env={**os.environ, "PYTHONPATH": str(ROOT / "src"), "PYTEST_ADDOPTS": ""},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    collected = {line.split("::")[0] for line in proc.stdout.splitlines() if "::sybil:" in line}
    pages = {"README.md", *(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))}
    with_blocks = {p for p in pages if "```python" in (ROOT / p).read_text()}
    assert with_blocks <= collected
    assert {"README.md", "docs/trainer.md", "docs/callbacks/wandb.md"} <= collected
