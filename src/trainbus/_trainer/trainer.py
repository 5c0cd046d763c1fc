"""The Trainer: async-first ``fit()``, the loop in a worker thread, the bus on the event loop.

::

    trainer = Trainer(model, optimizer, train_loader, loss_fn=F.cross_entropy,
                      eval_data=val_loader, max_epochs=3, checkpoint_dir="runs/demo")
    trainer.bus.stream(ev.StepEnded).pipe(ops.throttle_first(1.0)).subscribe(log_step)
    result = await trainer.fit()        # or trainer.fit_sync() from synchronous code
    result = await Trainer(...same arguments...).fit(resume="latest")   # after a crash

``fit()`` opens the bus' task group (unless ``with`` / ``async with trainer`` holds it), runs the
loop (see ``trainbus._loop.loop`` for the event order) on the Trainer's training thread (one for
all its calls, ended by ``close()`` or the Trainer's drop; docs/compile.md),
turns SIGINT/SIGTERM into ``StopTraining`` (a second SIGINT aborts), and suspends the bus, which
delivers every event published before ``FitEnded``; ``evaluate()`` and ``predict()`` run on the
same bus and subscribers, before or after it (docs/trainer.md, "One Trainer, many calls").
"""

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
from .._distributed.data import unwrap_model
from .._distributed.sharding import check_ddp
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
    eval_sets,
    evaluation_metric_names,
    join_outputs,
)
from .._loop.outputs import ignored_keys
from .._loop.set_metrics import SetMetric
from .._seeding import seeded_run
from .._tensors import is_sharded_model
from ..callbacks._base import Callback, RunPlan, global_callbacks, plain_settings
from ..callbacks._progress import Progress, progress_by_default
from ..checkpoint import TrainState
from ..events import TracedSpan
from .added import AddedCallbacks
from .calls import CallRunner, SignalWatcher, TrainingThread, watching_cancel
from .endings import OnSignal, interrupt_for
from .holder import BusHolder
from .options import (
    Accumulate,
    CheckpointDir,
    EvalSchedule,
    PerEpoch,
    build_settings,
    check_options,
    explains_unknown_options,
)
from .rank_setup import RankSetup
from .resume import CallbackStates, check_resume, load_weights
from .workers import end_workers, spawns_workers

__all__ = ["Accumulate", "CheckpointDir", "EvalSchedule", "FitResult", "PerEpoch", "Trainer"]

