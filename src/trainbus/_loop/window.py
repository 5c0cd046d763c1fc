"""The log window: what the loop reads off the device every ``log_every`` steps, the user's
metrics included (docs/trainer.md, "Metrics of your own")."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

import torch

from .. import events as ev
from .._exceptions import ConfigError
from .._tensors import plain_value
from .nonfinite import mean

if TYPE_CHECKING:
    from .._bus import LoopPort
    from .._distributed.sync import RankSync
    from ..checkpoint import TrainState
    from .nonfinite import NonFiniteGuard
    from .settings import Settings

__all__ = ["TRAIN_METRIC_NAMES", "LogWindow", "UserMetrics"]

TRAIN_METRIC_NAMES = frozenset(
    {"loss", "lr", "steps_per_s", "samples_per_s", "grad_norm", "skipped_nonfinite"}
)
"""The log window's own keys (and ``lr/<name>``): names a user's metric may not take."""


class UserMetrics:
    """The values logged since the last window close, per name (training thread only)."""

    def __init__(self) -> None:
        self._values: dict[str, list[Any]] = {}

    def log(self, name: str, value: torch.Tensor | float) -> None:
        """Add one value of ``name``; ``ConfigError`` for a reserved name or a bad value."""
        reserved = isinstance(name, str) and (name in TRAIN_METRIC_NAMES or name.startswith("lr/"))
        if not isinstance(name, str) or not name or reserved:
            raise ConfigError.invalid(
                "name",
                name,
                "a non-empty string other than the window's own metrics ("
                + ", ".join(sorted(TRAIN_METRIC_NAMES))
                + ", lr/<optimizer>)",
            )
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ConfigError.invalid(
                    f"value of {name!r}",
                    f"a tensor of shape {tuple(value.shape)}",
                    "a number or a one-element tensor",
                )
            kept: Any = value.detach().reshape(())
        elif isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError.invalid(
                f"value of {name!r}", type(value).__name__, "a number or a one-element tensor"
            )
        else:
            kept = float(value)
        self._values.setdefault(name, []).append(kept)

    def take(self) -> dict[str, float]:
        """``{name: mean}`` of the values since the last call (one read per name)."""
        out: dict[str, float] = {}
        for name, values in self._values.items():
            tensors = [v for v in values if isinstance(v, torch.Tensor)]
            floats = [v for v in values if not isinstance(v, torch.Tensor)]
            if tensors:
                floats += [float(x) for x in torch.stack([t.float() for t in tensors]).tolist()]
            out[name] = mean(floats)
        self._values = {}
        return out


class LogWindow:
    """The losses and grad norms between two log steps, read once at :meth:`close`.
    ``sync``: ranks average a closed window in one collective (which also agrees on the first
    non-finite step and on pending commands)."""

    def __init__(
        self,
        settings: Settings,
        port: LoopPort,
        state: TrainState,
        *,
        guard: NonFiniteGuard,
        sync: RankSync | None = None,
    ) -> None:
        self._s, self._port, self._state = settings, port, state
        self._guard = guard
        self._sync = sync
        self._agree = False  # the last reduction found commands waiting on some rank
        self.user = UserMetrics()
        self.metrics: dict[str, float] = {}
        self._checked = 0  # losses of the window already read by check_pending
        # One detached 0-d loss per step taken: the i-th is step step0 + i + 1's.
        self._losses: list[torch.Tensor] = []
        self._norms: list[torch.Tensor] = []
        self._samples = 0
        self._t0 = time.monotonic()
        self._step0 = state.step  # when the window opened: one after a resume may be shorter

    def add(self, loss: torch.Tensor, grad_norm: torch.Tensor | None, samples: int) -> None:
        """Add one optimizer step: its loss (a detached 0-d tensor), grad norm and samples."""
        self._losses.append(loss)
        if grad_norm is not None:
            self._norms.append(plain_value(grad_norm))  # a DTensor norm read as one tensor
        self._samples += samples

    def close(self, publish: bool, epoch: int | None = None) -> ev.MetricsLogged | None:
        """Close the window (one device read); return the ``MetricsLogged`` if ``publish``
        (of ``epoch``, default the current one)."""
        st, guard = self._state, self._guard
        metrics, bad = self._measure()
        step0 = self._step0
        bad_step = None if bad is None or not guard.active else step0 + bad + 1
        if self._sync is not None:
            metrics, self._agree, bad_step = self._sync.reduce_window(
                metrics, pending=self._port.has_commands(), nonfinite=bad_step
            )
        self.metrics = metrics
        self._checked = 0
        self._losses, self._norms = [], []
        self._samples, self._t0, self._step0 = 0, time.monotonic(), st.step
        logged = None
        if publish:
            logged = ev.MetricsLogged(
                step=st.step, epoch=st.epoch if epoch is None else epoch, metrics=metrics
            )
            self._port.publish(logged)
        if bad_step is not None and guard.active:
            guard.found(bad_step)
        return logged

    def finish(self) -> None:
        """At a run's normal end: close the partial last window, published like the others
        (its step is the run's last, not a multiple of ``log_every``; its epoch that step's,
        though the run may have gone past the epoch's end since)."""
        if self._losses:
            st = self._state
            past_its_end = st.batch_in_epoch == 0 and st.epoch > 0  # the epoch was closed
            epoch = st.epoch - 1 if past_its_end else st.epoch
            self.close(self._port.wants(ev.MetricsLogged), epoch)

    def agree_due(self) -> bool:
        """torchrun: the last close found commands waiting on some rank (answered once)."""
        due, self._agree = self._agree, False
        return due

    def _measure(self) -> tuple[dict[str, float], int | None]:
        """The open window's metrics and the index of its first non-finite loss (or None)."""
        st, s, guard = self._state, self._s, self._guard
        losses_kept = self._losses
        steps = st.step - self._step0
        values = _read(losses_kept)  # the one device read
        mean_loss = mean(values) if values else math.nan
        # A finite mean has only finite values: then no search.
        bad = None if math.isfinite(mean_loss) else _first_nonfinite(values)
        norms = self._norms
        norms_read = [float(v) for v in torch.stack(norms).tolist()] if norms else []
        # Timed after the read: the window's steps are done once the device has run them.
        now = time.monotonic()
        elapsed = max(now - self._t0, 1e-9)
        metrics = {
            "loss": mean_loss,
            "lr": float(s.optimizer.param_groups[0]["lr"]),
            "steps_per_s": steps / elapsed,
            "samples_per_s": self._samples / elapsed,
        }
        if norms_read:
            metrics["grad_norm"] = mean(norms_read)
        if guard.skipped or s.on_nonfinite == "skip":
            metrics["skipped_nonfinite"] = float(guard.skipped)
        if len(s.optimizers) > 1:
            for name, opt in s.optimizers.items():
                metrics[f"lr/{name}"] = float(opt.param_groups[0]["lr"])
        metrics.update(self.user.take())
        return metrics, bad

    def check_pending(self) -> None:
        """Where a sync happens anyway (a save, the run's end): report a non-finite loss added
        since the last read, for a guard that does not read every step."""
        guard = self._guard
        if not guard.active or guard.per_step or guard.tripped:
            return  # the same on every rank: the policy, and a stop that was agreed
        pending = self._losses[self._checked :]
        values = _read(pending) if pending else []
        first = self._checked
        self._checked = len(self._losses)
        bad = _first_nonfinite(values)
        bad_step = None if bad is None else self._step0 + first + bad + 1
        if self._sync is not None:
            bad_step = self._sync.first_nonfinite(bad_step)  # a collective on every rank
        if bad_step is not None:
            guard.found(bad_step)


def _first_nonfinite(values: list[float]) -> int | None:
    """The index of the first non-finite value (None: all are finite)."""
    return next((i for i, v in enumerate(values) if not math.isfinite(v)), None)


def _read(losses: list[torch.Tensor]) -> list[float]:
    """The values of 0-d ``losses``, in one device read."""
    return torch.stack(losses).tolist() if losses else []
