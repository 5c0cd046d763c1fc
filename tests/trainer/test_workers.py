"""DataLoader iterators end with the call that opened them.

A sweep of runs in one process (a notebook) with persistent workers: ``fit``, ``evaluate`` and
``predict`` each leave no worker process behind, and nothing is printed: no worker inherits a
live iterator of an earlier run, whose ``__del__`` there fails with ``AssertionError: can only
test a child process``. Run in a subprocess, as a user's script, to read its stderr whole.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform == "win32", reason="fork"),
    pytest.mark.timeout(300),
]

SCRIPT = textwrap.dedent(
    """
    import gc
    import multiprocessing
    import sys

    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from trainbus import Trainer

    method = sys.argv[1]
    data = TensorDataset(torch.randn(64, 8), torch.randint(0, 3, (64,)))


    def collect(worker_id):
        # What a worker's own allocations trigger sooner or later: a collection, which
        # finalizes whatever garbage the fork copied from the parent (an earlier run's
        # trainer, loaders and their persistent iterators).
        gc.collect()


    def loader(batch_size):
        # Pinned where the batches go to a GPU, as a CUDA run asks (its one-time hint otherwise).
        return DataLoader(data, batch_size=batch_size, num_workers=2, persistent_workers=True,
                          worker_init_fn=collect, multiprocessing_context=method,
                          pin_memory=torch.cuda.is_available())


    def workers():
        return len(multiprocessing.active_children())


    if __name__ == "__main__":
        for run in range(3):
            model = torch.nn.Linear(8, 3)
            trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loader(4),
                              loss_fn=F.cross_entropy, eval_data=loader(8), max_steps=20,
                              eval_every=10, progress=False)
            result = trainer.fit_sync()
            print("FIT", run, result.reason, workers(), flush=True)
            trainer.evaluate_sync()
            print("EVALUATE", run, workers(), flush=True)
            out = trainer.predict_sync(loader(16), return_outputs=True)
            print("PREDICT", run, tuple(out.shape), workers(), flush=True)
        print("DONE", flush=True)
    """
)


# Forked workers are the ones that inherit an earlier run's iterators. (A spawned worker starts
# a fresh interpreter: each one imports torch, over ten seconds apiece on the loaded CI machine.)
@pytest.mark.parametrize("method", ["fork"])
def test_a_sweep_of_runs_leaves_no_workers_and_prints_nothing(tmp_path: Path, method: str) -> None:
    script = tmp_path / "sweep.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script), method], capture_output=True, text=True,
                          timeout=280)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-1] == "DONE", proc.stdout + proc.stderr
    calls = [line.split() for line in lines[:-1]]
    assert [c[0] for c in calls] == ["FIT", "EVALUATE", "PREDICT"] * 3
    # The workers were running during each call; none is left after it.
    assert all(c[-1] == "0" for c in calls), proc.stdout
    assert all(c[2] == "completed" for c in calls if c[0] == "FIT")
    assert proc.stderr == "", proc.stderr
