"""The Trainer: async-first ``fit()``, the loop in a worker thread, the bus on the event loop.

::

    trainer = Trainer(model, optimizer, train_loader, loss_fn=F.cross_entropy,
                      eval_data=val_loader, max_epochs=3, checkpoint_dir="runs/demo")
    trainer.bus.stream(ev.StepEnded).pipe(ops.throttle_first(1.0)).subscribe(log_step)
    result = await trainer.fit()        # or trainer.run() from synchronous code
    result = await Trainer(...same arguments...).fit(resume="latest")   # after a crash

``fit()`` opens the bus' task group (unless ``with`` / ``async with trainer`` holds it), runs the
loop (see ``trainbus.loop.loop`` for the event order) in a worker thread with ``anyio.to_thread``,
turns SIGINT/SIGTERM into ``StopTraining`` (a second SIGINT aborts), and suspends the bus, which
delivers every event published before ``FitEnded``; ``evaluate()`` and ``predict()`` run on the
same bus and subscribers, before or after it (docs/trainer.md, "One Trainer, many calls").
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self

import anyio
import anyio.from_thread
import anyio.lowlevel
import torch

from . import events as ev
from ._attach import Attached, as_instances
from ._endings import OnSignal, check_on_signal, check_skip_final, interrupt_for
from ._exceptions import ConfigError, LostWorkError, TrainbusError
from ._lifetime import Lifetime
from ._log import get_logger
from ._rank_setup import RankSetup
from ._resume import CallbackStates, check_resume
from ._session import BusSession, SignalWatcher, watching_cancel
from ._workers import end_workers, spawns_workers
from .bus import EventBus, Tier
from .bus.statistics import BusStatistics, LostWork
from .callbacks._base import Callback, RunPlan, global_callbacks, plain_settings
from .callbacks.progress import Progress, progress_by_default
from .checkpoint import TrainState
from .distributed.sync import RankSync
from .hookpoints import HookPoint
from .loop import (
    DEFAULT_BARRIERS,
    TRAIN_METRIC_NAMES,
    HookFn,
    HookHandle,
    Hooks,
    Loop,
    NonFinitePolicy,
    Outcome,
    Precision,
    Settings,
    StandaloneRun,
    TrainContext,
    build_settings,
    eval_sets,
    evaluation_metric_names,
    join_outputs,
)
from .seeding import seeded_run

__all__ = ["FitResult", "Trainer"]

log = get_logger(__name__)


class BusDefault(Enum):
    """Default of a Trainer option that belongs to the bus: the bus' own default."""

    DEFAULT = "the bus' default"


def new_bus(
    bus: EventBus | None,
    *,
    watchdog_s: float | BusDefault | None,
    close_timeout: float | BusDefault | None,
) -> EventBus:
    """The Trainer's bus: ``bus``, or a new one with the bus options the Trainer was given.

    Raises:
        ConfigError: ``bus`` is not an EventBus, or a bus option is given with ``bus=`` (it
            belongs on that bus), or is out of range (the bus' own check).
    """
    options: dict[str, Any] = {name: value for name, value in
               (("watchdog_s", watchdog_s), ("close_timeout", close_timeout))
               if value is not BusDefault.DEFAULT}  # fmt: skip
    if bus is None:
        return EventBus(**options)
    if not isinstance(bus, EventBus):
        raise ConfigError.invalid("bus", bus, "a trainbus.EventBus or None")
    for name, value in options.items():
        raise ConfigError.invalid(name, value, f"left out when bus= is given (set it on the "
                                  f"bus: EventBus({name}=...))")  # fmt: skip
    return bus


