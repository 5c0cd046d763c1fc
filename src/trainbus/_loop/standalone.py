"""Evaluation and prediction outside ``fit()``: ``trainer.evaluate()`` and ``trainer.predict()``.

:class:`StandaloneRun` runs on the training thread like the loop, on the same bus and hooks, and
polls the command queue between batches: ``StopTraining`` ends the pass early, any other command
is refused. The event order is docs/events.md's ("Event order").
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .. import commands as cmd
from .. import events as ev
from .._exceptions import ConfigError
from .._hookpoints import StepContext
from .._tensors import batch_size, move_to_device, use_device
from .evaluation import Evaluator
from .forward import model_outputs
from .outputs import (
    HostOutputs,
    OutputsCheck,
    PadValues,
    detach_outputs,
    map_tensors,
    without_keys,
)
from .result import Cancelled
from .wants import Wants

if TYPE_CHECKING:
    from .._bus import LoopPort
    from ..checkpoint import TrainState
    from .hooks import Hooks
    from .settings import Settings

__all__ = ["StandaloneRun"]


class StandaloneRun:
    """One ``evaluate()`` or ``predict()`` call, on the training thread.

    Attributes:
        stop_reason: The ``StopTraining`` reason that ended the pass early, else None.

    Args:
        settings: The trainer's settings (model, device, precision, metrics, loss_fn).
        port: Where events go and commands come from (running).
        hooks: The trainer's inline hooks (``eval_batch``).
        state: Stamps the events (the trainer's last train state, or a fresh one).
    """

    def __init__(self, settings: Settings, port: LoopPort, hooks: Hooks, state: TrainState) -> None:
        self._s, self._port, self._hooks, self._state = settings, port, hooks, state
        self._wants = Wants(port, self._state, self._s.trace)
        self._cancel = False
        self.stop_reason: str | None = None

    def request_cancel(self) -> None:
        """Stop at the next batch (the call was cancelled). Safe from any thread."""
        self._cancel = True

    def _check_cancel(self) -> None:
        if self._cancel:
            raise Cancelled

    def should_stop(self) -> bool:
        """Wait while a ``"block"`` buffer is full, apply the queued commands; True once a
        ``StopTraining`` arrived.

        Raises:
            Exception: a subscriber with ``on_error="raise"`` failed (its own exception).
        """
        port, st = self._port, self._state
        if port.held and self.stop_reason is None:
            port.wait_for_room(lambda: self._cancel)
        failure = port.failure
        if failure is not None:
            raise failure
        if port.has_commands():
            for command in port.poll_commands():
                error: ConfigError | None = None
                if isinstance(command, cmd.StopTraining):
                    self.stop_reason = self.stop_reason or command.reason
                else:
                    error = ConfigError.invalid(
                        "command", type(command).__name__,
                        "StopTraining: the only command applied outside fit()",
                    )  # fmt: skip
                port.publish(ev.CommandApplied(step=st.step, epoch=st.epoch, command=command,
                                              error=error))  # fmt: skip
        return self.stop_reason is not None

    def evaluate(self, sets: Sequence[tuple[str, Iterable[Any]]]) -> dict[str, float]:
        """Score ``sets`` in one ``trigger="standalone"`` round; return the merged metrics.

        Raises:
            TrainingError: a set yielded no batch; or whatever the model raised.
        """
        use_device(self._s.device)  # the training thread's current CUDA device
        evaluator = Evaluator(self._s, self._port, self._state, self._wants, self._check_cancel,
                              self._hooks, self.should_stop)  # fmt: skip
        evaluator.run("standalone", sets)
        return evaluator.metrics

    def predict(self, data: Iterable[Any], *, keep: bool, pad: PadValues | None = None,
                ignore: frozenset[str] = frozenset()) -> list[Any]:  # fmt: skip
        """Run the model on every batch of ``data`` inside ``PredictionStarted/Ended``.

        Args:
            data: The batches (``(inputs, targets)`` with ``loss_fn``: ``inputs`` are used).
            keep: Keep every batch's outputs and return them (else ``[]``); each batch is
                checked as it comes to be joinable with the first (:class:`OutputsCheck`).
            pad: The pad values the outputs will be joined with (None: the defaults).
            ignore: Output keys dropped from every batch's outputs before they are kept or
                published (:func:`~trainbus._loop.outputs.ignored_keys`).

        Returns:
            The per-batch outputs, detached and on the host
            (:class:`~trainbus._loop.outputs.HostOutputs`), when ``keep``; else ``[]``.

        Raises:
            TrainingError: with ``keep``, a batch's outputs that cannot be joined to the first
                batch's (naming the key and both shapes), at that batch.
            ConfigError: with ``keep``, a pad value that cannot be used.
            Whatever the model or the data raised, after ``PredictionEnded`` carried it.
        """
        s, port, st, w = self._s, self._port, self._state, self._wants
        check = OutputsCheck(pad or PadValues()) if keep else None
        use_device(s.device)  # the training thread's current CUDA device
        pub = port.publish
        w.refresh()
        try:
            total: int | None = len(data)  # type: ignore[arg-type]
        except TypeError:
            total = None
        pub(ev.PredictionStarted(step=st.step, epoch=st.epoch, batches=total))
        hooks = self._hooks.by_point["eval_batch"]
        kept = HostOutputs(s.device)
        on_cpu = s.device.type == "cpu"
        done = 0
        error: BaseException | None = None
        model = s.model
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                for bi, batch in enumerate(data):
                    self._check_cancel()
                    if self.should_stop():
                        break
                    w.refresh()
                    batch = move_to_device(batch, s.device)
                    if hooks:
                        ctx = StepContext(step=st.step, epoch=st.epoch, batch_index=bi,
                                          micro_batch=0, batch=batch, model=model,
                                          optimizer=s.optimizer, phase="predict")  # fmt: skip
                        for hook in hooks:
                            hook(ctx)
                        if ctx.skip:
                            continue
                        batch = move_to_device(ctx.batch, s.device)  # a hook may replace it
                    try:
                        with w.trace("forward", "predict", bi), s.autocast():
                            outputs = without_keys(
                                detach_outputs(model_outputs(s, batch, targets=False)[0]), ignore
                            )
                    except BaseException as exc:
                        exc.add_note(f"trainbus: raised in predict, batch {bi}")
                        raise
                    done += 1
                    if check is not None:
                        check.add(outputs, bi)
                        kept.add(outputs)
                    if w.prediction_batch_ended:
                        # A copy: a CUDA graph's next replay overwrites them (docs/compile.md).
                        if not on_cpu:
                            outputs = map_tensors(torch.Tensor.clone, outputs)
                        pub(ev.PredictionBatchEnded(step=st.step, epoch=st.epoch, batch_index=bi,
                                                    outputs=outputs,
                                                    samples=batch_size(batch)))  # fmt: skip
                    del outputs  # hold no batch past its event
        except BaseException as exc:
            error = exc
            raise
        finally:
            model.train(was_training)
            pub(ev.PredictionEnded(step=st.step, epoch=st.epoch, batches=done, error=error,
                                   stopped=self.stop_reason is not None))  # fmt: skip
        return kept.batches()
