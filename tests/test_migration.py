"""src/trainbus/migration.toml: every trainbus name it gives exists, and docs/migration.md is its
rendering (with the ``TrainingArguments`` table from ``trainbus._trainer.hf_options``, which the
Trainer's ``TypeError`` for a Hugging Face option name reads too).

Run ``python tests/test_migration.py`` to rewrite docs/migration.md after editing the data.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

import trainbus
from trainbus import commands, events
from trainbus._hookpoints import HOOK_POINTS
from trainbus._trainer.hf_options import HF_OPTIONS

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "src" / "trainbus" / "migration.toml"
PAGE = ROOT / "docs" / "migration.md"


def load() -> dict[str, Any]:
    """The parsed table."""
    with DATA.open("rb") as f:
        return tomllib.load(f)


def events_of(entry: dict[str, Any]) -> list[str]:
    """The event class names of a row (``event`` is one name or a list)."""
    event = entry.get("event", [])
    return [event] if isinstance(event, str) else list(event)


def _match_text(match: dict[str, Any]) -> str:
    parts = [f"{k}={v!r}" if not isinstance(v, list) else f"{k} in {tuple(v)!r}"
             for k, v in match.items()]  # fmt: skip
    return " where " + ", ".join(f"`{p}`".replace("'", '"') for p in parts)


def render(data: dict[str, Any]) -> str:
    """docs/migration.md from the table: one section per framework."""
    lines = [
        "# Migrating from other trainers",
        "",
        "<!-- generated from src/trainbus/migration.toml by `python tests/test_migration.py`; "
        "edit the data -->",
        "",
        "Each hook of the trainer you come from, next to what replaces it in trainbus: an "
        "**event** (subscribe with `on_<event_in_snake_case>` on a `Callback`, or "
        "`bus.stream(ev.X)`), an inline **hook** point (`hook_<point>` on a `Callback`, or "
        "`trainer.add_hook(point, fn)`, when you must change the step), a **command** (send "
        "it on `bus.commands`), or a **method** of `Callback` to override. A row with none of "
        "them has no equivalent yet; its note says "
        "what to use instead. An event `where` a field has a value narrows the row to those "
        "events. A **differs** note says where the framework's own calls differ from the row's "
        "in count or order: tests/test_parity.py replays Hugging Face's and Composer's own hook "
        "tests against trainbus through this table, and fails on a difference not stated here. "
        "See [events.md](events.md) and [trainer.md](trainer.md).",
    ]
    for key, fw in data["frameworks"].items():
        lines += ["", f"## {fw['title']}", "", f"Names: {fw['source']}.", ""]
        lines += ["| hook | trainbus | note |", "|---|---|---|"]
        for e in data["entries"]:
            if e["framework"] != key:
                continue
            names = events_of(e)
            event = ""
            if names:
                event = ("event " if len(names) == 1 else "events ") + ", ".join(
                    f"`{n}`" for n in names
                )
                event += _match_text(e["match"]) if "match" in e else ""
            parts = [event,
                     f"hook `{e['hook']}`" if "hook" in e else "",
                     f"command `{e['command']}`" if "command" in e else "",
                     f"method `{e['method']}()`" if "method" in e else ""]  # fmt: skip
            target = ", ".join(p for p in parts if p) or "none yet"
            note = e.get("note", "")
            for d in e.get("differs", []):
                note += ("; " if note else "") + f"**differs:** {d['text']}"
            lines.append(f"| `{e['name']}` | {target} | {note} |")
    return "\n".join(lines + render_hf_options()) + "\n"


def render_hf_options() -> list[str]:
    """The ``TrainingArguments`` section, from the table the Trainer's ``TypeError`` reads."""
    lines = [
        "",
        "## Hugging Face `TrainingArguments`",
        "",
        "Each `transformers.TrainingArguments` field you are likely to set (and the `Trainer` "
        "arguments and `EarlyStoppingCallback`'s patience) next to what replaces it. Passed to "
        "trainbus' `Trainer`, such a name is a `TypeError` that names the replacement (from "
        "this same table, `trainbus/_trainer/hf_options.py`).",
        "",
        "| Hugging Face | trainbus |",
        "|---|---|",
    ]
    for hf in HF_OPTIONS:
        where = "" if hf.source == "TrainingArguments" else f" ({hf.source})"
        old = "" if hf.current else " (an older spelling)"
        lines.append(f"| `{hf.name}`{where}{old} | {hf.use} |")
    return lines


ENTRIES = load()["entries"]


