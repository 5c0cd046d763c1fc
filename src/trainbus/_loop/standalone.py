"""``trainer.evaluate()`` and ``trainer.predict()``: on the training thread like the loop, on the
same bus and hooks; between batches ``StopTraining`` ends the pass, any other command is
refused."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .. import commands as cmd
from .. import events as ev
from .._exceptions import ConfigError
from .._tensors import batch_size, use_device
from .evaluation import Evaluator, hooked_batch
from .forward import model_outputs
from .outputs import KeptOutputs, PadValues, map_tensors, without_keys
from .result import Cancelled
from .wants import Wants

if TYPE_CHECKING:
    from .._bus import LoopPort
    from ..checkpoint import TrainState
    from .hooks import Hooks
    from .settings import Settings

__all__ = ["StandaloneRun"]


class StandaloneRun:
    """One ``evaluate()`` or ``predict()`` call; ``state`` stamps the events (the trainer's
    last train state, or a fresh one). ``stop_reason``: the ``StopTraining`` reason that ended
    the pass early, else None."""

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
        """A poll point: wait while a ``"block"`` buffer is full, raise a ``raise`` subscriber's
        failure, apply the queued commands; True once a ``StopTraining`` arrived."""
        port, st = self._port, self._state
        if port.held and self.stop_reason is None:
            port.wait_for_room(lambda: self._cancel)
        failure = port.failure
        if failure is not None:
            raise failure
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
        """Score ``sets`` in one ``trigger="standalone"`` round; return the merged metrics."""
        use_device(self._s.device)  # the training thread's current CUDA device
        evaluator = Evaluator(self._s, self._port, self._state, self._wants, self._check_cancel,
                              self._hooks, self.should_stop)  # fmt: skip
        evaluator.run("standalone", sets)
        return evaluator.metrics

    def predict(self, data: Iterable[Any], *, keep: bool, pad: PadValues | None = None,
                ignore: frozenset[str] = frozenset()) -> list[Any]:  # fmt: skip
        """Run the model on every batch of ``data`` inside ``PredictionStarted/Ended``; with
        ``keep``, return every batch's outputs without the ``ignore`` keys, detached and on the
        host, each checked as it comes to be joinable with ``pad`` (else ``[]``)."""
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
                    self._check_cancel()
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
        return [] if kept is None else kept.batches()
