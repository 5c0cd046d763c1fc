"""The Trainer: async-first ``fit()``, the loop on a training thread, the bus on the event loop
(docs/trainer.md)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping
from types import TracebackType
from typing import Any, Self

import anyio
import anyio.from_thread
import anyio.lowlevel
import torch

from .. import events as ev
from .._bus import EventBus, Tier
from .._distributed.attach_server import attach_folder
from .._distributed.data import check_ddp, unwrap_model
from .._distributed.sync import RankSync
from .._exceptions import ConfigError, LostWorkError, TrainbusError
from .._hookpoints import HookPoint
from .._log import get_logger
from .._loop import (
    TRAIN_METRIC_NAMES,
    FitResult,
    HookFn,
    HookHandle,
    Hooks,
    Loop,
    NonFinitePolicy,
    PadValue,
    PadValues,
    Precision,
    Settings,
    StandaloneRun,
    TrainContext,
    evaluation_metric_names,
    join_outputs,
)
from .._loop.outputs import ignored_keys
from .._loop.set_metrics import SetMetric
from .._seeding import seeded_run
from .._signals import OnSignal
from .._tensors import is_sharded_model
from .._validate import check_bool
from ..callbacks._base import Callback, RunPlan, global_callbacks, plain_settings
from ..callbacks._progress import Progress, progress_by_default
from ..checkpoint import TrainState
from ..events import TracedSpan
from .added import AddedCallbacks
from .calls import (
    DURING_FIT,
    BusHolder,
    CallRunner,
    SignalWatcher,
    TrainingThread,
    end_workers,
    interrupt_for,
    spawns_workers,
    warns_unawaited,
    watching_cancel,
)
from .options import (
    Accumulate,
    CheckpointDir,
    EvalSchedule,
    PerEpoch,
    build_settings,
    check_hook,
    check_options,
    eval_sets,
    explains_fit_keywords,
    explains_unknown_options,
    refuse_dataset,
)
from .rank_setup import RankSetup
from .resume import CallbackStates, check_resume, load_weights

__all__ = ["Accumulate", "CheckpointDir", "EvalSchedule", "FitResult", "PerEpoch", "Trainer"]

log = get_logger(__name__)


class Trainer:
    """A PyTorch trainer whose callbacks are subscribers on a reactive event bus
    (docs/trainer.md).

    Args:
        model: The ``torch.nn.Module`` to train.
        optimizer: A ``torch.optim.Optimizer`` over the model's parameters, or a mapping of
            names to optimizers over disjoint parameters (docs/trainer.md).
        train_data: Any iterable of batches (a ``DataLoader``, a list, a generator factory...).
        train_step: Your own step, ``fn(ctx: TrainContext) -> loss`` per micro-batch
            (docs/trainer.md, "Custom steps"). None: the default step.
        loss_fn: ``loss_fn(model(inputs), targets)`` for ``(inputs, targets)`` batches; None:
            the model returns the loss (docs/trainer.md).
        eval_data: Evaluation batches, or a mapping of set names to them (docs/trainer.md).
        max_epochs: Epochs to train; with ``max_steps`` the first limit reached ends the run.
        max_steps: Optimizer steps to train.
        scheduler: An LR scheduler stepped every optimizer step, or ``PerEpoch(scheduler)``.
        accumulate: Micro-batches per optimizer step, or an :class:`Accumulate`.
        clip_grad_norm: Clip the total gradient norm to this value (events carry the norm).
        precision: ``"32"``, ``"bf16"`` or ``"fp16"`` (CUDA), or Lightning's spellings.
        device: ``"auto"`` (CUDA, then MPS, then CPU), a device string or ``torch.device``.
        seed: Seeds the generators and the data order when ``fit()`` starts (docs/trainer.md).
        metrics: ``{"acc": fn(outputs, targets)}``, averaged over samples as ``val_acc``.
        set_metrics: Metrics of the whole evaluation set, ``{"ppl": Perplexity()}``.
        eval_schedule: When ``eval_data`` is evaluated (:class:`EvalSchedule`).
        log_every: Steps per ``MetricsLogged`` (one device read of the window's losses).
        checkpoint_dir: Where checkpoints are written, or a :class:`CheckpointDir`.
        callbacks: Callback classes or instances (user tier).
        progress: A progress bar: None (when stderr is a terminal on rank 0), True or False.
        on_nonfinite: A NaN/inf loss: ``"raise"``, ``"stop"``, ``"skip"`` or ``"ignore"``.
        on_signal: SIGINT/SIGTERM stop ``fit()`` gracefully, then ``"raise"`` (default) their
            interrupt or ``"return"`` the result; None: no handler (docs/trainer.md).
        bus: The :class:`EventBus` to run on (default: a new one), with the bus' own options.
        ddp: Under ``torchrun``, wrap the model in ``DistributedDataParallel``: None (default)
            unless it is sharded with FSDP2; False never (docs/distributed.md).
        attach: Listen for ``trainbus attach``: True (default) in ``checkpoint_dir``, a folder,
            or False (docs/attach.md).
        trace: Publish ``events.SpanTraced`` for the parts of a step: True, False (default) or
            a set of ``events.TRACED_SPANS`` names (docs/events.md).

    Raises:
        ConfigError: for any invalid argument, before anything runs or touches the disk.
        TypeError: a keyword that is no option, naming what replaces it (a Hugging Face or
            Lightning name, an option of the bus, a grouped trainbus name) or the nearest.
    """

    @explains_unknown_options
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
        scheduler: Any | PerEpoch | None = None,
        accumulate: int | Accumulate = 1,
        clip_grad_norm: float | None = None,
        precision: Precision = "32",
        device: str | torch.device = "auto",
        seed: int | None = None,
        metrics: Mapping[str, Callable[[Any, Any], Any]] | None = None,
        set_metrics: Mapping[str, SetMetric] | None = None,
        eval_schedule: EvalSchedule = EvalSchedule(),
        log_every: int = 50,
        checkpoint_dir: str | os.PathLike[str] | CheckpointDir | None = None,
        callbacks: Iterable[Callback | type[Callback]] = (),
        progress: bool | None = None,
        on_nonfinite: NonFinitePolicy = "raise",
        on_signal: OnSignal | None = "raise",
        bus: EventBus | None = None,
        ddp: bool | None = None,
        attach: bool | str | os.PathLike[str] = True,
        trace: bool | Iterable[TracedSpan] = False,
    ) -> None:
        checked = check_options(locals())
        self.bus: EventBus = checked["bus"] or EventBus()
        self.settings: Settings = build_settings(model, optimizer, train_data, checked, self.bus)
        self.on_signal: OnSignal | None = checked["on_signal"]
        self.ddp: bool = check_ddp(checked["ddp"], self.settings.model)
        self._attach_folder = attach_folder(checked["attach"], self.settings.checkpoint_dir)
        self.hooks = Hooks()
        self.result: FitResult | None = None
        self._added = AddedCallbacks(self.bus, self.hooks)
        self._thread = TrainingThread()
        self._states = CallbackStates(self.bus, self._added, self._thread)
        self._signals = SignalWatcher(self.bus)
        self._calls = CallRunner(self.bus, self.hooks, self._thread, self._signals)
        self._holder = BusHolder(self.bus, self._thread)
        self._call: str | None = None  # the call running now: "fit", "evaluate", "predict"
        instances = [self.add_callback(cb) for cb in checked["callbacks"]]
        progress = checked["progress"]
        if (progress if progress is not None else progress_by_default()) and not any(
            isinstance(cb, Progress) for cb in instances
        ):
            self.add_callback(Progress(), tier="core")
        self._state: TrainState | None = None  # the last run's, for standalone calls after it
        self.bus.publish(
            ev.TrainerBuilt(
                step=0,
                epoch=0,
                device=str(self.settings.device),
                callbacks=tuple(type(cb).__name__ for cb in self.callbacks),
            )
        )

    def add_callback(self, callback: Callback | type[Callback], *, tier: Tier = "user") -> Callback:
        """Add a callback (class or instance); while ``fit()`` runs, on the event-loop thread.

        Raises:
            ConfigError: not a Callback, a misspelt ``on_*`` / ``hook_*`` method (a Lightning
                name names the trainbus one), or a ``state_key`` another callback has.
        """
        return self._added.add(callback, tier)

    def remove_callback(self, callback: Callback) -> None:
        """Detach a callback: dispose its subscriptions and remove its hooks.

        Raises:
            ConfigError: the callback is not added to this trainer.
        """
        self._added.remove(callback)

    @property
    def callbacks(self) -> tuple[Callback, ...]:
        """The added callbacks, in attachment order."""
        return self._added.callbacks

    def add_hook(self, point: HookPoint, fn: HookFn) -> HookHandle:
        """Run ``fn(ctx)`` inline at ``point`` of every step (user tier); ``.remove()`` it.

        Raises:
            ConfigError: an unknown point, or an ``fn`` that cannot be called as ``fn(ctx)``.
        """
        check_hook(point, fn)
        return self.hooks.add(point, fn, tier="user")

    def __enter__(self) -> Self:
        """``with Trainer(...) as t:``: the sync twins run through one portal until
        :meth:`close` at the block's end.

        Raises:
            TrainbusError: the trainer's bus runs already, or closed.
        """
        self._holder.enter()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the bus and end the training thread (docs/trainer.md). Idempotent.

        Raises:
            TrainbusError: the bus runs in an ``async with trainer`` block (leave it instead).
            Exception: a subscription with ``on_error="raise"`` failed while closing.
        """
        self._holder.close()

    async def __aenter__(self) -> Self:
        """``async with Trainer(...) as t:``: run the bus in this event loop until the block
        ends, which closes it.

        Raises:
            TrainbusError: the trainer's bus runs already, or closed.
        """
        await self._holder.aenter()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._holder.aexit(exc_type)

    async def aclose(self) -> None:
        """Async twin of :meth:`close` for a trainer used without ``async with``.

        Raises:
            TrainbusError: the bus runs in a ``with`` / ``async with`` block (leave it).
        """
        await self._holder.aclose()

    @explains_fit_keywords("fit_sync")
    def fit_sync(
        self,
        *,
        resume: str | os.PathLike[str] | None = None,
        backend: str = "asyncio",
        require_checkpoint: bool = False,
    ) -> FitResult:
        """Synchronous twin of :meth:`fit`, through an anyio blocking portal (docs/trainer.md).

        Args:
            resume: As for :meth:`fit`.
            require_checkpoint: As for :meth:`fit`.
            backend: ``"asyncio"`` or ``"trio"`` (inside ``with trainer:``, the one it runs).

        Returns:
            The :class:`FitResult`.

        Raises:
            ConfigError: an unknown ``backend``.
            TrainbusError: the bus runs in an ``async with`` block's event loop (await
                ``fit()`` there).
            Exception: what :meth:`fit` raises.
        """
        with self._signals.installed(self.on_signal is not None):
            result: FitResult = self._holder.call(
                lambda: self._fit(resume=resume, require_checkpoint=require_checkpoint),
                backend,
                "fit",
            )
            self._raise_interrupt(result)  # on this thread: in the portal it would end the loop
            return result

    @warns_unawaited
    @explains_fit_keywords("fit")
    async def fit(
        self, *, resume: str | os.PathLike[str] | None = None, require_checkpoint: bool = False
    ) -> FitResult:
        """Train until ``max_epochs``/``max_steps``, a ``StopTraining``, a failure or a cancel.

        Args:
            resume: Continue a run from a checkpoint: its path, or ``"latest"`` for the newest
                valid one in ``checkpoint_dir`` (none: a fresh run, with a warning);
                docs/trainer.md, "Checkpoints and resume".
            require_checkpoint: With ``resume="latest"``: finding no valid checkpoint is a
                ``CheckpointError``, not a fresh start.

        Returns:
            The :class:`FitResult` (completed or stopped runs).

        Raises:
            ConfigError: a bad ``resume`` or ``require_checkpoint``; an added callback refuses
                the run (:meth:`Callback.check`).
            CheckpointError: a damaged, foreign or incompatible checkpoint; or
                ``require_checkpoint`` and nothing was found.
            CheckpointWriteError: the final checkpoint could not be written.
            TypeError: another framework's keyword (``ckpt_path``), naming ``resume``.
            KeyboardInterrupt: after a graceful stop by SIGINT, or a second SIGINT.
            SystemExit: ``SystemExit(143)`` after a graceful stop by SIGTERM.
            Exception: the training exception (``FitEnded`` delivered and ``trainer.result``
                set first); a ``"raise"`` subscriber's; a callback's ``after_fit``'s.
        """
        result = await self._fit(resume=resume, require_checkpoint=require_checkpoint)
        self._raise_interrupt(result)
        return result

    def _raise_interrupt(self, result: FitResult) -> None:
        signum = self._signals.received
        if signum is not None and self.on_signal == "raise" and result.reason != "cancelled":
            raise interrupt_for(signum, result.steps, result.last_checkpoint)

    async def _fit(
        self, *, resume: str | os.PathLike[str] | None, require_checkpoint: bool
    ) -> FitResult:
        self._check_idle("fit()")
        self._holder.check_open("fit()")
        if self.result is not None and resume is None:
            raise TrainbusError(
                f"fit() ran on this Trainer already (it ended {self.result.reason!r} at "
                f"step {self.result.steps}); a second fit() continues a run: "
                "fit(resume='latest') or fit(resume=<checkpoint path>); to train anew, build a "
                "new Trainer"
            )
        resume = check_resume(resume, self.settings.checkpoint_dir, require_checkpoint)
        s = self.settings
        globals_ = [
            self.add_callback(cb, tier="global")
            for cb in global_callbacks()
            if cb not in self._added
        ]
        ranks = RankSetup(self.bus, ddp=self.ddp, attach=self._attach_folder)
        loop: Loop | None = None
        try:
            self._check_callbacks()
            group, s = ranks.join(s)
            s = self.settings = seeded_run(s)  # the run's generators, data order
            s.model.to(s.device)
            checkpoint = (
                None
                if resume is None
                else self._states.load(s, resume, group, required=require_checkpoint)
            )
            s = ranks.distribute(s)
            if checkpoint is not None:
                self._states.warn_differences(s, checkpoint)
            ranks.connect()
            state = checkpoint.state if checkpoint is not None else TrainState()
            loop = Loop(
                s,
                self._calls.port,
                self.hooks,
                self._calls.barrier,
                state,
                resume=checkpoint,
                resumed_from=None if checkpoint is None else str(checkpoint.path),
                resume_source=None if checkpoint is None else self._states.resume_source,
                callback_states=self._states.collector(),
                sync=RankSync(group) if group.distributed else None,
            )
            self._call = "fit"
            self._signals.watch(loop)
            with self._signals.installed(self.on_signal is not None):
                async with self._calls.open():
                    async with watching_cancel(loop, self._thread):
                        spawns = spawns_workers([s.train_data, *(d for _, d in s.eval_sets)])
                        await self._thread.run(self._signals.masked(loop.run, spawns))
        finally:
            self._call = None
            end_workers([s.train_data, *(d for _, d in s.eval_sets)])  # persistent ones too
            self._signals.watch(None)
            for cb in globals_:
                self.remove_callback(cb)
            ran = None if loop is None else loop.result
            ranks.close(ran)
            if ran is not None:  # the loop ran: a later fit() must resume
                self.result = ran.with_bus(self.bus.statistics())
                self._state = state
        assert ran is not None and self.result is not None
        if ran.error is not None:
            raise ran.error
        if self.bus.on_lost == "raise" and self.result.lost_work and ran.reason != "cancelled":
            raise LostWorkError(self.result.lost_work, self.result)
        if self._signals.aborted and ran.reason == "cancelled":
            raise KeyboardInterrupt("trainbus: aborted by a second SIGINT")
        if self._signals.aborted:  # too late to abort: the run had ended, and says how
            where = f"at step {ran.steps}" + (
                f", checkpoint {ran.last_checkpoint}" if ran.last_checkpoint else ""
            )
            raise KeyboardInterrupt(
                f"trainbus: a second SIGINT came after the run had ended ({ran.reason} {where}); "
                "trainer.result holds the result"
                + (", and FitResult.lost_work what it cancelled" if self.result.lost_work else "")
            )
        interrupted = self._signals.received is not None and self.on_signal == "raise"
        if ran.reason != "cancelled" and not interrupted:  # the interrupt goes first
            self._load_weights_at_end()
            for cb in self.callbacks:
                cb.after_fit(self.result)  # may raise (a pruned Optuna trial: TrialPruned)
        if ran.reason == "cancelled":
            await anyio.lowlevel.checkpoint()  # let the pending cancellation out
        return self.result

    def load_weights(self, path: str | os.PathLike[str]) -> int:
        """Load only the model weights of the checkpoint ``path``, between calls.

        Returns:
            The step the weights are of.

        Raises:
            TrainbusError: a call runs on this Trainer.
            CheckpointError: the file is missing, damaged or foreign, a sharded run's folder,
                or its weights do not fit the model.
        """
        self._check_idle("load_weights()")
        checkpoint = load_weights(self.settings.model, path)
        log.info("weights_loaded", path=str(checkpoint.path), step=checkpoint.state.step)
        return checkpoint.state.step

    def _load_weights_at_end(self) -> None:
        """Load the weights the first callback asking for some wants at the end of ``fit()``."""
        asked = [(cb, p) for cb in self.callbacks if (p := cb.weights_at_end()) is not None]
        if not asked:
            return
        cb, path = asked[0]
        if len(asked) > 1:
            log.warning(
                "weights_at_end_ignored",
                path=str(path),
                ignored=[str(p) for _, p in asked[1:]],
                reason="several callbacks ask for weights at the end; the first added wins",
            )
        if not os.path.exists(path):
            log.warning(
                "weights_at_end_missing",
                path=str(path),
                callback=type(cb).__name__,
                action="the model keeps its last weights",
            )
            return
        step = load_weights(self.settings.model, path).state.step
        log.info(
            "weights_loaded",
            path=str(path),
            step=step,
            callback=type(cb).__name__,
            reason="weights_at_end",
        )

    def _check_callbacks(self) -> None:
        s = self.settings
        callbacks = self.callbacks
        plan = RunPlan(
            eval_metrics=evaluation_metric_names(s),
            train_metrics=TRAIN_METRIC_NAMES,
            checkpoint_dir=None if s.checkpoint_dir is None else str(s.checkpoint_dir),
            external_evaluations=any(
                ev.ExternalEvaluationEnded in cb.publishes for cb in callbacks
            ),
            config=plain_settings(s),
            sharded=is_sharded_model(unwrap_model(s.model)),
        )
        for cb in callbacks:
            cb.check(plan)

    def _check_idle(self, call: str) -> None:
        if self._call is not None:
            raise TrainbusError(
                f"{call} cannot run while {self._call}() runs on this Trainer (one call at a "
                f"time: await it first){DURING_FIT if self._call == 'fit' else ''}"
            )

    async def _standalone(
        self,
        name: str,
        fn: Callable[[StandaloneRun], Any],
        settings: Settings,
        data: Iterable[object],
    ) -> Any:
        self._check_idle(f"{name}()")
        self._holder.check_open(f"{name}()")
        self._call = name
        try:
            return await self._calls.standalone(fn, settings, self._state)
        finally:
            self._call = None
            end_workers(data)  # the call's persistent DataLoader workers end with it

    @warns_unawaited
    async def evaluate(
        self, data: Iterable[Any] | Mapping[str, Iterable[Any]] | None = None
    ) -> dict[str, float]:
        """Score the model once, outside ``fit()``, on the same bus, subscribers and hooks
        (docs/trainer.md, "Evaluate and predict outside fit()").

        Args:
            data: What to score, like ``eval_data``; None scores the trainer's ``eval_data``.

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
                raise ConfigError.invalid(
                    "data", None, "data to evaluate on (the Trainer has no eval_data)"
                )
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
        """Synchronous twin of :meth:`evaluate`, through the same portal as :meth:`fit_sync`.

        Raises:
            Exception: what :meth:`evaluate` and :meth:`fit_sync` raise.
        """
        return self._holder.call(lambda: self.evaluate(data), backend, "evaluate")

    @warns_unawaited
    async def predict(
        self,
        data: Iterable[Any],
        *,
        return_outputs: bool = False,
        pad_value: PadValue | Mapping[str | torch.dtype, PadValue] | None = None,
        ignore_keys: Iterable[str] | None = None,
    ) -> Any:
        """Run the model on every batch of ``data`` (no loss, no gradients), outside ``fit()``,
        publishing each batch's outputs (docs/trainer.md, "Evaluate and predict outside fit()").

        Args:
            data: An iterable of batches.
            return_outputs: Return the outputs concatenated along the first dimension, padded
                to the largest size in the others.
            pad_value: What pads them: None (``-100``, ``0`` unsigned, ``False`` bool), one
                number, or a mapping of output keys (at any depth) and dtypes to numbers (a
                key wins over a dtype).
            ignore_keys: Keys of mapping outputs dropped from every batch (Hugging Face's
                ``predict(ignore_keys=...)``); None: for a model with a ``config``, its
                ``keys_to_ignore_at_inference`` (else ``["cache"]``), for others none.

        Returns:
            The outputs when ``return_outputs``, else None. An empty ``data`` gives ``[]``.

        Raises:
            ConfigError: ``data`` is not an iterable of batches, or a bad ``pad_value``.
            TrainingError: with ``return_outputs``, outputs that cannot be joined.
            Exception: whatever the model raised (``PredictionEnded.error`` carried it first).
        """
        refuse_dataset("data", data)
        if isinstance(data, torch.Tensor | str | Mapping) or not isinstance(data, Iterable):
            raise ConfigError.wrong_kind("data", data, "an iterable of batches")
        check_bool("return_outputs", return_outputs)
        pad = PadValues.check(pad_value)
        ignore = ignored_keys(self.settings.model, ignore_keys)
        kept = await self._standalone(
            "predict",
            lambda run: run.predict(data, keep=return_outputs, pad=pad, ignore=ignore),
            self.settings,
            [data],
        )
        return join_outputs(kept, pad) if return_outputs else None

    def predict_sync(
        self,
        data: Iterable[Any],
        *,
        return_outputs: bool = False,
        pad_value: PadValue | Mapping[str | torch.dtype, PadValue] | None = None,
        ignore_keys: Iterable[str] | None = None,
        backend: str = "asyncio",
    ) -> Any:
        """Synchronous twin of :meth:`predict`, through the same portal as :meth:`fit_sync`.

        Raises:
            Exception: what :meth:`predict` and :meth:`fit_sync` raise.
        """
        return self._holder.call(
            lambda: self.predict(
                data, return_outputs=return_outputs, pad_value=pad_value, ignore_keys=ignore_keys
            ),
            backend,
            "predict",
        )
