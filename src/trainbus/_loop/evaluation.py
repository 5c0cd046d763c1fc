"""The evaluation round of ``fit()``, and ``evaluate()`` / ``predict()`` outside it (on the
training thread, the same bus and hooks; only ``StopTraining`` is applied)."""

from __future__ import annotations

import math
import reprlib
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .. import commands as cmd
from .. import events as ev
from .._exceptions import ConfigError, TrainingError
from .._hookpoints import HookPoint, StepContext
from .._tensors import batch_size, move_to_device, use_device
from ..checkpoint._rng import isolated_rng
from .forward import loss_of, metric_targets, model_outputs
from .outputs import KeptOutputs, PadValues, map_tensors, without_keys
from .result import CancelFlag
from .set_metrics import MetricFailures, SetTotals, Totals
from .wants import Wants

if TYPE_CHECKING:
    from .._bus import LoopPort
    from ..checkpoint import TrainState
    from .hooks import HookFn, Hooks
    from .settings import Settings

__all__ = ["Evaluator", "StandaloneRun", "evaluation_metric_names", "hooked_batch", "metric_name"]


def _metric_value(name: str, value: Any, device: torch.device) -> torch.Tensor:
    """What metric function ``name`` returned, as a tensor on ``device``."""
    try:
        return torch.as_tensor(value, device=device)
    except (TypeError, ValueError, RuntimeError) as exc:
        if isinstance(value, torch.Tensor):  # a tensor's own failure (a device), not its type
            raise
        raise ConfigError(
            f"metrics[{name!r}] returned {type(value).__name__} {reprlib.repr(value)}: return a "
            "number or a one-element tensor (a larger tensor is averaged); for several values, "
            "one metric function each"
        ) from exc


def metric_name(dataset: str, name: str, *, named: bool) -> str:
    """``val_<name>`` for a single ``eval_data`` loader, ``<set>/<name>`` for named sets."""
    return f"{dataset}/{name}" if named else f"val_{name}"


def evaluation_metric_names(s: Settings) -> frozenset[str]:
    """Every key an evaluation of this run can put in ``EvaluationEnded.metrics``."""
    names = ("loss", *s.metrics, *s.set_metrics)
    sets = [dataset for dataset, _ in s.eval_sets]
    return frozenset(metric_name(d, n, named=s.eval_named) for d in sets for n in names)


def hooked_batch(
    s: Settings,
    st: TrainState,
    hooks: Sequence[HookFn],
    bi: int,
    batch: Any,
    phase: str,
    dataset: str | None = None,
    trigger: ev.EvalTrigger | None = None,
) -> tuple[bool, Any]:
    """``(skipped, batch)``: ``batch`` on the device after the ``eval_batch`` hooks."""
    batch = move_to_device(batch, s.device)
    if not hooks:
        return False, batch
    ctx = StepContext(
        step=st.step,
        epoch=st.epoch,
        batch_index=bi,
        micro_batch=0,
        batch=batch,
        model=s.model,
        optimizer=s.optimizer,
        phase=phase,
        dataset=dataset,
        trigger=trigger,
    )
    for hook in hooks:
        hook(ctx)
    return ctx.skip, None if ctx.skip else move_to_device(ctx.batch, s.device)


