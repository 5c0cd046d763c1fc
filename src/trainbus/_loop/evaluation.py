"""The evaluation pass: every evaluation set scored with the forward of ``forward.py``."""

from __future__ import annotations

import math
import reprlib
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import torch

from .. import events as ev
from .._exceptions import ConfigError, TrainingError
from .._hookpoints import HookPoint, StepContext
from .._tensors import batch_size, move_to_device
from ..checkpoint._rng import isolated_rng
from .forward import forward_loss, metric_targets
from .set_metrics import MetricFailures, SetTotals, Totals

if TYPE_CHECKING:
    from .._bus import LoopPort
    from ..checkpoint import TrainState
    from .hooks import Hooks
    from .settings import Settings
    from .wants import Wants

__all__ = ["EvalTrigger", "Evaluator", "evaluation_metric_names", "metric_name"]

EvalTrigger: TypeAlias = ev.EvalTrigger
"""Why an evaluation runs (``EvaluationStarted.trigger``)."""


def _metric_value(name: str, value: Any, device: torch.device) -> torch.Tensor:
    """What metric function ``name`` returned, as a tensor on ``device``; ``ConfigError`` for
    a value that is not a number or a tensor."""
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
    """The key of metric ``name`` of evaluation set ``dataset``: ``val_<name>`` for a single
    ``eval_data`` loader, ``<set>/<name>`` for named sets."""
    return f"{dataset}/{name}" if named else f"val_{name}"


def evaluation_metric_names(s: Settings) -> frozenset[str]:
    """Every key an evaluation of this run can put in ``EvaluationEnded.metrics``."""
    names = ("loss", *s.metrics, *s.set_metrics)
    named = s.eval_named
    sets = [dataset for dataset, _ in s.eval_sets]
    return frozenset(metric_name(dataset, n, named=named) for dataset in sets for n in names)


