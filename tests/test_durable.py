"""What a checkpoint writer makes durable: every file's data and every new name's folder.

``os.fsync`` is recorded by the path of the descriptor it gets (Linux: ``/proc/self/fd``), so a
copy that forgot a file or the folder of its new name fails here, without a power cut.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from trainbus.callbacks._checkpoint import copy_as_best

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/fd")


@pytest.fixture
def synced(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The paths ``os.fsync`` is called on, in order."""
    paths: list[Path] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        paths.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return paths


def test_the_best_copy_of_a_file_is_synced_with_its_name(
    tmp_path: Path, synced: list[Path]
) -> None:
    source = tmp_path / "step-00000004.pt"
    source.write_bytes(b"weights")
    best = copy_as_best(source, 4)
    assert best.read_bytes() == b"weights"
    # The data, under its temporary name (renamed since), then the folder holding the new name.
    assert synced[-1] == tmp_path
    assert synced[0].parent == tmp_path and synced[0].name.endswith(".copy-tmp")


def test_the_best_copy_of_a_sharded_folder_syncs_every_file_and_folder(
    tmp_path: Path, synced: list[Path]
) -> None:
    source = tmp_path / "step-00000007"
    (source / "shards").mkdir(parents=True)
    (source / "trainbus.pt").write_bytes(b"meta")
    (source / "shards" / "__0_0.distcp").write_bytes(b"rank 0")
    (source / "shards" / "__1_0.distcp").write_bytes(b"rank 1")
    best = copy_as_best(source, 7)
    assert (best / "shards" / "__1_0.distcp").read_bytes() == b"rank 1"
    tmp = synced[0].parents[1]  # the temporary folder the copy was made in, renamed since
    assert tmp.name.endswith(".copy-tmp")
    relative = {p.relative_to(tmp).as_posix() for p in synced if p.is_relative_to(tmp)}
    assert relative == {"trainbus.pt", "shards/__0_0.distcp", "shards/__1_0.distcp", "shards", "."}
    assert synced[-1] == tmp_path  # the folder holding the new name, last