class Evaluator:
    """Scores the evaluation sets (sums read once per set, the training's RNG untouched).
    ``should_stop`` ends a round early; torchrun: ``reduce`` and ``sum_totals`` join ranks."""

    def __init__(
        self,
        settings: Settings,
        port: LoopPort,
        state: TrainState,
        wants: Wants,
        check_cancel: Callable[[], None],
        hooks: Hooks,
        should_stop: Callable[[], bool] | None = None,
        reduce: Callable[[dict[str, float], int], dict[str, float]] | None = None,
        sum_totals: Callable[[Totals], Totals] | None = None,
    ) -> None:
        self._s, self._port, self._state = settings, port, state
        self._wants, self._check_cancel = wants, check_cancel
        self._hooks = hooks
        self._should_stop = should_stop if should_stop is not None else lambda: False
        self._reduce, self._sum_totals = reduce, sum_totals
        self.failures = MetricFailures()
        self.metrics: dict[str, float] = {}  # the last round's, merged (a resume sets them)
        self.last_round: ev.EvaluationRoundEnded | None = None
        self.last_ends: tuple[ev.EvaluationEnded, ...] = ()

    def run(
        self,
        triggers: tuple[ev.EvalTrigger, ...],
        sets: Sequence[tuple[str, Iterable[Any]]] | None = None,
    ) -> tuple[ev.EvaluationEnded, ...]:
        """One round for ``triggers`` over ``sets`` (None: the settings'), its hooks and events;
        returns each set's ``EvaluationEnded``."""
        s, pub, st = self._s, self._port.publish, self._state
        sets = s.eval_sets if sets is None else tuple(sets)
        trigger = triggers[0]
        self._wants.refresh()
        pub(
            ev.EvaluationRoundStarted(
                step=st.step,
                epoch=st.epoch,
                trigger=trigger,
                datasets=tuple(n for n, _ in sets),
                triggers=triggers,
            )
        )
        ends: list[ev.EvaluationEnded] = []
        merged: dict[str, float] = {}
        error: BaseException | None = None
        try:
            with isolated_rng(s.device):
                try:
                    self._round_hooks("before_evaluation", trigger, None)
                    for name, data in sets:
                        ended = self._run_set(triggers, name, data)
                        ends.append(ended)
                        merged.update(ended.metrics)
                        if self._should_stop():
                            break
                except BaseException as exc:
                    self._round_hooks("after_evaluation", trigger, exc)
                    raise
                self._round_hooks("after_evaluation", trigger, None)
        except BaseException as exc:
            error = exc
            raise
        finally:
            done = ev.EvaluationRoundEnded(
                step=st.step,
                epoch=st.epoch,
                metrics=merged,
                trigger=trigger,
                error=error,
                triggers=triggers,
            )
            pub(done)
            self.last_round = done
        self.metrics = merged
        self.last_ends = tuple(ends)
        if trigger != "standalone":
            st.evaluated()
        return self.last_ends

    def _round_hooks(
        self, point: HookPoint, trigger: ev.EvalTrigger, error: BaseException | None
    ) -> None:
        """``"after_evaluation"`` unwinds like nested context managers (reversed, all run)."""
        hooks = self._hooks.by_point[point]
        if not hooks:
            return
        s, st = self._s, self._state
        ctx = StepContext(
            step=st.step,
            epoch=st.epoch,
            batch_index=0,
            micro_batch=0,
            batch=None,
            model=s.model,
            optimizer=s.optimizer,
            phase="eval",
            trigger=trigger,
            error=error,
        )
        if point == "before_evaluation":
            for hook in hooks:
                hook(ctx)
            return
        first: BaseException | None = None
        for hook in reversed(hooks):
            try:
                hook(ctx)
            except BaseException as exc:
                first = first or exc
        if first is not None:
            raise first

    def _run_set(
        self, triggers: tuple[ev.EvalTrigger, ...], name: str, data: Iterable[Any]
    ) -> ev.EvaluationEnded:
        s, pub, st = self._s, self._port.publish, self._state
        trigger = triggers[0]
        model = s.model
        pub(
            ev.EvaluationStarted(
                step=st.step, epoch=st.epoch, trigger=trigger, dataset=name, triggers=triggers
            )
        )
        metrics: dict[str, float] = {}
        error: BaseException | None = None
        was_training = model.training
        model.eval()
        try:
            metrics = self._score(trigger, name, data)
        except BaseException as exc:
            error = exc
            exc.add_note(
                f"trainbus: raised in evaluation of {name!r} at step {st.step}, epoch {st.epoch}"
            )
            raise
        finally:
            model.train(was_training)
            ended = ev.EvaluationEnded(
                step=st.step,
                epoch=st.epoch,
                metrics=metrics,
                trigger=trigger,
                error=error,
                dataset=name,
                triggers=triggers,
            )
            pub(ended)
        return ended

    def _score(
        self, trigger: ev.EvalTrigger, dataset: str, data: Iterable[Any]
    ) -> dict[str, float]:
        s, pub, st, want = self._s, self._port.publish, self._state, self._wants
        hooks = self._hooks.by_point["eval_batch"]
        should_stop = self._should_stop
        total_loss = torch.zeros((), device=s.device, dtype=torch.float64)
        on_cpu = s.device.type == "cpu"
        sums = [torch.zeros((), device=s.device, dtype=torch.float64) for _ in s.metrics]
        totals = SetTotals(s.set_metrics, s.device) if s.set_metrics else None
        count = batches = 0
        with torch.no_grad():
            for bi, batch in enumerate(data):
                self._check_cancel()
                if should_stop():
                    break
                if want.eval_batch_started:
                    pub(
                        ev.EvalBatchStarted(
                            step=st.step, epoch=st.epoch, batch_index=bi, dataset=dataset
                        )
                    )
                n, error = -1, None  # n -1: an eval_batch hook skipped the batch
                loss: torch.Tensor | None = None
                try:
                    skipped, batch = hooked_batch(s, st, hooks, bi, batch, "eval", dataset, trigger)
                    if not skipped:
                        with want.trace("forward", "eval", bi, None, dataset), s.autocast():
                            outputs, targets = model_outputs(s, batch)
                            loss = loss_of(s, outputs, targets)
                        loss, n = loss.detach(), batch_size(batch)
                        self._add(sums, totals, outputs, batch, n)
                        count += n
                        batches += 1
                        total_loss += loss.double() * n
                except BaseException as exc:
                    error = exc
                    n = -1  # reported without samples
                    raise
                finally:
                    if want.eval_batch_ended:
                        # A copy off the CPU: a CUDA graph's next replay overwrites it
                        shown = (
                            math.nan if n < 0 or loss is None else loss if on_cpu else loss.clone()
                        )
                        pub(
                            ev.EvalBatchEnded(
                                step=st.step,
                                epoch=st.epoch,
                                batch_index=bi,
                                loss=shown,
                                samples=max(n, 0),
                                dataset=dataset,
                                error=error,
                            )
                        )
        if count == 0:
            if batches == 0 and should_stop():
                return {}  # stopped before the first batch: nothing to report
            raise TrainingError(
                f"eval_data {dataset!r} yielded no batch: evaluation needs at least one"
                if s.eval_named
                else "eval_data yielded no batch: evaluation needs at least one"
            )
        read = (torch.stack([total_loss, *sums]) / count).tolist()  # the one device read
        names = ("loss", *s.metrics)
        metrics = {
            metric_name(dataset, name, named=s.eval_named): v
            for name, v in zip(names, read, strict=True)
        }
        if self._reduce is not None:
            metrics = self._reduce(metrics, count)
        if totals is not None:
            metrics.update(self._set_metrics(dataset, totals))
        return metrics

    def _add(
        self, sums: list[torch.Tensor], totals: SetTotals | None, outputs: Any, batch: Any, n: int
    ) -> None:
        """Add one batch's metric values (sample-weighted) and set-metric sums."""
        s = self._s
        if s.metrics:
            target = metric_targets(batch)
            values = [
                _metric_value(name, fn(outputs, target), s.device) for name, fn in s.metrics.items()
            ]
            for i, value in enumerate(values):
                sums[i] += value.detach().double().mean() * n
        if totals is not None:  # a failure is counted, not raised
            totals.update(outputs, batch)

    def _set_metrics(self, dataset: str, totals: SetTotals) -> dict[str, float]:
        """The set metrics' values; one that raised is counted in ``failures``, left out."""
        s, step, fail = self._s, self._state.step, self.failures.failed
        read = totals.read()
        if self._sum_totals is not None:
            read = self._sum_totals(read)
        out: dict[str, float] = {}
        for name, metric in s.set_metrics.items():
            summed = read[name]
            if summed is None:
                error = totals.errors.get(name)
                fail(
                    name,
                    error,
                    dataset=dataset,
                    step=step,
                    stage="update" if error is not None else "another rank",
                )
                continue
            try:
                value = float(metric.compute(summed))
            except Exception as exc:  # the metric's failure, not the run's
                fail(name, exc, dataset=dataset, step=step, stage="compute")
                continue
            out[metric_name(dataset, name, named=s.eval_named)] = value
        return out


