"""A Ctrl-C while a call's end waits for async subscribers cancels their pending work.

By default the end of ``fit()`` waits up to ``close_timeout`` (300 s) for async subscribers,
with a ``bus_close_waiting`` notice. A real subprocess runs a short fit whose async subscriber
never finishes an item; once the notice is printed, the test sends SIGINT: the pending items
are cancelled, counted as lost work in ``FitResult.lost_work``, and the process ends normally.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals"),
]

GUARD_S = 60.0  # a deadlock guard only

SCRIPT = textwrap.dedent(
    """
    import anyio
    import structlog
    import torch
    import torch.nn.functional as F

    from trainbus import Trainer
    from trainbus import events as ev
    from trainbus.testing import tiny_loader, tiny_model


    def announce(logger, method, event_dict):
        if event_dict.get("event") == "bus_close_waiting":
            print("WAITING", sorted(event_dict["pending"].items()), flush=True)
        return event_dict


    structlog.configure(processors=[announce, structlog.processors.KeyValueRenderer()])

    model = tiny_model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(6, 8),
                      loss_fn=F.cross_entropy, max_steps=6, progress=False)


    async def hang(event):
        await anyio.sleep_forever()  # a service that never answers


    trainer.bus.subscribe_async(trainer.bus.stream(ev.StepEnded), hang, name="hang",
                                buffer=100)
    result = trainer.fit_sync()
    print("RESULT", result.reason, result.steps, result.lost_work["hang"].cancelled,
          sum(x.total for x in result.lost_work.values()), flush=True)
    """
)


def test_ctrl_c_while_a_call_end_waits_cancels_the_pending_work(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    output: list[str] = []
    with subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    ) as proc:
        guard = threading.Timer(GUARD_S, proc.kill)
        guard.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                output.append(line.rstrip("\n"))
                if line.startswith("WAITING"):
                    # Training is over (6 steps) and the call's end waits for "hang".
                    proc.send_signal(signal.SIGINT)
            code = proc.wait()
        finally:
            guard.cancel()
    text = "\n".join(output)
    assert code == 0, text
    waiting = [x for x in output if x.startswith("WAITING")]
    assert waiting == ["WAITING [('hang', 6)]"], text  # one notice, naming who and how much
    assert "cancel pending async work" in text, text
    (result,) = [x.split() for x in output if x.startswith("RESULT")]
    # Completed training; the six items it held (one running, five queued) cancelled and lost.
    assert result == ["RESULT", "completed", "6", "6", "6"], text
