"""An mkdocs hook (mkdocs.yml, ``hooks``): links from a page to a file of the repository outside
docs/ (``[the script](../examples/sweep_optuna.py)``).

Such a link works where the pages are read as files (on GitHub, in an editor) but has no target
in the site, which mkdocs' validation reports and ``--strict`` fails on. Here it is checked and
shown as the file's path instead:

- the file or folder exists: the link becomes its path as code (``the script
  (`examples/sweep_optuna.py`)``; just the code when the link's text is the path);
- it does not: a warning naming the page and the link, so the strict build fails as it does
  for a link to a missing page.

Links inside docs/ and to other sites are left to mkdocs.
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path
from typing import Any

log = logging.getLogger("mkdocs.hooks.repo_links")

# An inline link (not an image) whose target climbs out of its page's folder; the fragment apart.
LINK = re.compile(
    r"(?<!!)\[(?P<text>[^\]\n]+)\]\((?P<target>\.\./[^)#\s]*)(?P<fragment>#[^)\s]*)?\)"
)
# Fenced code blocks: their text is code, never links.
FENCE = re.compile(r"^(?P<fence>`{3,}|~{3,}).*?^(?P=fence)[ \t]*$", re.M | re.S)


def on_page_markdown(markdown: str, *, page: Any, config: Any, files: Any) -> str:
    root = Path(config["config_file_path"]).resolve().parent
    docs = Path(config["docs_dir"]).resolve()
    page_dir = posixpath.dirname(page.file.src_uri)

    def replace(match: re.Match[str]) -> str:
        target = match["target"]
        path = (docs / page_dir / target).resolve()
        if path.is_relative_to(docs) or not path.is_relative_to(root):
            return match[0]
        shown = path.relative_to(root).as_posix() + ("/" if target.endswith("/") else "")
        if not path.exists():
            log.warning(
                f"Doc file '{page.file.src_uri}' contains a link '{target}' to the repository "
                f"file '{shown}', which does not exist."
            )
        text = match["text"].strip("`")
        return (
            f"`{shown}`"
            if text.rstrip("/") == shown.rstrip("/")
            else f"{match['text']} (`{shown}`)"
        )

    parts: list[str] = []
    end = 0
    for fence in FENCE.finditer(markdown):
        parts.append(LINK.sub(replace, markdown[end : fence.start()]))
        parts.append(fence[0])
        end = fence.end()
    parts.append(LINK.sub(replace, markdown[end:]))
    return "".join(parts)