@dataclass(frozen=True, slots=True, kw_only=True)
class FitResult:
    """What ``fit()`` returns (also kept as ``trainer.result``, failed runs included)."""

    reason: ev.EndReason
    stop_reason: str | None
    steps: int
    epochs: int
    """Epochs completed."""
    metrics: Mapping[str, float]
    """Last evaluation metrics."""
    train_metrics: Mapping[str, float]
    """Last aggregated training metrics (loss, lr, steps_per_s, ...). ``loss`` is the mean over
    the last ``log_every`` steps (with ``on_nonfinite="ignore"`` and nothing subscribed to
    per-step or logged metrics, the last log step's loss: the loop keeps no more than it needs)."""
    checkpoint: str | None
    """Path of the last checkpoint written in this run."""
    subscriber_failures: Mapping[str, int]
    """Failures per subscription name (only those that failed)."""
    statistics: BusStatistics
    error: BaseException | None = None
    skipped_nonfinite: int = 0
    """Optimizer steps skipped for a non-finite loss (``on_nonfinite="skip"``)."""
    resumed_from: str | None = None
    """The checkpoint file this run loaded (``fit(resume=...)``), None for a fresh start,
    ``resume="latest"`` finding no valid checkpoint included."""
    failed_saves: int = 0
    """Checkpoint writes the disk refused (full, read-only): each logged as
    ``checkpoint_save_failed`` naming the file; the earlier checkpoints stay valid."""
    waited_s: Mapping[str, float] = dataclasses.field(default_factory=dict)
    """Seconds training waited on each subscription that held it (an ``overflow="block"``
    buffer that was full, a barrier or decision step it decides at); absent: never waited."""
    lost: Mapping[str, LostWork] = dataclasses.field(default_factory=dict)
    """Work each subscription lost (dropped by its overflow policy, cancelled at close or by
    ``cancel_pending()``, failed); only subscriptions that lost something."""

    @property
    def ending(self) -> ev.Ending:
        """How the run ended, typed: ``reason`` with a stop's cause told apart
        (``Ending.PRUNED``, ``Ending.SIGNAL``, ``Ending.STOPPED``; :class:`~trainbus.Ending`)."""
        return ev.Ending.of(self.reason, self.stop_reason)

    @property
    def lost_work(self) -> int:
        """Items lost by all subscriptions together (0: every item was handled)."""
        return sum(x.total for x in self.lost.values())


