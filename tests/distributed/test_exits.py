"""Reading torchrun's failure summary: each rank with its own exit code (the launcher's errors)."""

from __future__ import annotations

from trainbus._launcher import RankExits

# What torchrun 2.x prints when rank 1 is SIGKILLed and it then stops rank 0 (abridged).
SUMMARY = """\
[default0]:step 5
E1126 03:50:01.000 4700 api.py:900] failed (exitcode: -9) local_rank: 1 (pid: 4712) of binary: py
Traceback (most recent call last):
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
link_worker.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-26_03:50:01
  host      : box
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 4711)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 4711
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-26_03:50:01
  host      : box
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 4712)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 4712
============================================================
"""


def read(text: str) -> RankExits:
    exits = RankExits()
    for line in text.splitlines():
        exits.feed(line)
    return exits


def test_the_root_cause_is_the_first_failure_with_its_own_code() -> None:
    exits = read(SUMMARY)
    first = exits.root_cause
    assert first is not None
    assert (first.rank, first.local_rank, first.exitcode, first.signal) == (1, 1, -9, "SIGKILL")
    assert first.describe() == "rank 1 exited with code -9 (SIGKILL)"
    assert [(e.rank, e.exitcode, e.root_cause) for e in exits.exits] == [
        (0, -15, False),
        (1, -9, True),
    ]


def test_a_single_block_without_root_cause_header_and_a_plain_exit_code() -> None:
    text = "Failures:\n  rank      : 0 (local_rank: 0)\n  exitcode  : 3 (pid: 1)\n"
    first = read(text).root_cause
    assert first is not None and first.exitcode == 3 and first.signal is None
    assert first.describe() == "rank 0 exited with code 3"


def test_a_rank_line_is_paired_only_with_the_exitcode_right_under_it() -> None:
    text = "  rank      : 1 (local_rank: 1)\n  host : x\n  exitcode  : -15 (pid: 1)\n"
    exits = read(text)
    assert exits.exits == () and exits.root_cause is None
    assert read("nothing to see\n").root_cause is None
