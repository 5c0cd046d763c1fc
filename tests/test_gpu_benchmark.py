"""benchmarks/gpu_step.py on a host without a GPU: a clear message and exit 0 (CI runs it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="measures for minutes on a GPU host")
def test_gpu_step_without_a_gpu_says_so_and_exits_0(tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_step.py")], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "no CUDA GPU here" in done.stdout and "nothing measured" in done.stdout