def test_every_framework_is_covered() -> None:
    data = load()
    assert set(data["frameworks"]) == {"huggingface", "lightning", "composer", "cerebras",
                                       "instructlab"}  # fmt: skip
    for key in data["frameworks"]:
        assert sum(e["framework"] == key for e in ENTRIES) >= 3, key
    assert {e["framework"] for e in ENTRIES} <= set(data["frameworks"])
    for fw in data["frameworks"].values():
        assert set(fw) <= {"title", "source", "hooks"}


@pytest.mark.parametrize("entry", ENTRIES, ids=[f"{e['framework']}:{e['name']}" for e in ENTRIES])
def test_entry_names_exist_in_trainbus(entry: dict[str, Any]) -> None:
    assert set(entry) <= {"framework", "name", "event", "hook", "command", "method", "note",
                          "match", "differs"}  # fmt: skip
    for name in events_of(entry):
        cls = getattr(events, name, None)
        assert isinstance(cls, type) and issubclass(cls, events.BaseEvent), entry
        for field, value in entry.get("match", {}).items():
            assert field in cls.__dataclass_fields__, (entry["name"], name, field)
            assert isinstance(value, str | int | list), entry
    if "match" in entry:
        assert events_of(entry), f"{entry['name']}: a match narrows the row's events"
    for d in entry.get("differs", []):
        assert set(d) == {"kind", "text"} and d["kind"] and d["text"], entry
    if "hook" in entry:
        assert entry["hook"] in HOOK_POINTS, entry
    if "command" in entry:
        assert isinstance(getattr(commands, entry["command"], None), type), entry
    if "method" in entry:
        owner, _, method = entry["method"].partition(".")
        assert callable(getattr(getattr(trainbus, owner, None), method, None)), entry
    if not {"event", "hook", "command", "method"} & set(entry):
        assert entry.get("note"), f"{entry['name']}: no equivalent needs a note saying what to use"


@pytest.mark.parametrize("framework", ["huggingface", "lightning", "composer", "cerebras"])
def test_every_hook_of_the_framework_has_a_row(framework: str) -> None:
    """The ``hooks`` list is the framework's whole hook list (from its source): each has a row
    naming what replaces it, or a note saying why there is none, so coverage cannot shrink."""
    hooks = load()["frameworks"][framework]["hooks"]
    assert len(hooks) == len(set(hooks)) >= 15
    rows = {e["name"] for e in ENTRIES if e["framework"] == framework}
    missing = [h for h in hooks if h not in rows]
    assert not missing, f"{framework}: hooks without a row: {missing}"


def test_the_new_events_and_points_are_mapped() -> None:
    """Every event and hook point added for the users of these frameworks is named by a row."""
    mapped_events = {n for e in ENTRIES for n in events_of(e)}
    mapped_hooks = {e["hook"] for e in ENTRIES if "hook" in e}
    for name in ("TrainerBuilt", "SpanTraced", "EvalBatchStarted",
                 "EvaluationRoundStarted", "EvaluationRoundEnded", "PredictionStarted",
                 "PredictionBatchEnded", "PredictionEnded", "CheckpointSaving",
                 "CheckpointLoading"):  # fmt: skip
        assert name in mapped_events, name
    assert set(HOOK_POINTS) <= mapped_hooks
    # Every traced part stands for some peer's hook.
    spans = {e["match"]["span"] for e in ENTRIES if "SpanTraced" in events_of(e)}
    assert spans == set(events.TRACED_SPANS), spans


def test_callback_state_rows_name_the_callback_methods() -> None:
    """Lightning's ``state_dict`` / ``load_state_dict`` have their equivalent in ``Callback``:
    the rows say so instead of "none yet"."""
    rows = {e["name"]: e for e in ENTRIES if e["framework"] == "lightning"}
    assert rows["state_dict"].get("method") == "Callback.state_dict"
    assert rows["load_state_dict"].get("method") == "Callback.load_state_dict"
    page = PAGE.read_text(encoding="utf-8")
    assert "| `state_dict` | method `Callback.state_dict()` |" in page
    assert "| `load_state_dict` | method `Callback.load_state_dict()` |" in page


def test_no_duplicate_rows() -> None:
    keys = [(e["framework"], e["name"]) for e in ENTRIES]
    assert len(keys) == len(set(keys))


def test_page_is_the_rendered_table() -> None:
    assert PAGE.read_text(encoding="utf-8") == render(load()), (
        "docs/migration.md is stale: run `python tests/test_migration.py`"
    )


if __name__ == "__main__":
    PAGE.write_text(render(load()), encoding="utf-8")
    sys.stdout.write(f"wrote {PAGE}\n")
