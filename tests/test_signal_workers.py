"""One Ctrl-C is one Ctrl-C with DataLoader workers (issue 22 item 3).

A terminal sends SIGINT to the whole foreground process group: the training process and its
DataLoader workers. The run must stop as for one SIGINT (a final checkpoint, a normal exit),
whether the workers were forked (they would run a copy of trainbus' handler) or spawned (they
would raise KeyboardInterrupt, exit, and fail the batch the loop waits for).
Each test runs a real training script in its own session, waits for its READY line, then
signals the group once. Timeouts are deadlock guards only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals and process groups"),
]

GUARD_S = 90.0

SCRIPT = textwrap.dedent(
    """
    import sys
    import time

    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, Dataset

    from trainbus import Trainer
    from trainbus import events as ev


    class SlowData(Dataset):
        # Slow items: the loop spends its time waiting for the workers' next batch, which is
        # where a worker that died of the Ctrl-C fails the run.
        def __len__(self):
            return 100_000

        def __getitem__(self, i):
            time.sleep(0.02)
            g = torch.Generator().manual_seed(i)
            return torch.randn(8, generator=g), i % 3


    if __name__ == "__main__":
        method, ckpt = sys.argv[1], sys.argv[2]
        loader = DataLoader(SlowData(), batch_size=4, num_workers=2,
                            multiprocessing_context=method)
        model = torch.nn.Linear(8, 3)
        trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), loader,
                          loss_fn=F.cross_entropy, max_steps=1_000_000, checkpoint_dir=ckpt,
                          progress=False)
        ready = []

        def on_step(event):
            if event.step >= 3 and not ready:
                ready.append(event.step)
                print("READY", flush=True)

        trainer.bus.subscribe(trainer.bus.stream(ev.StepEnded), on_step)
        try:
            trainer.fit_sync()
            raised = "returned"
        except KeyboardInterrupt:  # on_signal="raise", the default: after the graceful stop
            raised = "KeyboardInterrupt"
        result = trainer.result
        print("RESULT", result.reason, result.stop_reason, result.last_checkpoint, raised,
              flush=True)
    """
)


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_one_sigint_to_the_process_group_stops_gracefully(tmp_path: Path, method: str) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    ckpt = tmp_path / "ckpt"
    proc = subprocess.Popen(
        [sys.executable, str(script), method, str(ckpt)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    output: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            output.append(line.rstrip("\n"))
            if line.strip() == "READY":
                os.killpg(proc.pid, signal.SIGINT)  # once, to the group: a Ctrl-C
                break
        rest, _ = proc.communicate(timeout=GUARD_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    output += rest.splitlines()
    text = "\n".join(output)
    assert proc.returncode == 0, text
    results = [line.split() for line in output if line.startswith("RESULT ")]
    assert len(results) == 1, text
    _, reason, stop_reason, checkpoint, raised = results[0]
    assert (reason, stop_reason, raised) == ("stopped", "signal", "KeyboardInterrupt"), text
    assert checkpoint.endswith("-final.pt") and Path(checkpoint).is_file(), text
    # One Ctrl-C is one signal to the trainer: no worker ran its handler, nothing aborted.
    received = [line for line in output if "signal_received" in line]
    assert len(received) == 1 and "stop after this step" in received[0], text
    assert "abort" not in text and "exited unexpectedly" not in text, text
