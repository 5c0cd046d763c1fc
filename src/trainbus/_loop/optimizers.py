"""Several optimizers and schedulers, named, behind the one optimizer the loop knows.

``Trainer(model, {"g": opt_g, "d": opt_d}, ...)``: :func:`check_optimizers` validates the
mapping and wraps it in an :class:`OptimizerSet`, used wherever one optimizer is
(``param_groups`` in name order, ``zero_grad``, ``step``, ``state_dict`` per name);
:class:`SchedulerSet` does the same for ``scheduler={"g": sched_g, ...}``
(docs/trainer.md, "Several optimizers").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .._exceptions import CheckpointError, ConfigError
from .._tensors import is_sharded_model

__all__ = ["OptimizerSet", "SchedulerSet", "check_optimizers", "check_schedulers"]

DEFAULT_NAME = "default"
"""The name of the one optimizer of a run given a single optimizer (``optimizers["default"]``)."""


class OptimizerSet(torch.optim.Optimizer):
    """Named optimizers acting as one :class:`torch.optim.Optimizer` that owns no parameters:
    every call goes to the optimizers it holds.

    Args:
        optimizers: Name -> optimizer, at least one (checked by :func:`check_optimizers`).
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
        schedulers: Optimizer name -> its scheduler (checked by :func:`check_schedulers`).
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


def _over_model(name: str, opt: Any, params: set[int], *, sharded: bool) -> None:
    if not isinstance(opt, torch.optim.Optimizer):
        raise ConfigError.invalid(name, type(opt).__name__, "a torch.optim.Optimizer")
    if not any(id(p) in params for g in opt.param_groups for p in g["params"]):
        raise ConfigError.invalid(
            name, type(opt).__name__,
            "an optimizer built after fully_shard(model), over its sharded (DTensor) "
            "parameters: fully_shard replaces every parameter, so an optimizer built before "
            "it would step the old, unsharded ones" if sharded
            else "an optimizer over this model's parameters",
        )  # fmt: skip


def check_optimizers(
    model: torch.nn.Module, optimizer: Any
) -> tuple[torch.optim.Optimizer, dict[str, torch.optim.Optimizer]]:
    """``(the optimizer the loop steps, {name: optimizer})`` of ``optimizer``: one over the
    model's parameters (itself and ``{"default": it}``), or a non-empty mapping of identifiers
    to distinct optimizers over disjoint parameters (an :class:`OptimizerSet` and the mapping)."""
    params, sharded = {id(p) for p in model.parameters()}, is_sharded_model(model)
    if not isinstance(optimizer, Mapping):
        if isinstance(optimizer, torch.optim.Optimizer):
            _over_model("optimizer", optimizer, params, sharded=sharded)
            return optimizer, {DEFAULT_NAME: optimizer}
        raise ConfigError.invalid(
            "optimizer", type(optimizer).__name__,
            "a torch.optim.Optimizer, or a mapping of names to optimizers "
            "(e.g. {'g': opt_g, 'd': opt_d})",
        )  # fmt: skip
    if not optimizer:
        raise ConfigError.invalid("optimizer", "<empty mapping>", "at least one optimizer")
    seen: dict[int, str] = {}
    owner: dict[int, str] = {}
    for name, opt in optimizer.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise ConfigError.invalid("optimizer", name, "names that are identifiers")
        _over_model(f"optimizer[{name!r}]", opt, params, sharded=sharded)
        if id(opt) in seen:
            raise ConfigError.invalid(
                f"optimizer[{name!r}]", type(opt).__name__,
                f"a different optimizer than optimizer[{seen[id(opt)]!r}]",
            )  # fmt: skip
        seen[id(opt)] = name
        for p in (q for g in opt.param_groups for q in g["params"]):
            if id(p) in owner:
                raise ConfigError.invalid(
                    f"optimizer[{name!r}]", type(opt).__name__,
                    f"optimizers over disjoint parameters (it shares one with "
                    f"optimizer[{owner[id(p)]!r}])",
                )  # fmt: skip
            owner[id(p)] = name
    named = dict(optimizer)
    return OptimizerSet(named), named


def check_schedulers(
    scheduler: Any, optimizers: Mapping[str, torch.optim.Optimizer]
) -> tuple[Any | None, dict[str, Any]]:
    """Check ``scheduler`` against the run's optimizers.

    Returns:
        ``(the scheduler the loop steps, {optimizer name: scheduler})``: None and ``{}``
        without one; one scheduler with one optimizer is itself; a mapping is a
        :class:`SchedulerSet`.

    Raises:
        ConfigError: not a scheduler (no ``.step()``); torch's ``ReduceLROnPlateau`` (its
            ``.step()`` needs a metric); a scheduler whose ``.optimizer`` is not
            the run's optimizer; a single scheduler with several
            optimizers (naming the optimizer it belongs to); a mapping whose names are not the
            optimizers' or whose scheduler drives another optimizer.
    """
    if scheduler is None:
        return None, {}
    if not isinstance(scheduler, Mapping):
        _stepper("scheduler", scheduler)
        if len(optimizers) == 1:
            (name, only), target = (
                next(iter(optimizers.items())),
                getattr(scheduler, "optimizer", None),
            )
            if target is not None and target is not only:
                raise ConfigError.invalid(
                    "scheduler", type(scheduler).__name__,
                    f"a scheduler of the Trainer's optimizer ({type(only).__name__} at "
                    f"{id(only):#x}); this one drives another {type(target).__name__} (at "
                    f"{id(target):#x}), so the run's learning rate would never change: build "
                    "it on the optimizer you pass to the Trainer",
                )  # fmt: skip
            return scheduler, {name: scheduler}
        target = getattr(scheduler, "optimizer", None)
        belongs = next((n for n, o in optimizers.items() if o is target), None)
        where = (
            f"it belongs to optimizer {belongs!r}: pass scheduler={{{belongs!r}: scheduler}}"
            if belongs is not None
            else "pass a mapping of optimizer names to schedulers"
        )
        raise ConfigError.invalid(
            "scheduler", type(scheduler).__name__,
            f"one scheduler per optimizer with several optimizers ({sorted(optimizers)}); "
            + where,
        )  # fmt: skip
    if len(optimizers) == 1 and DEFAULT_NAME in optimizers:
        raise ConfigError.invalid(
            "scheduler", "<mapping>", "one scheduler (a mapping needs named optimizers)"
        )
    for name, sched in scheduler.items():
        if name not in optimizers:
            raise ConfigError.invalid(
                "scheduler", name, "names of the optimizers: " + ", ".join(map(repr, optimizers))
            )
        _stepper(f"scheduler[{name!r}]", sched)
        target = getattr(sched, "optimizer", None)
        if target is not None and target is not optimizers[name]:
            other = next((n for n, o in optimizers.items() if o is target), None)
            raise ConfigError.invalid(
                f"scheduler[{name!r}]", type(sched).__name__,
                f"a scheduler of optimizer {name!r}"
                + (f" (it drives optimizer {other!r})" if other else " (it drives another one)"),
            )  # fmt: skip
    return SchedulerSet(scheduler), dict(scheduler)


def _stepper(name: str, scheduler: Any) -> None:
    if not callable(getattr(scheduler, "step", None)):
        raise ConfigError.invalid(name, type(scheduler).__name__, "an LR scheduler with .step()")
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ConfigError.invalid(
            name,
            type(scheduler).__name__,
            "a scheduler the loop steps without arguments; torch's ReduceLROnPlateau needs a "
            "metric in .step(metric): use callbacks=[trainbus.callbacks.ReduceLROnPlateau("
            "monitor='val_loss')] instead",
        )
