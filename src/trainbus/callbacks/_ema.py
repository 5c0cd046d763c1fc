"""Averaged weights: an exponential moving average of the model, evaluated and saved, in
inline hooks on the training thread."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

import torch

from .._exceptions import CheckpointError, ConfigError, TrainingError
from .._validate import check_bool, check_int, check_number
from ._base import Callback

if TYPE_CHECKING:
    from .._bus import EventBus
    from .._hookpoints import StepContext

__all__ = ["EMA"]

Buffers = Literal["average", "copy"]


class EMA(Callback):
    """An exponential moving average of the model's weights, evaluated and checkpointed.

    After every ``every``-th optimizer step past ``start_step`` (hook ``after_optimizer_step``)
    each averaged tensor moves towards the model's::

        average = torch.lerp(average, weight, 1 - decay)    # average + (1-decay)(weight-average)

    The first update copies the weights; non-floating-point buffers are always copied. See
    docs/callbacks/ema.md.

    Args:
        decay: The weight of the old average at each update, in [0, 1) (0.999: about the last
            1,000 updates count).
        every: Update every ``every`` optimizer steps (at steps that are multiples of it).
        start_step: Update only after this many optimizer steps (the first update copies).
        warmup: timm's warmup (:meth:`decay_for`): early updates follow the weights closely.
        warmup_power: The warmup's power (timm's default 2/3; 3/4 for short runs).
        warmup_gamma: The warmup's time scale in updates (timm's default 1).
        buffers: ``"average"`` (timm's default) or ``"copy"`` floating-point buffers
            (BatchNorm statistics).
        device: Where the average lives (None: the model's device).
        evaluate: Swap the average in around evaluations (False: only average and save it).
        state_key: Name of its state in checkpoints (None: ``"EMA"``).

    Raises:
        ConfigError: an argument out of range, naming it.
    """

    def __init__(
        self,
        decay: float = 0.999,
        *,
        every: int = 1,
        start_step: int = 0,
        warmup: bool = False,
        warmup_power: float = 2 / 3,
        warmup_gamma: float = 1.0,
        buffers: Buffers = "average",
        device: str | torch.device | None = None,
        evaluate: bool = True,
        state_key: str | None = None,
    ) -> None:
        if not isinstance(decay, int | float) or isinstance(decay, bool) or not 0.0 <= decay < 1.0:
            raise ConfigError.invalid("EMA.decay", decay, "a number in [0, 1), e.g. 0.999")
        if buffers not in ("average", "copy"):
            raise ConfigError.invalid("EMA.buffers", buffers, "'average' or 'copy'")
        if device is not None:
            try:
                device = torch.device(device)
            except (RuntimeError, TypeError) as exc:
                raise ConfigError.invalid(
                    "EMA.device",
                    device,
                    "None (the model's device) or a torch device such as 'cpu' or 'cuda:0'",
                ) from exc
        self.decay = float(decay)
        self.every = check_int("EMA.every", every, 1)
        self.start_step = check_int("EMA.start_step", start_step, 0)
        self.warmup = check_bool("EMA.warmup", warmup)
        self.warmup_power = check_number("EMA.warmup_power", warmup_power, positive=True)
        self.warmup_gamma = check_number("EMA.warmup_gamma", warmup_gamma, positive=True)
        self.buffers: Buffers = buffers
        self.device: torch.device | None = device
        self.evaluate = check_bool("EMA.evaluate", evaluate)
        self.state_key = state_key
        self._reset()

    def _reset(self) -> None:
        self._average: dict[str, torch.Tensor] | None = None
        self._aliases: dict[str, str] = {}
        self._updates = 0
        self._loaded: Mapping[str, torch.Tensor] | None = None  # a checkpoint's, until first use
        self._swapped: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        # A custom step with several optimizers runs the hook once per optimizer: once a step.
        self._last_step = -1

    @property
    def updates(self) -> int:
        """Updates folded into the average so far (0: no average yet)."""
        return self._updates

    @property
    def swapped(self) -> bool:
        """True while the average is in the model (during an evaluation round)."""
        return self._swapped is not None

    def decay_for(self, update: int) -> float:
        """The decay the ``update``-th update (from 1) uses: 0 for the first (a copy), then
        ``decay``, or the warmup's ``min(decay, 1 - (1 + (n-1)/gamma) ** -power)``."""
        if update <= 1:
            return 0.0
        if not self.warmup:
            return self.decay
        warm = 1.0 - (1.0 + (update - 1) / self.warmup_gamma) ** -self.warmup_power
        return max(0.0, min(self.decay, float(warm)))

    def averaged_state_dict(self) -> dict[str, torch.Tensor]:
        """The average as a state dict of the (unwrapped) model: the live tensors.

        Raises:
            TrainingError: no update happened yet, or the average is in the model right now
                (inside an evaluation round).
        """
        if self._swapped is not None:
            raise TrainingError(
                "EMA: the average is swapped into the model during an evaluation round; read "
                "it after the round (or read the model's weights now)"
            )
        if self._average is None:
            if self._loaded is not None:
                return dict(self._loaded)
            raise TrainingError(
                f"EMA has no average yet: the first update comes after the first optimizer "
                f"step past start_step={self.start_step} that is a multiple of "
                f"every={self.every}"
            )
        average = self._average
        return {key: average[name] for key, name in self._aliases.items()}

    def copy_to(self, model: torch.nn.Module) -> None:
        """Load the average into ``model`` (unwrapped), overwriting the training weights.

        Raises:
            TrainingError: no average yet (see :meth:`averaged_state_dict`).
        """
        unwrapped(model).load_state_dict(self.averaged_state_dict())

    def state_dict(self) -> dict[str, Any]:
        """``{"updates": n, "weights": averaged_state_dict()}`` (no ``"weights"`` before the
        first update).

        Raises:
            TrainingError: read during an evaluation round (the average is in the model).
        """
        if self._average is None and self._loaded is None:
            return {"updates": self._updates}
        return {"updates": self._updates, "weights": self.averaged_state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (checked against the model at its first use).

        Raises:
            CheckpointError: the state is not an EMA state.
        """
        updates = state.get("updates")
        weights = state.get("weights")
        if (
            not isinstance(updates, int)
            or isinstance(updates, bool)
            or updates < 0
            or (weights is None) != (updates == 0)
            or (
                weights is not None
                and not (
                    isinstance(weights, Mapping)
                    and all(isinstance(v, torch.Tensor) for v in weights.values())
                )
            )
        ):
            raise CheckpointError(
                f"the {self.state_key!r} callback state is not an EMA state "
                f"(updates={updates!r}, weights of type {type(weights).__name__})"
            )
        self._reset()
        self._updates = updates
        self._loaded = None if weights is None else dict(weights)

    def setup(self, bus: EventBus) -> None:
        """Start afresh: an instance added to a new Trainer keeps no average of another."""
        self._reset()

    def hook_after_optimizer_step(self, ctx: StepContext) -> None:
        """Fold the weights into the average at the steps it updates at."""
        step = ctx.step
        if step == self._last_step:
            return
        self._last_step = step
        if step > self.start_step and step % self.every == 0:
            self.update(ctx.model)

    def hook_before_evaluation(self, ctx: StepContext) -> None:
        """Swap the average into the model for the round (when there is one)."""
        if self.evaluate:
            self.swap_in(ctx.model)

    def hook_after_evaluation(self, ctx: StepContext) -> None:
        """Swap the training weights back (also when the round raised or was cancelled)."""
        self.swap_out()

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        """Fold ``model``'s weights into the average once.

        Raises:
            CheckpointError: a restored average does not fit the model.
            TrainingError: the model's tensors changed since the average began, or the average
                is swapped in.
        """
        if self._swapped is not None:
            raise TrainingError(
                "EMA.update() during an evaluation round (the average is in the model)"
            )
        tensors = ModelTensors(model)
        average = self._current(tensors)
        update = self._updates + 1
        if average is None:
            self._begin(tensors.unique, tensors)
            self._updates = update
            return
        weight = 1.0 - self.decay_for(update)
        lerp_avg: list[torch.Tensor] = []
        lerp_new: list[torch.Tensor] = []
        for name, t in tensors.unique.items():
            avg = average[name]
            if t.is_floating_point() and (name in tensors.params or self.buffers == "average"):
                lerp_avg.append(avg)
                lerp_new.append(t.detach() if t.device == avg.device else t.detach().to(avg.device))
            else:
                avg.copy_(t)
        if lerp_avg:
            torch._foreach_lerp_(lerp_avg, lerp_new, weight)
        self._updates = update

    def swap_in(self, model: torch.nn.Module) -> None:
        """Exchange the model's weights with the average (no-op before the first update or
        when swapped in).

        Raises:
            CheckpointError: a restored average does not fit the model.
            TrainingError: the model's tensors changed since the average began.
        """
        if self._swapped is not None:
            return
        tensors = ModelTensors(model)
        average = self._current(tensors)
        if average is None:
            return
        pairs = [(average[name], t.detach()) for name, t in tensors.unique.items()]
        exchange(pairs)
        self._swapped = pairs

    def swap_out(self) -> None:
        """Put the training weights back, bit for bit (no-op when not swapped in)."""
        pairs = self._swapped
        if pairs is None:
            return
        exchange(pairs)
        self._swapped = None

    def _current(self, tensors: ModelTensors) -> dict[str, torch.Tensor] | None:
        """The average (a checkpoint's adopted first), checked against ``tensors``."""
        loaded = self._loaded
        if loaded is not None:
            # A checkpoint's state dict: its tied keys share the first one's tensor.
            own = {
                k: v for k, v in loaded.items() if k in tensors.unique or k not in tensors.aliases
            }
            problem = tensors.mismatch(own)
            if problem is not None:
                raise CheckpointError(
                    f"the {self.state_key!r} average does not fit the model: {problem}"
                )
            self._begin(loaded, tensors)
            self._loaded = None
        average = self._average
        if average is None:
            return None
        problem = tensors.mismatch(average)
        if problem is None and tensors.aliases.keys() != self._aliases.keys():
            problem = "the tied weights differ"
        if problem is not None:
            raise TrainingError(
                f"EMA: the model's tensors changed since the average began: {problem}"
            )
        return average

    def _begin(self, source: Mapping[str, torch.Tensor], tensors: ModelTensors) -> None:
        """Start the average as a copy of ``source`` (by the names of ``tensors``)."""
        self._average = {
            name: source[name].detach().to(device=self.device or t.device, copy=True)
            for name, t in tensors.unique.items()
        }
        self._aliases = tensors.aliases


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside ``DistributedDataParallel`` / ``DataParallel`` / ``torch.compile``."""
    while True:
        wrapped = isinstance(
            model, torch.nn.parallel.DistributedDataParallel | torch.nn.DataParallel
        )
        inner = model.module if wrapped else getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


class ModelTensors:
    """The model's state-dict tensors: ``unique`` by first name, ``aliases`` every key to its
    name in ``unique``, ``params`` the parameters' names."""

    def __init__(self, model: torch.nn.Module) -> None:
        seen: dict[int, str] = {}
        self.unique: dict[str, torch.Tensor] = {}
        self.aliases: dict[str, str] = {}
        params: list[str] = []
        # keep_vars: the live tensors, walked at every update and swap (never a stale one).
        for key, value in unwrapped(model).state_dict(keep_vars=True).items():
            if not isinstance(value, torch.Tensor):
                continue  # a module's extra state: not a weight
            name = seen.setdefault(id(value), key)
            self.aliases[key] = name
            if name == key:
                self.unique[key] = value
                if isinstance(value, torch.nn.Parameter):
                    params.append(key)
        self.params = frozenset(params)

    def mismatch(self, other: Mapping[str, torch.Tensor]) -> str | None:
        """What differs between these tensors and ``other`` (names, shapes, dtypes), or None."""
        missing = [name for name in self.unique if name not in other]
        extra = [name for name in other if name not in self.unique]
        problems = []
        if missing:
            problems.append(f"{missing[:5]} are in the model but not in the average")
        if extra:
            problems.append(f"{extra[:5]} are in the average but not in the model")
        for name, a in self.unique.items():
            b = other.get(name)
            if b is not None and (a.shape != b.shape or a.dtype != b.dtype):
                problems.append(
                    f"{name!r} is {tuple(a.shape)} {a.dtype} in the model but "
                    f"{tuple(b.shape)} {b.dtype} in the average"
                )
        return "; ".join(problems[:6]) or None


@torch.no_grad()
def exchange(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Exchange the contents of each pair bit for bit, all or nothing."""

    def swap(a: torch.Tensor, b: torch.Tensor) -> None:
        held = a.clone()  # one tensor's worth of extra memory at a time
        a.copy_(b)
        b.copy_(held)

    done = 0
    try:
        for a, b in pairs:
            swap(a, b)
            done += 1
    except BaseException:
        for a, b in pairs[:done]:
            swap(a, b)
        raise
