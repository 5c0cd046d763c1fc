"""TensorBoard: training and evaluation scalars, learning rate, throughput and hparams."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .. import events as ev
from .._exceptions import ConfigError, MissingExtraError
from .._validate import check_folder, check_seconds
from ._base import Callback
from ._logging import write_in_batches

if TYPE_CHECKING:
    from .._bus import EventBus

__all__ = ["TensorBoardLogger"]

_Scalars = list[tuple[str, float, int]]


def _scalars(event: ev.BaseEvent) -> _Scalars:
    """The (tag, value, step) scalars one event contributes."""
    match event:
        case ev.MetricsLogged(metrics=m):
            return [(f"train/{k}", float(v), event.step) for k, v in m.items()]
        case ev.EvaluationEnded(metrics=m, error=None):
            return [(f"eval/{k}", float(v), event.step) for k, v in m.items()]
        case ev.ExternalEvaluationEnded(metrics=m, error=None):
            return [(f"external/{k}", float(v), event.step) for k, v in m.items()]
        case ev.SchedulerStepped(lr=lr):
            return [("lr", float(lr), event.step)]
    return []


class TensorBoardLogger(Callback):
    """Writes a run to TensorBoard event files in ``log_dir``.

    ===========================  ===============================================================
    event                        written
    ===========================  ===============================================================
    FitStarted                   hparams: ``hparams=`` with max_steps, max_epochs, device
    MetricsLogged                ``train/<key>``: loss, lr, grad_norm, steps_per_s,
                                 samples_per_s (LR and throughput come with these)
    EvaluationEnded              ``eval/<key>`` (val_loss, val_<metric>); failed ones skipped
    ExternalEvaluationEnded      ``external/<key>`` (EvaluateCheckpoints jobs)
    SchedulerStepped             ``lr`` (each scheduler step)
    FitEnded                     flush and close
    ===========================  ===============================================================

    Every ``SummaryWriter`` call runs in a worker thread, a batch of ``flush_s`` seconds at a
    time (see :func:`write_in_batches`).

    Args:
        log_dir: Folder for the event files (``SummaryWriter(log_dir)``).
        hparams: Hyper-parameters to record at the start (str, bool, int or float values).
        flush_s: Seconds of events per written batch (> 0).

    Raises:
        MissingExtraError: the ``tensorboard`` package is not installed.
        ConfigError: a bad ``log_dir``, ``hparams`` or ``flush_s``.
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        *,
        hparams: Mapping[str, Any] | None = None,
        flush_s: float = 1.0,
    ) -> None:
        try:  # imported here: trainbus never needs tensorboard unless this logger is used
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise MissingExtraError("TensorBoardLogger", "tensorboard", "tensorboard") from exc
        self._writer_type = SummaryWriter
        self.log_dir = check_folder("log_dir", log_dir)
        hparams = dict(hparams or {})
        for k, v in hparams.items():
            if not isinstance(k, str) or not isinstance(v, str | bool | int | float):
                raise ConfigError.invalid(f"hparams[{k!r}]", v, "a str, bool, int or float")
        self.hparams = hparams
        self.flush_s = check_seconds("flush_s", flush_s)
        self._writer: Any = None

    def setup(self, bus: EventBus) -> None:
        """Subscribe the batching pipeline and its writer."""
        source = bus.stream(
            ev.FitStarted, ev.MetricsLogged, ev.EvaluationEnded, ev.ExternalEvaluationEnded,
            ev.SchedulerStepped, ev.FitEnded,
        )  # fmt: skip

        write_in_batches(bus, source, self._write, flush_s=self.flush_s, name="TensorBoardLogger")

    def _write(self, batch: list[ev.BaseEvent]) -> None:
        # Worker thread only; batches come one at a time (concurrency 1), so no lock.
        for event in batch:
            if isinstance(event, ev.FitStarted):
                self._writer = self._open(event)
                continue
            writer = self._writer
            if writer is None:
                continue  # added mid-run: nothing to write into until the next FitStarted
            if isinstance(event, ev.FitEnded):
                writer.close()
                self._writer = None
                continue
            for tag, value, step in _scalars(event):
                writer.add_scalar(tag, value, global_step=step)
        if self._writer is not None:
            self._writer.flush()

    def _open(self, started: ev.FitStarted) -> Any:
        writer = self._writer_type(log_dir=os.fspath(self.log_dir))
        run = {"max_steps": started.max_steps, "max_epochs": started.max_epochs,
               "device": started.device}  # fmt: skip
        hparams = {**{k: v for k, v in run.items() if v is not None}, **self.hparams}
        # run_name="." keeps the HPARAMS record in this run's folder (torch's default is a new
        # timestamped sub-folder, which TensorBoard would show as a second run).
        writer.add_hparams(hparams, {}, run_name=".", global_step=started.step)
        return writer