class StandaloneRun:
    """One ``evaluate()`` or ``predict()`` call; ``stop_reason``: the ``StopTraining`` reason
    that ended it early, else None."""

    def __init__(self, settings: Settings, port: LoopPort, hooks: Hooks, state: TrainState) -> None:
        self._s, self._port, self._hooks, self._state = settings, port, hooks, state
        self._wants = Wants(port, self._state, self._s.trace)
        self._cancel = CancelFlag(port.doorbell)
        self.stop_reason: str | None = None

    def request_cancel(self) -> None:
        """Stop at the next batch (the call was cancelled). Safe from any thread."""
        self._cancel.request()

    def should_stop(self) -> bool:
        """Wait for room in a full ``"block"`` buffer, raise a failure, apply the commands; True
        once a ``StopTraining`` arrived."""
        port, st = self._port, self._state
        if port.held and self.stop_reason is None:
            port.wait_for_room(lambda: self._cancel.requested)
        failure = port.failure
        if failure is not None:
            raise failure
        for command in port.poll_commands():
            error: ConfigError | None = None
            if isinstance(command, cmd.StopTraining):
                self.stop_reason = self.stop_reason or command.reason
            else:
                error = ConfigError.invalid(
                    "command",
                    type(command).__name__,
                    "StopTraining: the only command applied outside fit()",
                )
            port.publish(
                ev.CommandApplied(step=st.step, epoch=st.epoch, command=command, error=error)
            )
        return self.stop_reason is not None

    def evaluate(self, sets: Sequence[tuple[str, Iterable[Any]]]) -> dict[str, float]:
        """Score ``sets`` in one ``trigger="standalone"`` round; return the merged metrics."""
        use_device(self._s.device)  # the training thread's current CUDA device
        evaluator = Evaluator(
            self._s,
            self._port,
            self._state,
            self._wants,
            self._cancel.check,
            self._hooks,
            self.should_stop,
        )
        evaluator.run(("standalone",), sets)
        return evaluator.metrics

    def predict(
        self,
        data: Iterable[Any],
        *,
        keep: bool,
        pad: PadValues | None = None,
        ignore: frozenset[str] = frozenset(),
    ) -> list[Any]:
        """Run the model on every batch of ``data``; with ``keep``, return every batch's outputs
        without the ``ignore`` keys, on the host (else ``[]``)."""
        s, port, st, w = self._s, self._port, self._state, self._wants
        kept = KeptOutputs(pad or PadValues(), s.device) if keep else None
        use_device(s.device)  # the training thread's current CUDA device
        pub = port.publish
        w.refresh()
        try:
            total: int | None = len(data)  # type: ignore[arg-type]
        except TypeError:
            total = None
        pub(ev.PredictionStarted(step=st.step, epoch=st.epoch, batches=total))
        hooks = self._hooks.by_point["eval_batch"]
        on_cpu = s.device.type == "cpu"
        done = 0
        error: BaseException | None = None
        model = s.model
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                for bi, batch in enumerate(data):
                    self._cancel.check()
                    if self.should_stop():
                        break
                    w.refresh()
                    skipped, batch = hooked_batch(s, st, hooks, bi, batch, "predict")
                    if skipped:
                        continue
                    try:
                        with w.trace("forward", "predict", bi), s.autocast():
                            outputs = model_outputs(s, batch, targets=False)[0]
                            outputs = without_keys(
                                map_tensors(torch.Tensor.detach, outputs), ignore
                            )
                    except BaseException as exc:
                        exc.add_note(f"trainbus: raised in predict, batch {bi}")
                        raise
                    done += 1
                    if kept is not None:
                        kept.add(outputs, bi)
                    if w.prediction_batch_ended:
                        # A copy: a CUDA graph's next replay overwrites them (docs/compile.md).
                        if not on_cpu:
                            outputs = map_tensors(torch.Tensor.clone, outputs)
                        pub(
                            ev.PredictionBatchEnded(
                                step=st.step,
                                epoch=st.epoch,
                                batch_index=bi,
                                outputs=outputs,
                                samples=batch_size(batch),
                            )
                        )
                    del outputs  # hold no batch past its event
        except BaseException as exc:
            error = exc
            raise
        finally:
            model.train(was_training)
            pub(
                ev.PredictionEnded(
                    step=st.step,
                    epoch=st.epoch,
                    batches=done,
                    error=error,
                    stopped=self.stop_reason is not None,
                )
            )
        return [] if kept is None else kept.batches()