class Trainer:
    """A PyTorch trainer whose callbacks are subscribers on a reactive event bus.

    Args:
        model: The ``torch.nn.Module`` to train.
        optimizer: A ``torch.optim.Optimizer`` over the model's parameters, or a mapping of
            names to optimizers over disjoint parameters (``{"g": opt_g, "d": opt_d}``): the
            default step steps them all, a ``train_step`` steps them by name; each one's state
            is saved and restored (docs/trainer.md, "Several optimizers").
        train_data: Any iterable of batches (a ``DataLoader``, a list, a generator factory...).
        train_step: Your own step, ``fn(ctx: TrainContext) -> loss`` called per micro-batch:
            any forwards, ``ctx.backward(loss)``, ``ctx.optimizer_step(name)``; trainbus keeps
            the events, hooks, accumulation, clipping, precision, non-finite checks and
            checkpoints (docs/recipes.md). None: the default step.
        loss_fn: ``loss_fn(model(inputs), targets)`` for ``(inputs, targets)`` batches. Without
            it, ``model(batch)`` (``model(**batch)`` for a mapping) returns the loss, a mapping
            with ``"loss"`` or an object with ``.loss`` (the Hugging Face convention).
        eval_data: Iterable of evaluation batches, or a mapping of set names to iterables
            (``{"val": val_loader, "test": test_loader}``), scored one after the other in one
            evaluation round. Metrics of a single loader are ``val_loss``/``val_<name>``; of
            named sets ``<set>/loss``/``<set>/<name>`` (``"test/acc"``).
        max_epochs: Epochs to train; with ``max_steps`` the first limit reached ends the run.
        max_steps: Optimizer steps to train.
        scheduler: An LR scheduler, stepped every step or every epoch (``scheduler_interval``);
            with several optimizers a mapping of optimizer names to schedulers.
        scheduler_interval: ``"step"`` or ``"epoch"``.
        accumulate: Micro-batches per optimizer step (gradient accumulation).
        clip_grad_norm: Clip the total gradient norm to this value; the pre-clip norm is
            reported as ``grad_norm`` on the events.
        precision: ``"32"``, ``"bf16"`` (autocast, any device; on CUDA compute capability 8.0
            or later) or ``"fp16"`` (autocast with a grad scaler, CUDA only); Lightning's
            ``"32-true"``, ``"bf16-mixed"`` and ``"16-mixed"`` are the same three.
        device: ``"auto"`` (CUDA, then MPS, then CPU), a device string or ``torch.device``.
            ``"auto"`` and ``"cuda"`` resolve now to ``cuda:N`` (the current CUDA device); the
            loop, evaluate and predict make it current on their own threads
            (docs/trainer.md, "On a GPU").
        seed: At the start of ``fit()``, seeds Python's, NumPy's and torch's process-wide
            generators (:func:`~trainbus.seed_everything`; call that one before building the
            model for equal initial weights), and gives a ``DataLoader(shuffle=True)`` without
            a ``generator`` a data order of ``(seed, epoch)`` that no other thread's draws
            change (docs/trainer.md, "Seeds").
        metrics: ``{"acc": fn(outputs, targets)}``, averaged over samples as ``val_acc``;
            ``targets`` is the second element of ``(inputs, targets)`` batches, a mapping
            batch's ``"labels"``, else the batch (docs/trainer.md, "Metric functions").
        eval_every: Also evaluate every N optimizer steps.
        eval_at_epoch_end: Evaluate after each epoch (when ``eval_data`` is given).
        eval_at_end: When the run completes (``max_steps`` or ``max_epochs`` reached) and its
            last step was not evaluated, evaluate the final weights once more
            (``trigger="end"``, before the final checkpoint), as Hugging Face does. Only when
            ``eval_every`` or ``eval_at_epoch_end`` evaluates during the run; False: never.
        log_every: Steps per ``MetricsLogged`` (one device read of the window's losses).
        checkpoint_dir: Where ``SaveCheckpoint`` writes; a final checkpoint is written when a
            run completes or stops. Checked now (creatable, writable, not under a file),
            created at the first save, never before. Resume with ``fit(resume=...)``.
        skip_final_checkpoint: Stopped runs that write no final checkpoint: any of
            ``"stopped"``, ``"pruned"`` (a pruner's stop: a sweep's pruned trials keep their
            disk and time), ``"signal"`` (:class:`~trainbus.Ending`). Default: none skipped.
        callbacks: Callback classes or instances (user tier). Stateful ones (overriding
            ``state_dict``) need distinct ``state_key``s.
        progress: Show a :class:`~trainbus.callbacks.Progress` bar: ``None`` (default) when
            stderr is a terminal on rank 0 (the ``RANK`` variable torchrun sets, default 0),
            ``True`` always, ``False`` never. A ``Progress`` in ``callbacks`` replaces it.
        barriers: Event types at which the loop waits for subscribers before going on.
        barrier_timeout: Seconds the loop waits at a barrier.
        on_nonfinite: A NaN/inf loss ``"raise"``s ``NonFiniteLossError`` (the run fails),
            ``"stop"``s the run (no checkpoint of the bad state), ``"skip"``s that batch's
            update (counted in ``FitResult.skipped_nonfinite``), or is ``"ignore"``d. Checked
            every step (docs/trainer.md); a checkpoint never holds non-finite weights.
        handle_signals: Turn SIGINT/SIGTERM into ``StopTraining`` during ``fit()`` / ``run()``
            called on the main thread (a ``signal.signal`` handler, restored after).
        on_signal: After such a graceful stop (final checkpoint written, events delivered):
            ``"raise"`` (default) lets the interrupt reach the caller, ``KeyboardInterrupt``
            for SIGINT, ``SystemExit(143)`` for SIGTERM (``trainer.result`` holds the result,
            ``ending == Ending.SIGNAL``); ``"return"`` returns the result instead.
        bus: A preconfigured :class:`EventBus` (default: a new one).
        ddp: Under ``torchrun`` with more than one rank, wrap the model in
            ``DistributedDataParallel`` (a model already wrapped is left as it is). ``False``
            for a model you parallelise yourself (FSDP, a custom wrapper): trainbus then
            neither wraps it nor all-reduces its gradients (docs/distributed.md).
        watchdog_s: Seconds one call of a sync subscriber may block the event-loop thread
            before a warning names it, with its stack, while it blocks (default 5; None: no
            watchdog). The new bus' option (:class:`EventBus`); with ``bus=`` set it there.
        close_timeout: Seconds the end of ``fit()`` waits for async subscribers' pending work
            before cancelling it (counted in ``FitResult.lost``). None (the default): wait as
            long as it takes, with a ``bus_close_waiting`` warning naming what is pending and
            for whom. The new bus' option (:class:`EventBus`); with ``bus=`` set it there.
        on_lost: What lost work does to the run (items dropped by an overflow policy,
            cancelled at close, or failed; ``FitResult.lost``): ``"warn"`` (default) logs
            ``bus_closed_with_lost_work`` naming them; ``"raise"`` also raises
            :class:`~trainbus.LostWorkError` from ``fit()`` once everything was delivered
            (``trainer.result`` holds the result).

    Raises:
        ConfigError: for any invalid argument, before anything runs or touches the disk.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | Mapping[str, torch.optim.Optimizer],
        train_data: Iterable[Any],
        *,
        train_step: Callable[[TrainContext], Any] | None = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        eval_data: Iterable[Any] | Mapping[str, Iterable[Any]] | None = None,
        max_epochs: int | None = None,
        max_steps: int | None = None,
        scheduler: Any | None = None,
        scheduler_interval: Literal["step", "epoch"] = "step",
        accumulate: int = 1,
        clip_grad_norm: float | None = None,
        precision: Precision = "32",
        device: str | torch.device = "auto",
        seed: int | None = None,
        metrics: Mapping[str, Callable[[Any, Any], Any]] | None = None,
        eval_every: int | None = None,
        eval_at_epoch_end: bool = True,
        eval_at_end: bool = True,
        log_every: int = 50,
        checkpoint_dir: str | Path | None = None,
        skip_final_checkpoint: Iterable[ev.Ending | str] = (),
        callbacks: Iterable[Callback | type[Callback]] = (),
        progress: bool | None = None,
        barriers: Iterable[type[ev.BaseEvent]] = DEFAULT_BARRIERS,
        barrier_timeout: float = 60.0,
        on_nonfinite: NonFinitePolicy = "raise",
        handle_signals: bool = True,
        on_signal: OnSignal = "raise",
        bus: EventBus | None = None,
        ddp: bool = True,
        watchdog_s: float | BusDefault | None = BusDefault.DEFAULT,
        close_timeout: float | BusDefault | None = BusDefault.DEFAULT,
        on_lost: Literal["warn", "raise"] = "warn",
    ) -> None:
        self.settings: Settings = build_settings(
            model, optimizer, train_data, loss_fn=loss_fn, eval_data=eval_data,
            max_epochs=max_epochs, max_steps=max_steps, scheduler=scheduler,
            scheduler_interval=scheduler_interval, accumulate=accumulate,
            clip_grad_norm=clip_grad_norm, precision=precision, device=device, seed=seed,
            metrics=metrics, eval_every=eval_every, eval_at_epoch_end=eval_at_epoch_end,
            log_every=log_every, checkpoint_dir=checkpoint_dir,
            barriers=barriers, barrier_timeout=barrier_timeout, on_nonfinite=on_nonfinite,
            train_step=train_step,
            eval_at_end=eval_at_end,
        )  # fmt: skip
        self.settings = dataclasses.replace(
            self.settings, skip_final_checkpoint=check_skip_final(skip_final_checkpoint)
        )
        if not isinstance(handle_signals, bool):
            raise ConfigError.invalid("handle_signals", handle_signals, "True or False")
        self.handle_signals = handle_signals
        self.on_signal: OnSignal = check_on_signal(on_signal)
        if not isinstance(ddp, bool):
            raise ConfigError.invalid("ddp", ddp, "True (wrap in DistributedDataParallel under "
                                      "torchrun) or False")  # fmt: skip
        self.ddp = ddp
        if on_lost not in ("warn", "raise"):
            raise ConfigError.invalid("on_lost", on_lost, "'warn' or 'raise'")
        self.on_lost: Literal["warn", "raise"] = on_lost
        self.bus: EventBus = new_bus(bus, watchdog_s=watchdog_s, close_timeout=close_timeout)
        self.hooks = Hooks()
        self.result: FitResult | None = None
        self._attached = Attached(self.bus, self.hooks)
        attached = self._attached  # not self: no cycle through the trainer (freed without gc)
        self._states = CallbackStates(self.bus, lambda: attached.callbacks)
        self._session = BusSession(self.bus, self.hooks, self.settings.barrier_timeout)
        self._signals = SignalWatcher(self.bus, on_signal=self._session.interrupt)
        self._lifetime = Lifetime(self.bus)
        self._ran: Outcome | None = None  # how the last fit's loop ended, once it ran
        self._call: str | None = None  # the call running now: "fit", "evaluate", "predict"
        if progress is not None and not isinstance(progress, bool):
            raise ConfigError.invalid("progress", progress, "None (when stderr is a terminal), "
                                      "True or False")  # fmt: skip
        instances = as_instances(callbacks)
        for cb in instances:
            self.add_callback(cb)
        if (progress if progress is not None else progress_by_default()) and not any(
            isinstance(cb, Progress) for cb in instances
        ):
            self.add_callback(Progress(), tier="core")  # the default kit's progress bar
        self._state: TrainState | None = None  # the last run's, for standalone calls after it
        # Queued now, delivered when the bus first runs: subscribers attached by then see it.
        self.bus.publish(ev.TrainerBuilt(step=0, epoch=0, device=str(self.settings.device),
                                         callbacks=tuple(type(cb).__name__
                                                         for cb in self.callbacks)))  # fmt: skip

    # ================================================================== callbacks and hooks
    def add_callback(self, callback: Callback | type[Callback], *, tier: Tier = "user") -> Callback:
        """Attach a callback (class or instance): its ``on_*`` subscribers, ``hook_*`` hooks
        and ``setup(bus)`` pipelines. While ``fit()`` runs, call it on the event-loop thread.

        Returns:
            The attached instance.

        Raises:
            ConfigError: not a Callback, a misspelt ``on_*`` / ``hook_*`` method, or a
                stateful callback whose ``state_key`` another attached one already has.
        """
        return self._attached.add(callback, tier)

    def remove_callback(self, callback: Callback) -> None:
        """Detach a callback: dispose its subscriptions and remove its hooks.

        Raises:
            ConfigError: the callback is not attached to this trainer.
        """
        self._attached.remove(callback)

    @property
    def callbacks(self) -> tuple[Callback, ...]:
        """Attached callbacks, in attachment order."""
        return self._attached.callbacks

    def add_hook(self, point: HookPoint, fn: HookFn) -> HookHandle:
        """Run ``fn(ctx)`` inline at ``point`` of every step (user tier); ``.remove()`` it.

        Raises:
            ConfigError: unknown point or non-callable ``fn``.
        """
        return self.hooks.add(point, fn, tier="user")

    # ================================================================== lifetime
    def __enter__(self) -> Self:
        """``with Trainer(...) as t:``: run the bus (in a blocking portal: an event loop in a
        thread) until the block ends; ``t.run()``, ``t.evaluate_sync()``, ``t.predict_sync()``
        run through that one portal. The end of the block is :meth:`close`.

        Raises:
            TrainbusError: the trainer's bus runs already, or closed.
        """
        self._lifetime.enter()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the bus: deliver what is queued, complete the streams (buffering operators
        emit what they hold), wait for async subscribers (``close_timeout``), then stop the
        ``with`` block's portal. Idempotent; later calls raise ``TrainbusError``. A Trainer
        never closed loses nothing of its calls (each delivers before it returns); closing
        completes the streams and frees the subscribers.

        Raises:
            TrainbusError: the bus runs in an ``async with trainer`` block (leave it instead).
            Exception: a subscription with ``on_error="raise"`` failed while closing (the
                subscriber's own exception).
        """
        self._lifetime.close()

    async def __aenter__(self) -> Self:
        """``async with Trainer(...) as t:``: run the bus in this event loop until the end of
        the block, which closes it.

        Raises:
            TrainbusError: the trainer's bus runs already, or closed.
        """
        await self._lifetime.aenter()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._lifetime.aexit(exc_type)

    async def aclose(self) -> None:
        """Async twin of :meth:`close` for a trainer used without ``async with``.

        Raises:
            TrainbusError: the bus runs in a ``with`` / ``async with`` block (leave it).
        """
        await self._lifetime.aclose()

    # ================================================================== running
    def run(
        self,
        *,
        resume: str | os.PathLike[str] | None = None,
        backend: str = "asyncio",
        require_checkpoint: bool = False,
    ) -> FitResult:
        """Synchronous twin of :meth:`fit`, run through one anyio blocking portal: the one of
        ``with trainer:``, else one started for the call and stopped after it. Works in a plain
        script and where an event loop already runs on this thread (a notebook). SIGINT and
        SIGTERM are handled on this thread (the main one) while it waits.

        Args:
            resume: As for :meth:`fit`.
            require_checkpoint: As for :meth:`fit`.
            backend: ``"asyncio"`` or ``"trio"`` (inside ``with trainer:``, the one it runs).

        Returns:
            The :class:`FitResult`.

        Raises:
            As :meth:`fit`; ``ConfigError`` for an unknown ``backend``; ``TrainbusError`` when
            the bus runs in an ``async with`` block's event loop (await ``fit()`` there).
        """
        with self._signals.installed(self.handle_signals):
            result: FitResult = self._lifetime.call(
                lambda: self._fit(resume=resume, require_checkpoint=require_checkpoint),
                backend, "fit",
            )  # fmt: skip
            # Raised here, on the caller's thread: a KeyboardInterrupt or SystemExit raised in
            # the portal's event loop would end that loop, not reach this caller.
            self._raise_interrupt(result)
            return result

    async def fit(
        self, *, resume: str | os.PathLike[str] | None = None, require_checkpoint: bool = False
    ) -> FitResult:
        """Train until ``max_epochs``/``max_steps``, a ``StopTraining``, a failure or a cancel.

        Args:
            resume: Continue a run from a checkpoint: its path, or ``"latest"`` for the newest
                valid one in ``checkpoint_dir`` (bad files are skipped with a
                ``checkpoint_skipped`` warning; none at all starts a fresh run with a
                ``resume_found_nothing`` warning naming the folder and what it held). Restores
                the model, optimizer, scheduler, grad scaler, train state, callback states, the
                interrupted epoch's data order and the RNG states: the resumed run continues
                as if it had never stopped (see ``docs/reliability.md``).
                ``FitStarted.resumed_from`` and ``FitResult.resumed_from`` name the file
                loaded (None when nothing was).
            require_checkpoint: With ``resume="latest"``: finding no valid checkpoint is a
                ``CheckpointError`` before anything trains, not a fresh start (a job restart
                that must continue a run).

        Returns:
            The :class:`FitResult` (completed or stopped runs).

        Raises:
            ConfigError: ``resume`` is not a path or ``"latest"``, names no file, or is
                ``"latest"`` without a ``checkpoint_dir``; ``require_checkpoint`` without
                ``resume``; an attached callback refuses the run before it starts
                (:meth:`Callback.check`: a monitored metric no evaluation produces,
                ``Checkpointing`` without a ``checkpoint_dir``).
            CheckpointError: the checkpoint is damaged or foreign, or was written for another
                model shape, optimizer type or world size (nothing is restored); or
                ``require_checkpoint`` and ``"latest"`` found no valid checkpoint.
            CheckpointWriteError: the final checkpoint could not be written (an ``OSError``
                naming the file; the earlier checkpoints stay valid).
            The training exception when the run fails (``FitEnded(reason="failed")`` was
            published and delivered first; ``trainer.result`` holds the result);
            a subscriber's own exception when it has ``on_error="raise"`` (a note names the
            subscription and event; ``except MyError`` matches);
            ``KeyboardInterrupt`` after a second SIGINT; after a graceful stop by SIGINT
            (``KeyboardInterrupt``) or SIGTERM (``SystemExit(143)``) unless
            ``on_signal="return"``; what a callback's :meth:`Callback.after_fit` raised
            (``optuna.TrialPruned`` for a pruned trial); the cancellation when cancelled.
        """
        result = await self._fit(resume=resume, require_checkpoint=require_checkpoint)
        self._raise_interrupt(result)
        return result

    def _raise_interrupt(self, result: FitResult) -> None:
        """After a graceful stop by a signal (``on_signal="raise"``): its interrupt."""
        signum = self._signals.received
        if signum is not None and self.on_signal == "raise" and result.reason != "cancelled":
            raise interrupt_for(signum, result.steps, result.checkpoint)

    async def _fit(
        self, *, resume: str | os.PathLike[str] | None, require_checkpoint: bool
    ) -> FitResult:
        self._check_idle("fit()")
        self._lifetime.check_open("fit()")
        if self._ran is not None and resume is None:
            raise TrainbusError(
                f"fit() ran on this Trainer already (it ended {self._ran.reason!r} at "
                f"step {self._ran.state.step}); a second fit() continues a run: "
                "fit(resume='latest') or fit(resume=<checkpoint path>); to train anew, build a "
                "new Trainer"
            )
        resume = check_resume(resume, self.settings.checkpoint_dir, require_checkpoint)
        s = self.settings
        self._states.bind(anyio.get_cancelled_exc_class())
        self._session.bind(anyio.get_cancelled_exc_class())
        globals_ = [self.add_callback(cb, tier="global") for cb in global_callbacks()
                    if cb not in self._attached]  # fmt: skip
        try:
            self._check_callbacks()
        except BaseException:
            for cb in globals_:
                self.remove_callback(cb)
            raise
        ranks = RankSetup(self.bus, ddp=self.ddp)
        try:
            group = ranks.join(s.device)
            s = self.settings = seeded_run(ranks.place(s))  # the run's generators, data order
            s.model.to(s.device)
            checkpoint = (None if resume is None
                          else self._states.load(s, resume, group, required=require_checkpoint))
            s = ranks.distribute(s)
            ranks.connect()
        except BaseException:
            for cb in globals_:
                self.remove_callback(cb)
            ranks.close(None)
            raise
        state = checkpoint.state if checkpoint is not None else TrainState()
        loop = Loop(
            s, self.bus, self.hooks, self._session.barrier, state, resume=checkpoint,
            resumed_from=None if checkpoint is None else str(checkpoint.path),
            callback_states=self._states.collect_from_thread if self._states.any_stateful
            else None,
            sync=RankSync(group) if group.distributed else None,
        )  # fmt: skip
        self._call = "fit"
        self._signals.attach(loop)
        try:
            with self._signals.installed(self.handle_signals):
                async with self._session.open():
                    async with watching_cancel(loop):
                        spawns = spawns_workers([s.train_data, *(d for _, d in s.eval_sets)])
                        await anyio.to_thread.run_sync(self._signals.masked(loop.run, spawns))
        finally:
            self._call = None
            end_workers([s.train_data, *(d for _, d in s.eval_sets)])  # persistent ones too
            self._signals.attach(None)
            for cb in globals_:
                self.remove_callback(cb)
            ranks.close(loop.outcome)
            # Also when fit() is cancelled: the loop has ended (the thread was waited for) and
            # the bus closed, so the result is complete.
            if loop.outcome is not None:  # the loop ran: a later fit() must resume
                self._ran = loop.outcome
                self.result = self._result(loop.outcome)
                self._state = loop.outcome.state
            outcome = loop.outcome
            # The run's parts refer back to the loop (late-bound callbacks): dropped now, a
            # Trainer the caller drops frees its model, optimizer and data without a gc pass.
            loop.release()
        assert outcome is not None and self.result is not None
        if outcome.error is not None:
            raise outcome.error
        if self.on_lost == "raise" and self.result.lost and outcome.reason != "cancelled":
            raise LostWorkError(self.result.lost, self.result)
        if self._signals.aborted:
            raise KeyboardInterrupt("trainbus: aborted by a second SIGINT")
        interrupted = self._signals.received is not None and self.on_signal == "raise"
        if outcome.reason != "cancelled" and not interrupted:  # the interrupt goes first
            for cb in self.callbacks:
                cb.after_fit(self.result)  # may raise (a pruned Optuna trial: TrialPruned)
        if outcome.reason == "cancelled":
            # Cancelled from outside: the worker was waited for and the bus closed under a
            # shield; let the pending cancellation out here instead of returning a result.
            await anyio.lowlevel.checkpoint()
        return self.result

    def _check_callbacks(self) -> None:
        """Let every attached callback refuse the run up front (:meth:`Callback.check`)."""
        s = self.settings
        callbacks = self.callbacks
        plan = RunPlan(
            eval_metrics=evaluation_metric_names(s), train_metrics=TRAIN_METRIC_NAMES,
            checkpoint_dir=None if s.checkpoint_dir is None else str(s.checkpoint_dir),
            external_evaluations=any(ev.ExternalEvaluationEnded in cb.publishes
                                     for cb in callbacks),
            config=plain_settings(s),
        )  # fmt: skip
        for cb in callbacks:
            cb.check(plan)

    def _check_idle(self, call: str) -> None:
        if self._call is not None:
            raise TrainbusError(f"{call} cannot run while {self._call}() runs on this Trainer "
                                "(one call at a time: await it first)")  # fmt: skip

    async def _standalone(
        self, name: str, fn: Callable[[StandaloneRun], Any], settings: Settings,
        data: Iterable[object],
    ) -> Any:
        self._check_idle(f"{name}()")
        self._lifetime.check_open(f"{name}()")
        self._call = name
        try:
            return await self._session.standalone(fn, settings, self._state)
        finally:
            self._call = None
            end_workers(data)  # the call's persistent DataLoader workers end with it

    async def evaluate(
        self, data: Iterable[Any] | Mapping[str, Iterable[Any]] | None = None
    ) -> dict[str, float]:
        """Score the model once, outside ``fit()``: before it, after it or without it.

        Publishes ``EvaluationRoundStarted(trigger="standalone")``, each set's evaluation span
        and ``EvaluationRoundEnded`` on this trainer's bus, to the same subscribers as ``fit()``
        (the ``eval_batch`` hooks run too). A ``StopTraining`` sent meanwhile ends it between
        batches (the metrics then cover the batches scored). The model's train/eval mode is
        restored afterwards.

        Args:
            data: What to score, like ``eval_data`` (one iterable or a mapping of named sets);
                None scores the trainer's ``eval_data``.

        Returns:
            The metrics, keyed as in ``EvaluationEnded.metrics``.

        Raises:
            ConfigError: no ``data`` and no ``eval_data``, or ``data`` is not valid
                ``eval_data``.
            TrainingError: a set yielded no batch; or whatever the model raised.
        """
        s = self.settings
        if data is None:
            if not s.eval_sets:
                raise ConfigError.invalid("data", None, "data to evaluate on (the Trainer has "
                                          "no eval_data)")  # fmt: skip
            sets, named = s.eval_sets, s.eval_named
        else:
            sets, named = eval_sets(data)
        settings = dataclasses.replace(s, eval_sets=sets, eval_named=named)
        metrics: dict[str, float] = await self._standalone(
            "evaluate", lambda run: run.evaluate(sets), settings, [d for _, d in sets]
        )
        return metrics

    def evaluate_sync(
        self,
        data: Iterable[Any] | Mapping[str, Iterable[Any]] | None = None,
        *,
        backend: str = "asyncio",
    ) -> dict[str, float]:
        """Synchronous twin of :meth:`evaluate`, through the same portal as :meth:`run`.

        Raises:
            As :meth:`evaluate` and :meth:`run`.
        """
        return self._lifetime.call(lambda: self.evaluate(data), backend, "evaluate")

    async def predict(self, data: Iterable[Any], *, return_outputs: bool = False) -> Any:
        """Run the model on every batch of ``data`` (no loss, no gradients), outside ``fit()``.

        Publishes ``PredictionStarted``, one ``PredictionBatchEnded`` per batch with its outputs
        (detached, on their device) so a subscriber can write them out as they come, and
        ``PredictionEnded`` (with the error, if any). Without ``return_outputs`` nothing keeps
        the outputs but the bus: a slow subscriber holds at most its buffer of them
        (``subscribe_async(buffer=..., overflow=...)``); a full ``"block"`` buffer makes
        prediction wait before its next batch until there is room. A ``StopTraining`` ends it
        between batches. ``eval_batch`` hooks run with ``ctx.phase == "predict"``.

        With ``loss_fn``, ``(inputs, targets)`` batches give ``model(inputs)``; otherwise the
        model gets the batch (a mapping as keyword arguments).

        Args:
            data: An iterable of batches.
            return_outputs: Return the outputs, concatenated along the first dimension (tensors,
                or tuples/dicts of tensors; anything else as a list per batch).

        Returns:
            The outputs when ``return_outputs``, else None. An empty ``data`` gives ``[]``.

        Raises:
            ConfigError: ``data`` is not an iterable of batches.
            Whatever the model raised (``PredictionEnded.error`` carried it first).
        """
        if isinstance(data, torch.Tensor | str | Mapping) or not isinstance(data, Iterable):
            raise ConfigError.invalid("data", type(data).__name__, "an iterable of batches")
        if not isinstance(return_outputs, bool):
            raise ConfigError.invalid("return_outputs", return_outputs, "True or False")
        kept = await self._standalone("predict",
                                      lambda run: run.predict(data, keep=return_outputs),
                                      self.settings, [data])  # fmt: skip
        return join_outputs(kept) if return_outputs else None

    def predict_sync(
        self, data: Iterable[Any], *, return_outputs: bool = False, backend: str = "asyncio"
    ) -> Any:
        """Synchronous twin of :meth:`predict`, through the same portal as :meth:`run`.

        Raises:
            As :meth:`predict` and :meth:`run`.
        """
        return self._lifetime.call(lambda: self.predict(data, return_outputs=return_outputs),
                                   backend, "predict")  # fmt: skip

    def _result(self, outcome: Outcome) -> FitResult:
        stats = self.bus.statistics()
        log.debug("fit_ended", reason=outcome.reason, step=outcome.state.step,
                 epoch=outcome.state.epoch, stop_reason=outcome.stop_reason)  # fmt: skip
        return FitResult(
            reason=outcome.reason, stop_reason=outcome.stop_reason, steps=outcome.state.step,
            epochs=outcome.state.epoch, metrics=outcome.eval_metrics,
            train_metrics=outcome.train_metrics, checkpoint=outcome.last_checkpoint,
            subscriber_failures={x.name: x.failed for x in stats.subscriptions if x.failed},
            statistics=stats, error=outcome.error, skipped_nonfinite=outcome.skipped_nonfinite,
            resumed_from=outcome.resumed_from, failed_saves=outcome.failed_saves,
            waited_s=_by_name((x.name, x.waited_s) for x in stats.subscriptions if x.waited_s),
            lost=_by_name((x.name, x.lost) for x in stats.subscriptions if x.lost),
        )  # fmt: skip


def _by_name(pairs: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """``{name: value}``; two subscriptions with one name are summed (waits, lost work)."""
    out: dict[str, Any] = {}
    for name, value in pairs:
        if name not in out:
            out[name] = value
        elif isinstance(value, LostWork):
            prev = out[name]
            out[name] = LostWork(dropped=prev.dropped + value.dropped,
                                 cancelled=prev.cancelled + value.cancelled,
                                 failed=prev.failed + value.failed)  # fmt: skip
        else:
            out[name] = out[name] + value
    return out
