"""Several optimizers and schedulers, named, behind the one optimizer the loop knows
(docs/trainer.md, "Several optimizers"); and the scheduler's step with its ``SchedulerStepped``."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from .. import events as ev
from .._exceptions import CheckpointError, ConfigError

if TYPE_CHECKING:
    from .._bus import LoopPort
    from ..checkpoint import TrainState
    from .settings import Settings
    from .wants import Wants

__all__ = ["DEFAULT_NAME", "OptimizerSet", "SchedulerSet", "SchedulerStepper"]

DEFAULT_NAME = "default"  # the name of a run's single optimizer


class OptimizerSet(torch.optim.Optimizer):
    """Named optimizers acting as one :class:`torch.optim.Optimizer` that owns no parameters:
    every call goes to the optimizers it holds.

    Args:
        optimizers: Name -> optimizer, at least one.
    """

    def __init__(self, optimizers: Mapping[str, torch.optim.Optimizer]) -> None:
        # Not Optimizer.__init__: it would copy the groups; these are the optimizers' own dicts.
        self.optimizers: dict[str, torch.optim.Optimizer] = dict(optimizers)
        self.defaults: dict[str, Any] = {}

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """Every optimizer's parameter groups (the optimizers' own dicts: editing one edits it)."""
        return [g for opt in self.optimizers.values() for g in opt.param_groups]

    @property
    def state(self) -> dict[Any, Any]:  # type: ignore[override]
        """Every optimizer's per-parameter state, merged (read-only view)."""
        merged: dict[Any, Any] = {}
        for opt in self.optimizers.values():
            merged.update(opt.state)
        return merged

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero every optimizer's gradients."""
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Step every optimizer (closures are not supported with several optimizers).

        Raises:
            ConfigError: a closure was given.
        """
        if closure is not None:
            raise ConfigError.invalid("closure", closure, "None with several optimizers")
        for opt in self.optimizers.values():
            opt.step()

    def state_dict(self) -> dict[str, Any]:
        """``{"state": {}, "param_groups": [], "named": {name: optimizer.state_dict()}}``: the
        shape of one optimizer's state dict, with every optimizer's under ``"named"``."""
        return {
            "state": {},
            "param_groups": [],
            "named": {name: opt.state_dict() for name, opt in self.optimizers.items()},
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load each optimizer's state from :meth:`state_dict`'s output.

        Raises:
            CheckpointError: the saved optimizers are not named as these are.
        """
        named = state_dict.get("named")
        if not isinstance(named, Mapping) or set(named) != set(self.optimizers):
            saved = sorted(named) if isinstance(named, Mapping) else "one optimizer"
            raise CheckpointError(
                f"the checkpoint holds the optimizers {saved} but this run has "
                f"{sorted(self.optimizers)}: resume with the optimizers that wrote it"
            )
        for name, opt in self.optimizers.items():
            opt.load_state_dict(named[name])

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused: add the group to one of the optimizers.

        Raises:
            ConfigError: always.
        """
        raise ConfigError.invalid(
            "add_param_group", "OptimizerSet", "a call on one of the named optimizers"
        )

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}={type(o).__name__}" for n, o in self.optimizers.items())
        return f"OptimizerSet({inner})"


class SchedulerSet:
    """Named LR schedulers stepped, saved and restored as one.

    Args:
        schedulers: Optimizer name -> its scheduler.
    """

    def __init__(self, schedulers: Mapping[str, Any]) -> None:
        self.schedulers: dict[str, Any] = dict(schedulers)

    def step(self) -> None:
        """Step every scheduler, in name order of the mapping."""
        for sched in self.schedulers.values():
            sched.step()

    def state_dict(self) -> dict[str, Any]:
        """``{name: scheduler.state_dict()}``."""
        return {name: sched.state_dict() for name, sched in self.schedulers.items()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load each scheduler's state from :meth:`state_dict`'s output.

        Raises:
            CheckpointError: the saved schedulers are not named as these are.
        """
        if set(state_dict) != set(self.schedulers):
            raise CheckpointError(
                f"the checkpoint holds schedulers for {sorted(state_dict)} but this run has "
                f"{sorted(self.schedulers)}: resume with the schedulers that wrote it"
            )
        for name, sched in self.schedulers.items():
            sched.load_state_dict(state_dict[name])


# torch's warning for a scheduler stepped before its optimizer in this process.
_BEFORE_OPTIMIZER = r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`"


class SchedulerStepper:
    """Steps the scheduler and publishes ``SchedulerStepped``."""

    def __init__(self, settings: Settings, port: LoopPort, state: TrainState, wants: Wants) -> None:
        self._s, self._port, self._state, self._wants = settings, port, state, wants

    def lr(self) -> float:
        """The optimizer's current learning rate of parameter group 0."""
        return float(self._s.optimizer.param_groups[0]["lr"])

    def step(self, *, always: bool, replayed: bool = False) -> None:
        """``scheduler.step()``, then ``SchedulerStepped`` (if wanted, or ``always``).
        ``replayed``: a resume's epoch end before any optimizer step (torch's warning muted)."""
        pub, st, w, s = self._port.publish, self._state, self._wants, self._s
        assert s.scheduler is not None
        try:
            with w.trace("scheduler_step"):
                if replayed:
                    with warnings.catch_warnings():
                        warnings.filterwarnings("ignore", _BEFORE_OPTIMIZER, UserWarning)
                        s.scheduler.step()
                else:
                    s.scheduler.step()
        except BaseException as exc:
            if always or w.scheduler_stepped:
                pub(ev.SchedulerStepped(step=st.step, epoch=st.epoch, lr=self.lr(), error=exc))
            if s.scheduler_interval == "step" and "Tried to step" in str(exc):
                # OneCycleLR's total_steps counted batches, or the last short step of an epoch
                per_epoch = "?" if s.train_len is None else -(-s.train_len // s.accumulate)
                exc.add_note(
                    f"trainbus: the scheduler steps once per optimizer step (here step "
                    f"{st.step}, epoch {st.epoch}): {per_epoch} per epoch, ceil(batches / "
                    f"accumulate={s.accumulate}), the last short one included"
                )
            raise
        if always or w.scheduler_stepped:
            pub(ev.SchedulerStepped(step=st.step, epoch=st.epoch, lr=self.lr()))