log = get_logger(__name__)


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
        loss_fn: ``loss_fn(model(inputs), targets)`` for ``(inputs, targets)`` batches.
            Without it, ``model(batch)`` (``model(**batch)`` for a mapping) returns the loss, a
            mapping with ``"loss"`` or an object with ``.loss`` (the Hugging Face convention).
        eval_data: Iterable of evaluation batches, or a mapping of set names to iterables
            (``{"val": val_loader, "test": test_loader}``), scored one after the other in one
            evaluation round. Metrics of a single loader are ``val_loss``/``val_<name>``; of
            named sets ``<set>/loss``/``<set>/<name>`` (``"test/acc"``).
        max_epochs: Epochs to train; with ``max_steps`` the first limit reached ends the run.
        max_steps: Optimizer steps to train.
        scheduler: An LR scheduler, stepped every optimizer step; with several optimizers a
            mapping of optimizer names to schedulers. ``PerEpoch(scheduler)``: stepped once
            per epoch instead.
        accumulate: Micro-batches per optimizer step (gradient accumulation), or
            ``Accumulate(n, by="items")`` to weigh them by their items (:class:`Accumulate`).
        clip_grad_norm: Clip the total gradient norm to this value; the pre-clip norm is
            reported as ``grad_norm`` on the events.
        precision: ``"32"``, ``"bf16"`` (autocast, any device; on CUDA compute capability 8.0
            or later) or ``"fp16"`` (autocast with a grad scaler, CUDA only); Lightning's
            ``"32-true"``, ``"bf16-mixed"`` and ``"16-mixed"`` are the same three.
        device: ``"auto"`` (CUDA, then MPS, then CPU), a device string or ``torch.device``.
            ``"auto"`` and ``"cuda"`` resolve now to ``cuda:N`` (the current CUDA device); the
            loop, evaluate and predict make it current on their own threads (docs/trainer.md,
            "On a GPU").
        seed: At the start of ``fit()``, seeds Python's, NumPy's and torch's process-wide
            generators (:func:`~trainbus.seed_everything`; call that one before building the
            model for equal initial weights), and gives a ``DataLoader(shuffle=True)`` without
            a ``generator`` a data order of ``(seed, epoch)`` that no other thread's draws
            change (docs/trainer.md, "Seeds").
        metrics: ``{"acc": fn(outputs, targets)}``, averaged over samples as ``val_acc``;
            ``targets`` is the second element of ``(inputs, targets)`` batches, a mapping
            batch's ``"labels"``, else the batch (docs/trainer.md, "Metric functions").
        set_metrics: Metrics of the whole evaluation set, ``{"ppl": Perplexity()}`` as
            ``val_ppl``: each sums ``update(outputs, targets)``'s values over the set (and the
            ranks) and ``compute(totals)`` gives the value (:class:`~trainbus.SetMetric`;
            :class:`~trainbus.Perplexity`, :class:`~trainbus.TokenAccuracy`). One that raises
            is counted in ``FitResult.metric_failures`` and left out; the run goes on
            (docs/trainer.md, "Metrics of the whole set").
        eval_schedule: When ``eval_data`` is evaluated (:class:`EvalSchedule`): every N
            optimizer steps (``every_steps``), after each epoch (``epoch_end``, default) and
            once more at the end of a completed run whose last step was not evaluated
            (``at_end``, default).
        log_every: Steps per ``MetricsLogged`` (one device read of the log window's losses).
        checkpoint_dir: Where ``SaveCheckpoint`` writes; a final checkpoint is written when a
            run completes or stops (``CheckpointDir(path, skip_final={"pruned"})``: stopped
            runs that write none). Checked now (creatable, writable, not under a file),
            created at the first save (or when ``fit()`` starts, with ``attach`` listening
            there; removed at the end if still empty). Resume with ``fit(resume=...)``.
        callbacks: Callback classes or instances (user tier). Stateful ones (overriding
            ``state_dict``) need distinct ``state_key``s.
        progress: Show a :class:`~trainbus.callbacks.Progress` bar: ``None`` (default) when
            stderr is a terminal on rank 0 (the ``RANK`` variable torchrun sets, default 0),
            ``True`` always, ``False`` never. A ``Progress`` in ``callbacks`` replaces it.
        on_nonfinite: A NaN/inf loss ``"raise"``s ``NonFiniteLossError`` (the run fails),
            ``"stop"``s the run (no checkpoint of the bad state), ``"skip"``s that batch's
            update (counted in ``FitResult.skipped_nonfinite``), or is ``"ignore"``d. Checked
            every step (docs/trainer.md); a checkpoint never holds non-finite weights.
        on_signal: SIGINT/SIGTERM during ``fit()`` / ``fit_sync()`` called on the main thread
            become a graceful stop (``StopTraining``: final checkpoint written, events
            delivered; a second SIGINT aborts; a signal the process ignores stays ignored).
            Then ``"raise"`` (default) lets the interrupt reach the caller,
            ``KeyboardInterrupt`` for SIGINT, ``SystemExit(143)`` for SIGTERM
            (``trainer.result`` holds the result, ``ending == Ending.SIGNAL``); ``"return"``
            returns the result instead. None: no handler (Python's own behaviour).
        bus: The :class:`EventBus` to run on (default: a new ``EventBus()``). The bus' own
            options are set there: ``bus=EventBus(close_timeout=..., watchdog_s=...,
            barriers=..., barrier_timeout=..., on_lost="raise")``.
        ddp: Under ``torchrun`` with more than one rank, wrap the model in
            ``DistributedDataParallel`` (a model already wrapped is left as it is). ``False``
            for a model you parallelise yourself (a custom wrapper): trainbus then neither
            wraps it nor all-reduces its gradients (docs/distributed.md). None (the default):
            DDP, except for a model sharded with FSDP2 (``fully_shard``), which reduces its own
            gradients and is never wrapped; ``True`` for such a model is a ``ConfigError``.
        attach: Let other processes of your user attach to ``fit()`` (``trainbus attach
            RUN_DIR``, :func:`trainbus.attach`): rank 0 listens on ``attach.sock`` in the run
            folder, with ``attach.token`` beside it, both removed at the end. True (default):
            in ``checkpoint_dir`` when set (on platforms with Unix domain sockets); a folder:
            there; False: never. Free while nobody is attached (docs/attach.md).
        trace: Time the parts of each step (the data wait, forward, backward, optimizer step,
            ``zero_grad``, scheduler step) and publish each as one ``events.SpanTraced``:
            True for every part, a set of ``events.TRACED_SPANS`` names for those; False
            (default): nothing is timed or published (docs/events.md, "Tracing").

    Raises:
        ConfigError: for any invalid argument, before anything runs or touches the disk.
        TypeError: a keyword that is no option, naming what replaces it (a Hugging Face name,
            an option of the bus, a trainbus name that was grouped) or the nearest option.
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
        checked = check_options(locals())  # the keyword options, as the signature declares them
        self.bus: EventBus = checked["bus"] or EventBus()
        self.settings: Settings = build_settings(model, optimizer, train_data, checked, self.bus)
        self.on_signal: OnSignal | None = checked["on_signal"]
        self.ddp: bool = check_ddp(checked["ddp"], self.settings.model)
        self._attach_folder = attach_folder(checked["attach"], self.settings.checkpoint_dir)
        self.hooks = Hooks()
        self.result: FitResult | None = None
        self._added = AddedCallbacks(self.bus, self.hooks)
        added = self._added  # not self: no cycle through the trainer (freed without gc)
        # Every call's loop runs on this one thread, from the first call to close() or the
        # Trainer's drop (a compiled model traces, recompiles and replays on one thread).
        self._thread = TrainingThread()
        self._states = CallbackStates(self.bus, lambda: added.callbacks, self._thread)
        self._calls = CallRunner(self.bus, self.hooks, self.bus.barrier_timeout, self._thread)
        self._signals = SignalWatcher(self.bus, on_signal=self._calls.interrupt)
        self._holder = BusHolder(self.bus, self._thread)
        self._call: str | None = None  # the call running now: "fit", "evaluate", "predict"
        instances = [cb() if isinstance(cb, type) else cb for cb in checked["callbacks"]]
        for cb in instances:
            self.add_callback(cb)
        progress = checked["progress"]
        if (progress if progress is not None else progress_by_default()) and not any(
            isinstance(cb, Progress) for cb in instances
        ):
            self.add_callback(Progress(), tier="core")  # the default kit's progress bar
        self._state: TrainState | None = None  # the last run's, for standalone calls after it
        # Queued now, delivered when the bus first runs: subscribers made by then see it.
        self.bus.publish(ev.TrainerBuilt(step=0, epoch=0, device=str(self.settings.device),
                                         callbacks=tuple(type(cb).__name__
                                                         for cb in self.callbacks)))  # fmt: skip

    # ================================================================== callbacks and hooks
    def add_callback(self, callback: Callback | type[Callback], *, tier: Tier = "user") -> Callback:
        """Add a callback (class or instance): its ``on_*`` subscribers, ``hook_*`` hooks
        and ``setup(bus)`` pipelines. While ``fit()`` runs, call it on the event-loop thread.

        Returns:
            The added instance.

        Raises:
            ConfigError: not a Callback, a misspelt ``on_*`` / ``hook_*`` method, or a
                stateful callback whose ``state_key`` another added one already has.
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
        """AddedCallbacks callbacks, in attachment order."""
        return self._added.callbacks

    def add_hook(self, point: HookPoint, fn: HookFn) -> HookHandle:
        """Run ``fn(ctx)`` inline at ``point`` of every step (user tier); ``.remove()`` it.

        Raises:
            ConfigError: unknown point or non-callable ``fn``.
        """
        return self.hooks.add(point, fn, tier="user")

    # ================================================================== lifetime
    def __enter__(self) -> Self:
        """``with Trainer(...) as t:``: run the bus (in a blocking portal: an event loop in a
        thread) until the block ends; ``t.fit_sync()``, ``t.evaluate_sync()``, ``t.predict_sync()``
        run through that one portal. The end of the block is :meth:`close`.

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
        """Close the bus: deliver what is queued, complete the streams (buffering operators
        emit what they hold), wait for async subscribers (``close_timeout``), then stop the
        ``with`` block's portal and end the training thread. Idempotent; later calls raise
        ``TrainbusError``. A Trainer never closed loses nothing of its calls (each delivers
        before it returns); closing completes the streams and frees the subscribers (dropping
        the Trainer ends its training thread too).

        Raises:
            TrainbusError: the bus runs in an ``async with trainer`` block (leave it instead).
            Exception: a subscription with ``on_error="raise"`` failed while closing (the
                subscriber's own exception).
        """
        self._holder.close()

    async def __aenter__(self) -> Self:
        """``async with Trainer(...) as t:``: run the bus in this event loop until the end of
        the block, which closes it.

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

    # ================================================================== running
    def fit_sync(
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
            ConfigError: an unknown ``backend``.
            TrainbusError: the bus runs in an ``async with`` block's event loop (await
                ``fit()`` there).
            Exception: what :meth:`fit` raises.
        """
        with self._signals.installed(self.on_signal is not None):
            result: FitResult = self._holder.call(
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
                ``resume``; an added callback refuses the run before it starts
                (:meth:`Callback.check`: a monitored metric no evaluation produces,
                ``Checkpointing`` without a ``checkpoint_dir``).
            CheckpointError: the checkpoint is damaged or foreign, or was written for another
                model shape, optimizer type or world size (nothing is restored); or
                ``require_checkpoint`` and ``"latest"`` found no valid checkpoint.
            CheckpointWriteError: the final checkpoint could not be written (an ``OSError``
                naming the file; the earlier checkpoints stay valid).
            KeyboardInterrupt: after a second SIGINT; after a graceful stop by SIGINT unless
                ``on_signal="return"``.
            SystemExit: ``SystemExit(143)`` after a graceful stop by SIGTERM unless
                ``on_signal="return"``.
            Exception: the training exception when the run fails (``FitEnded(reason="failed")``
                was published and delivered first; ``trainer.result`` holds the result);
                a subscriber's own exception when it has ``on_error="raise"`` (a note names the
                subscription and event; ``except MyError`` matches); what a callback's
                :meth:`Callback.after_fit` raised (``optuna.TrialPruned`` for a pruned trial);
                the cancellation when cancelled.
        """
        result = await self._fit(resume=resume, require_checkpoint=require_checkpoint)
        self._raise_interrupt(result)
        return result

    def _raise_interrupt(self, result: FitResult) -> None:
        """After a graceful stop by a signal (``on_signal="raise"``): its interrupt."""
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
        self._calls.begin()
        globals_ = [self.add_callback(cb, tier="global") for cb in global_callbacks()
                    if cb not in self._added]  # fmt: skip
        try:
            self._check_callbacks()
        except BaseException:
            for cb in globals_:
                self.remove_callback(cb)
            raise
        ranks = RankSetup(self.bus, ddp=self.ddp, attach=self._attach_folder)
        try:
            group = ranks.join(s.device)
            s = self.settings = seeded_run(ranks.place(s))  # the run's generators, data order
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
        except BaseException:
            for cb in globals_:
                self.remove_callback(cb)
            ranks.close(None)
            raise
        state = checkpoint.state if checkpoint is not None else TrainState()
        loop = Loop(
            s, self._calls.port, self.hooks, self._calls.barrier, state, resume=checkpoint,
            resumed_from=None if checkpoint is None else str(checkpoint.path),
            resume_source=None if checkpoint is None else self._states.resume_source,
            callback_states=self._states.collect_from_thread if self._states.any_stateful
            else None,
            sync=RankSync(group) if group.distributed else None,
        )  # fmt: skip
        self._call = "fit"
        self._signals.watch(loop)
        try:
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
            ranks.close(loop.result)
            # Also when fit() is cancelled: the loop has ended (the thread was waited for) and
            # the bus closed, so the result is complete.
            if loop.result is not None:  # the loop ran: a later fit() must resume
                self.result = loop.result.with_bus(self.bus.statistics())
                self._state = state
            ran = loop.result
            # The run's parts refer back to the loop (late-bound callbacks): dropped now, a
            # Trainer the caller drops frees its model, optimizer and data without a gc pass.
            loop.release()
        assert ran is not None and self.result is not None
        if ran.error is not None:
            raise ran.error
        if self.bus.on_lost == "raise" and self.result.lost_work and ran.reason != "cancelled":
            raise LostWorkError(self.result.lost_work, self.result)
        if self._signals.aborted:
            raise KeyboardInterrupt("trainbus: aborted by a second SIGINT")
        interrupted = self._signals.received is not None and self.on_signal == "raise"
        if ran.reason != "cancelled" and not interrupted:  # the interrupt goes first
            # Every event is delivered and the loop has ended: nothing reads the model now.
            self._load_weights_at_end()
            for cb in self.callbacks:
                cb.after_fit(self.result)  # may raise (a pruned Optuna trial: TrialPruned)
        if ran.reason == "cancelled":
            # Cancelled from outside: the worker was waited for and the bus closed under a
            # shield; let the pending cancellation out here instead of returning a result.
            await anyio.lowlevel.checkpoint()
        return self.result

    def load_weights(self, path: str | os.PathLike[str]) -> int:
        """Load the model weights of the checkpoint ``path`` into the Trainer's model (only
        the weights: optimizer, scheduler and train state stay), on this rank; between calls,
        never while one runs. What ``Checkpointing(load_best_at_end=True)`` has ``fit()`` do.

        Args:
            path: A checkpoint file (``Checkpointing.best_path``, ``FitResult.last_checkpoint``).

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
        """Load the weights an added callback asks for at the end of ``fit()``
        (:meth:`Callback.weights_at_end`), on every rank; a file gone meanwhile is a warning,
        the model keeping its last weights."""
        asked = [(cb, p) for cb in self.callbacks if (p := cb.weights_at_end()) is not None]
        if not asked:
            return
        cb, path = asked[0]
        if len(asked) > 1:
            log.warning("weights_at_end_ignored", path=str(path),
                        ignored=[str(p) for _, p in asked[1:]],
                        reason="several callbacks ask for weights at the end; the first "
                        "added wins")  # fmt: skip
        if not os.path.exists(path):
            log.warning("weights_at_end_missing", path=str(path), callback=type(cb).__name__,
                        action="the model keeps its last weights")  # fmt: skip
            return
        step = load_weights(self.settings.model, path).state.step
        log.info("weights_loaded", path=str(path), step=step, callback=type(cb).__name__,
                 reason="weights_at_end")  # fmt: skip

    def _check_callbacks(self) -> None:
        """Let every added callback refuse the run up front (:meth:`Callback.check`)."""
        s = self.settings
        callbacks = self.callbacks
        plan = RunPlan(
            eval_metrics=evaluation_metric_names(s), train_metrics=TRAIN_METRIC_NAMES,
            checkpoint_dir=None if s.checkpoint_dir is None else str(s.checkpoint_dir),
            external_evaluations=any(ev.ExternalEvaluationEnded in cb.publishes
                                     for cb in callbacks),
            config=plain_settings(s),
            sharded=is_sharded_model(unwrap_model(s.model)),
        )  # fmt: skip
        for cb in callbacks:
            cb.check(plan)

    def _check_idle(self, call: str) -> None:
        if self._call is not None:
            raise TrainbusError(f"{call} cannot run while {self._call}() runs on this Trainer "
                                "(one call at a time: await it first)")  # fmt: skip

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
        """Synchronous twin of :meth:`evaluate`, through the same portal as :meth:`fit_sync`.

        Raises:
            Exception: what :meth:`evaluate` and :meth:`fit_sync` raise.
        """
        return self._holder.call(lambda: self.evaluate(data), backend, "evaluate")

    async def predict(
        self,
        data: Iterable[Any],
        *,
        return_outputs: bool = False,
        pad_value: PadValue | Mapping[str | torch.dtype, PadValue] | None = None,
        ignore_keys: Iterable[str] | None = None,
    ) -> Any:
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
                or tuples/dicts of tensors; anything else as a list per batch). Tensors whose
                other dimensions differ between batches (batches padded per batch) are padded
                at the end of each dimension to the largest size.
            pad_value: What pads them: None for the defaults (``-100`` for signed integer and
                floating tensors, as Hugging Face pads; ``0`` for unsigned integers, ``False``
                for ``bool``); one number for every tensor; or a mapping of output keys and
                dtypes to numbers (``{"logits": float("nan"), torch.int64: -100}``; a key wins
                over a dtype, the defaults fill the rest).
            ignore_keys: Keys of mapping outputs (a ``ModelOutput`` included) dropped from
                every batch before it is kept or published, as Hugging Face's
                ``predict(ignore_keys=...)``. None: the model's
                ``config.keys_to_ignore_at_inference`` when it has one (a causal LM's
                ``past_key_values``: a cache per batch, not outputs to keep), else none.

        Returns:
            The outputs when ``return_outputs``, else None. An empty ``data`` gives ``[]``.

        Raises:
            ConfigError: ``data`` is not an iterable of batches; ``pad_value`` is not a number
                nor such a mapping, names a key no output has, or is a value the dtype of a
                tensor it pads cannot hold (``-100`` for ``uint8``, ``0.5`` for ``int64``).
            TrainingError: with ``return_outputs``, outputs padding cannot join (another
                number of dimensions or dtype than the first batch's), raised at that batch,
                naming the key and both shapes.
            Exception: whatever the model raised (``PredictionEnded.error`` carried it first).
        """
        if isinstance(data, torch.Tensor | str | Mapping) or not isinstance(data, Iterable):
            raise ConfigError.invalid("data", type(data).__name__, "an iterable of batches")
        if not isinstance(return_outputs, bool):
            raise ConfigError.invalid("return_outputs", return_outputs, "True or False")
        pad = PadValues.check(pad_value)
        ignore = ignored_keys(self.settings.model, ignore_keys)
        kept = await self._standalone("predict",
                                      lambda run: run.predict(data, keep=return_outputs,
                                                              pad=pad, ignore=ignore),
                                      self.settings, [data])  # fmt: skip
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
        return self._holder.call(lambda: self.predict(data, return_outputs=return_outputs,
                                                        pad_value=pad_value,
                                                        ignore_keys=ignore_keys),
                                   backend, "predict")  # fmt: skip