class Evaluator:
    """Scores the evaluation sets and publishes the evaluation round and its spans.

    Sums stay on the device during the pass and are read once per set (one sync). Metric
    functions (docs/trainer.md, "Metric functions") are averaged over samples; ``set_metrics``
    sum over the set (:class:`~trainbus._loop.set_metrics.SetTotals`), and one that raises is
    counted in :attr:`failures` and left out. A round never moves the training's random
    generators (``isolated_rng``); a completed round of a run marks its step evaluated in the
    train state.

    Attributes:
        metrics: The merged metrics of the last round (empty before the first; the loop of a
            resumed run sets the checkpoint's).
        last_round: The last published ``EvaluationRoundEnded`` (None before the first).
        failures: The set metrics that raised, counted per name over the evaluator's life.
        last_ends: The last round's ``EvaluationEnded`` of each set (empty before the first).

    Args:
        check_cancel: Called before each batch; raises when the run was cancelled.
        should_stop: Called before each batch; True ends the set's pass early (standalone
            evaluation, on ``StopTraining``) and the round after it. None: never.
        reduce: Under torchrun, ``reduce(metrics, samples)`` averages the ranks' metrics
            (sample-weighted); None: one process.
        sum_totals: Under torchrun, ``sum_totals(totals)`` adds every rank's set-metric totals;
            None: one process.
    """

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
        self._hooks, self._should_stop = hooks, should_stop
        self._reduce, self._sum_totals = reduce, sum_totals
        self.failures = MetricFailures()
        self.metrics: dict[str, float] = {}
        self.last_round: ev.EvaluationRoundEnded | None = None
        self.last_ends: tuple[ev.EvaluationEnded, ...] = ()

    def run(
        self,
        trigger: ev.EvalTrigger,
        sets: Sequence[tuple[str, Iterable[Any]]] | None = None,
        *,
        triggers: tuple[ev.EvalTrigger, ...] = (),
    ) -> tuple[ev.EvaluationEnded, ...]:
        """One evaluation round: ``EvaluationRoundStarted``, the ``"before_evaluation"`` hooks,
        each set's span, the ``"after_evaluation"`` hooks (also when the round raised), the
        round's end. Every ``XEnded`` is published even when the pass raises (with the error);
        the sets after a failed one are not scored.

        ``sets``: ``(name, data)`` pairs, default the settings' evaluation sets; ``triggers``:
        every cadence the round stands for, ``trigger`` first (default ``(trigger,)``). Returns
        the published ``EvaluationEnded`` of each set; ``TrainingError`` for a set that yielded
        no batch.
        """
        s, pub, st = self._s, self._port.publish, self._state
        sets = s.eval_sets if sets is None else tuple(sets)
        triggers = triggers or (trigger,)
        self._wants.refresh()
        pub(ev.EvaluationRoundStarted(step=st.step, epoch=st.epoch, trigger=trigger,
                                      datasets=tuple(n for n, _ in sets),
                                      triggers=triggers))  # fmt: skip
        ends: list[ev.EvaluationEnded] = []
        merged: dict[str, float] = {}
        error: BaseException | None = None
        try:
            with isolated_rng(s.device):
                try:
                    self._round_hooks("before_evaluation", trigger, None)
                    for name, data in sets:
                        ended = self._run_set(trigger, triggers, name, data)
                        ends.append(ended)
                        merged.update(ended.metrics)
                        if self._should_stop is not None and self._should_stop():
                            break
                except BaseException as exc:
                    self._round_hooks("after_evaluation", trigger, exc)
                    raise
                self._round_hooks("after_evaluation", trigger, None)
        except BaseException as exc:
            error = exc
            raise
        finally:
            done = ev.EvaluationRoundEnded(step=st.step, epoch=st.epoch, metrics=merged,
                                           trigger=trigger, error=error,
                                           triggers=triggers)  # fmt: skip
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
        """Run the round's ``point`` hooks with one shared context. ``"after_evaluation"``
        unwinds like nested context managers: in reverse order, every one even when one raises;
        the first exception is raised after the last hook."""
        hooks = self._hooks.by_point[point]
        if not hooks:
            return
        s, st = self._s, self._state
        ctx = StepContext(step=st.step, epoch=st.epoch, batch_index=0, micro_batch=0,
                          batch=None, model=s.model, optimizer=s.optimizer, phase="eval",
                          trigger=trigger, error=error)  # fmt: skip
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
        self,
        trigger: ev.EvalTrigger,
        triggers: tuple[ev.EvalTrigger, ...],
        name: str,
        data: Iterable[Any],
    ) -> ev.EvaluationEnded:
        s, pub, st = self._s, self._port.publish, self._state
        model = s.model
        pub(ev.EvaluationStarted(step=st.step, epoch=st.epoch, trigger=trigger, dataset=name,
                                 triggers=triggers))  # fmt: skip
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
            ended = ev.EvaluationEnded(step=st.step, epoch=st.epoch, metrics=metrics,
                                       trigger=trigger, error=error, dataset=name,
                                       triggers=triggers)  # fmt: skip
            pub(ended)
        return ended

    def _score(
        self, trigger: ev.EvalTrigger, dataset: str, data: Iterable[Any]
    ) -> dict[str, float]:
        s, pub, st, want = self._s, self._port.publish, self._state, self._wants
        names = list(s.metrics)
        hooks = self._hooks.by_point["eval_batch"]
        should_stop = self._should_stop
        total_loss = torch.zeros((), device=s.device, dtype=torch.float64)
        on_cpu = s.device.type == "cpu"
        sums = [torch.zeros((), device=s.device, dtype=torch.float64) for _ in names]
        totals = SetTotals(s.set_metrics, s.device) if s.set_metrics else None
        count = batches = 0
        with torch.no_grad():
            for bi, batch in enumerate(data):
                self._check_cancel()
                if should_stop is not None and should_stop():
                    break
                if want.eval_batch_started:
                    pub(ev.EvalBatchStarted(step=st.step, epoch=st.epoch, batch_index=bi,
                                            dataset=dataset))  # fmt: skip
                try:
                    n, loss, outputs, batch = self._batch(trigger, dataset, bi, batch, hooks)
                    if n >= 0 and names:
                        target = metric_targets(batch)
                        values = [_metric_value(name, s.metrics[name](outputs, target),
                                                s.device) for name in names]  # fmt: skip
                    if n >= 0 and totals is not None:  # a failure is counted, not raised
                        totals.update(outputs, batch)
                except BaseException as exc:
                    if want.eval_batch_ended:
                        pub(ev.EvalBatchEnded(step=st.step, epoch=st.epoch, batch_index=bi,
                                              loss=math.nan, samples=0, dataset=dataset,
                                              error=exc))  # fmt: skip
                    raise
                if n >= 0:  # else an eval_batch hook skipped it
                    count += n
                    batches += 1
                    total_loss += loss.double() * n
                    for i, value in enumerate(values if names else ()):
                        sums[i] += value.detach().double().mean() * n
                if want.eval_batch_ended:
                    # A copy off the CPU: a CUDA graph's next replay overwrites it (docs/compile.md)
                    shown = math.nan if n < 0 else loss if on_cpu else loss.clone()
                    pub(ev.EvalBatchEnded(step=st.step, epoch=st.epoch, batch_index=bi,
                                          loss=shown, samples=max(n, 0),
                                          dataset=dataset))  # fmt: skip
        if count == 0:
            if batches == 0 and should_stop is not None and should_stop():
                return {}  # stopped before the first batch: nothing to report
            raise TrainingError(
                f"eval_data {dataset!r} yielded no batch: evaluation needs at least one"
                if s.eval_named
                else "eval_data yielded no batch: evaluation needs at least one"
            )
        read = (torch.stack([total_loss, *sums]) / count).tolist()  # the one device read
        named = s.eval_named
        metrics = {metric_name(dataset, "loss", named=named): read[0]}
        metrics.update({metric_name(dataset, name, named=named): v
                        for name, v in zip(names, read[1:], strict=True)})  # fmt: skip
        if self._reduce is not None:
            metrics = self._reduce(metrics, count)
        if totals is not None:
            metrics.update(self._set_metrics(dataset, totals))
        return metrics

    def _set_metrics(self, dataset: str, totals: SetTotals) -> dict[str, float]:
        """The set metrics' values; one that raised is counted in :attr:`failures`, left out."""
        s, step, fail = self._s, self._state.step, self.failures.failed
        read = totals.read()
        if self._sum_totals is not None:
            read = self._sum_totals(read)
        out: dict[str, float] = {}
        for name, metric in s.set_metrics.items():
            summed = read[name]
            if summed is None:
                error = totals.errors.get(name)
                fail(name, error, dataset=dataset, step=step,
                     stage="update" if error is not None else "another rank")  # fmt: skip
                continue
            try:
                value = float(metric.compute(summed))
            except Exception as exc:  # the metric's failure, not the run's
                fail(name, exc, dataset=dataset, step=step, stage="compute")
                continue
            out[metric_name(dataset, name, named=s.eval_named)] = value
        return out

    def _batch(
        self, trigger: ev.EvalTrigger, dataset: str, bi: int, batch: Any, hooks: tuple[Any, ...]
    ) -> tuple[int, Any, Any, Any]:
        """Score one batch: ``(samples, detached loss, outputs, batch)``; samples -1 when an
        ``eval_batch`` hook skipped it."""
        s, st = self._s, self._state
        batch = move_to_device(batch, s.device)
        if hooks:
            ctx = StepContext(step=st.step, epoch=st.epoch, batch_index=bi,
                              micro_batch=0, batch=batch, model=s.model,
                              optimizer=s.optimizer, phase="eval",
                              dataset=dataset, trigger=trigger)  # fmt: skip
            for hook in hooks:
                hook(ctx)
            if ctx.skip:
                return -1, None, None, batch
            batch = move_to_device(ctx.batch, s.device)  # a hook may have replaced it
        with self._wants.trace("forward", "eval", bi, None, dataset), s.autocast():
            outputs, loss = forward_loss(s, batch)
        return batch_size(batch), loss.detach(), outputs, batch
