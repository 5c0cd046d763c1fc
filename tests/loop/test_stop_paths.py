"""Every way a run ends, as docs/events.md ("Stop paths") describes it.

Each test records the whole run and checks which events fire, that every ``XStarted`` is
followed by its ``XEnded`` (``events.SPANS``, properly nested), and that ``FitEnded`` is the last
event and appears once.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch
import torch.nn.functional as F

from trainbus import Trainer
from trainbus import commands as cmd
from trainbus import events as ev
from trainbus.testing import EventRecorder, tiny_loader, tiny_model

_ENDS = {end: start for start, end in ev.SPANS.items()}


def assert_well_formed(items: Sequence[Any]) -> ev.FitEnded:
    """Spans paired and nested, one FitEnded, last; returns it."""
    assert items, "nothing was recorded"
    fit_ended = [e for e in items if isinstance(e, ev.FitEnded)]
    assert len(fit_ended) == 1, f"{len(fit_ended)} FitEnded"
    assert items[-1] is fit_ended[0], (
        f"FitEnded is not last: {[type(e).__name__ for e in items[-3:]]}"
    )
    assert isinstance(items[0], ev.TrainerBuilt)
    assert isinstance(items[1], ev.FitStarted | ev.CheckpointLoading)
    stack: list[ev.BaseEvent] = []
    for i, e in enumerate(items):
        t = type(e)
        if t in ev.SPANS:
            stack.append(e)
        elif t in _ENDS:
            opened = [type(s).__name__ for s in stack]
            assert stack and type(stack[-1]) is _ENDS[t], f"{t.__name__} (#{i}) closes {opened}"
            start = stack.pop()
            for name in ("phase", "batch_index", "micro_batch"):
                if hasattr(start, name):
                    assert getattr(start, name) == getattr(e, name), (start, e)
    assert not stack, f"spans never ended: {[type(s).__name__ for s in stack]}"
    return fit_ended[0]


def names(items: Sequence[Any]) -> list[str]:
    return [type(e).__name__ for e in items]


class FailingModel(torch.nn.Module):
    """The tiny MLP; its ``fail_at``-th training forward (0-based) raises ``error``."""

    def __init__(self, fail_at: int | None = None, *, error: BaseException | None = None,
                 in_eval: bool = False, delay: float = 0.0) -> None:  # fmt: skip
        super().__init__()
        self.net = tiny_model()
        self.fail_at, self.error, self.in_eval, self.delay = fail_at, error, in_eval, delay
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.delay:
            time.sleep(self.delay)
        if self.training != self.in_eval:
            if self.calls == self.fail_at:
                assert self.error is not None
                raise self.error
            self.calls += 1
        return self.net(x)


def make_trainer(
    model: torch.nn.Module | None = None, *, batches: int = 3, **overrides: Any
) -> Trainer:
    model = model if model is not None else tiny_model()
    kwargs: dict[str, Any] = dict(
        loss_fn=F.cross_entropy,
        eval_data=tiny_loader(2, seed=1),
        max_epochs=2,
        log_every=1,
        device="cpu",
        handle_signals=False,
    )
    kwargs.update(overrides)
    return Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(batches), **kwargs
    )


# ====================================================================== completed
def test_completed(tmp_path: Path) -> None:
    trainer = make_trainer(checkpoint_dir=tmp_path)
    recorder = EventRecorder(trainer.bus)
    result = trainer.fit_sync()
    end = assert_well_formed(recorder.items)
    assert (end.reason, end.error, end.stop_reason) == ("completed", None, None)
    assert (result.reason, result.stop_reason, result.error) == ("completed", None, None)
    assert (result.steps, result.epochs) == (6, 2) == (end.step, end.epoch)
    assert names(recorder.items)[-6:] == [
        "EvaluationEnded",
        "EvaluationRoundEnded",
        "EpochEnded",
        "CheckpointSaving",
        "CheckpointSaved",
        "FitEnded",
    ]
    assert recorder.of_type(ev.CheckpointSaved)[-1].tag == "final"
    assert [e.epoch for e in recorder.of_type(ev.EpochEnded)] == [0, 1]
    assert not recorder.of_type(ev.CommandApplied)


# ====================================================================== StopTraining
@pytest.mark.asyncio
async def test_stop_training_from_an_async_subscriber() -> None:
    trainer = make_trainer(batches=10, max_epochs=20, eval_data=None)
    bus = trainer.bus
    recorder = EventRecorder(bus)

    async def decide(e: ev.StepEnded) -> None:
        await anyio.lowlevel.checkpoint()
        if e.step == 3:
            bus.send(cmd.StopTraining(reason="enough"))

    bus.subscribe_async(bus.stream(ev.StepEnded), decide)
    result = await trainer.fit()

    end = assert_well_formed(recorder.items)
    assert (end.reason, end.stop_reason, end.error) == ("stopped", "enough", None)
    assert (result.reason, result.stop_reason) == ("stopped", "enough")
    (ack,) = recorder.of_type(ev.CommandApplied)
    assert ack.command == cmd.StopTraining(reason="enough") and ack.error is None
    # Applied at a poll point after step 3 (when it arrived is up to the bus): the run ends at
    # the step where it was applied, with no step after it.
    steps = [e.step for e in recorder.of_type(ev.StepEnded)]
    assert 3 <= ack.step == steps[-1] == end.step == result.steps < 200
    after = names(recorder.items[recorder.items.index(ack) + 1 :])
    assert "StepEnded" not in after and "EpochStarted" not in after and after[-1] == "FitEnded"
    last_epoch_end = recorder.of_type(ev.EpochEnded)[-1]
    assert last_epoch_end.step == end.step and last_epoch_end.error is None


@pytest.mark.asyncio
async def test_stop_training_at_an_evaluation_barrier_is_deterministic() -> None:
    transcripts = []
    for _ in range(3):
        trainer = make_trainer(batches=10, eval_every=2)
        bus = trainer.bus
        recorder = EventRecorder(bus)

        async def decide(e: ev.EvaluationEnded, bus: Any = bus) -> None:
            await anyio.sleep(0.05)  # slower than many steps: only the barrier makes it exact
            if e.step == 4:
                bus.send(cmd.StopTraining(reason="plateau"))

        bus.subscribe_async(bus.stream(ev.EvaluationEnded), decide, decides=True)
        result = await trainer.fit()

        end = assert_well_formed(recorder.items)
        assert (result.reason, result.stop_reason, result.steps) == ("stopped", "plateau", 4)
        assert (end.step, end.epoch) == (4, 0)
        assert max(e.step for e in recorder.of_type(ev.StepEnded)) == 4
        assert names(recorder.items)[-5:] == [
            "EvaluationEnded",
            "EvaluationRoundEnded",
            "CommandApplied",
            "EpochEnded",
            "FitEnded",
        ]
        assert recorder.items[-5].step == 4 and recorder.items[-5].trigger == "steps"
        transcripts.append([(type(e).__name__, e.step, e.epoch) for e in recorder.items])
    assert transcripts[0] == transcripts[1] == transcripts[2]


# ====================================================================== StopEpoch
def test_stop_epoch_ends_the_epoch_and_the_next_one_runs() -> None:
    trainer = make_trainer(batches=5, eval_every=2)
    bus = trainer.bus
    recorder = EventRecorder(bus)

    def decide(e: ev.EvaluationEnded) -> None:  # a barrier event: applied right after it
        if (e.epoch, e.step, e.trigger) == (0, 2, "steps"):
            bus.send(cmd.StopEpoch())

    bus.subscribe(bus.stream(ev.EvaluationEnded), decide)
    result = trainer.fit_sync()

    end = assert_well_formed(recorder.items)
    assert (end.reason, result.reason, result.steps, result.epochs) == ("completed",) * 2 + (7, 2)
    assert [(e.epoch, e.step, e.batches) for e in recorder.of_type(ev.EpochEnded)] == [
        (0, 2, 2),
        (1, 7, 5),
    ]
    assert [e.step for e in recorder.of_type(ev.StepEnded) if e.epoch == 1] == [3, 4, 5, 6, 7]
    (ack,) = recorder.of_type(ev.CommandApplied)
    assert (ack.command, ack.step, ack.epoch) == (cmd.StopEpoch(), 2, 0)
    i = recorder.items.index(ack)
    # The epoch ends at step 2, evaluated already (the StopEpoch came from that evaluation):
    # no second evaluation of the same weights, EpochEnded, then the next epoch.
    assert names(recorder.items[i + 1 : i + 3]) == ["EpochEnded", "EpochStarted"]
    assert [e.step for e in recorder.of_type(ev.EvaluationEnded) if e.step == 2] == [2]


# ====================================================================== exception in the model
def test_exception_in_forward_fails_the_run(tmp_path: Path) -> None:
    boom = ValueError("boom")
    model = FailingModel(fail_at=4, error=boom)  # 5th training forward: epoch 1, batch 1, step 4
    trainer = make_trainer(model, checkpoint_dir=tmp_path)
    recorder = EventRecorder(trainer.bus)
    with pytest.raises(ValueError) as caught:
        trainer.fit_sync()

    assert caught.value is boom
    assert "trainbus: raised in forward at step 4, epoch 1, batch 1" in caught.value.__notes__
    end = assert_well_formed(recorder.items)
    assert (end.reason, end.error, end.step, end.epoch) == ("failed", boom, 4, 1)
    assert names(recorder.items)[-6:] == [
        "BatchFetched", "StepBegan", "ForwardStarted", "ForwardEnded", "EpochEnded", "FitEnded",
    ]  # fmt: skip
    fwd = recorder.items[-3]
    assert (fwd.phase, fwd.batch_index, fwd.error) == ("train", 1, boom)
    assert [e for e in recorder.of_type(ev.ForwardEnded) if e.error is not None] == [fwd]
    epoch_end = recorder.items[-2]
    assert (epoch_end.epoch, epoch_end.batches, epoch_end.error) == (1, 2, boom)
    # A failed run writes no final checkpoint; the result is kept.
    assert not recorder.of_type(ev.CheckpointSaved) and not list(tmp_path.iterdir())
    assert trainer.result is not None and trainer.result.reason == "failed"
    assert trainer.result.error is boom


def test_exception_in_eval_forward_pairs_the_spans() -> None:
    boom = ValueError("eval boom")
    trainer = make_trainer(FailingModel(fail_at=1, error=boom, in_eval=True))
    recorder = EventRecorder(trainer.bus)
    with pytest.raises(ValueError):
        trainer.fit_sync()
    (evaluation_end,) = recorder.of_type(ev.EvaluationEnded)
    assert evaluation_end.error is boom
    assert_well_formed(recorder.items)


def test_exception_in_after_optimizer_step_hook_pairs_the_spans() -> None:
    trainer = make_trainer()
    recorder = EventRecorder(trainer.bus)

    def hook(ctx: Any) -> None:
        if ctx.step == 2:
            raise RuntimeError("hook")

    trainer.add_hook("after_optimizer_step", hook)
    with pytest.raises(RuntimeError):
        trainer.fit_sync()
    assert_well_formed(recorder.items)


# ====================================================================== cancellation
def cancelling_trainer() -> tuple[Trainer, EventRecorder]:
    """A slow model (5 ms a forward) that would train for minutes; no evaluation barrier."""
    trainer = make_trainer(FailingModel(delay=0.005), batches=200, max_epochs=100, eval_data=None)
    return trainer, EventRecorder(trainer.bus)


def check_cancelled(trainer: Trainer, seen: Sequence[Any]) -> None:
    end = assert_well_formed(seen)
    assert (end.reason, end.error, end.stop_reason) == ("cancelled", None, None)
    assert trainer.result is not None and trainer.result.reason == "cancelled"
    assert trainer.result.steps == end.step


@pytest.mark.asyncio
async def test_cancel_from_a_subscriber_delivers_fit_ended() -> None:
    trainer, recorder = cancelling_trainer()
    seen: list[Any] = []
    with anyio.CancelScope() as scope:
        trainer.bus.subscribe(trainer.bus.stream(ev.StepEnded),
                              lambda e: scope.cancel() if e.step == 2 else None)  # fmt: skip
        try:
            await trainer.fit()
        finally:
            seen = list(recorder.items)  # what subscribers had received when fit() exited
    check_cancelled(trainer, seen)
    assert seen[-1].step >= 2
    assert recorder.items == seen  # nothing after fit() exited
    (epoch_end,) = recorder.of_type(ev.EpochEnded)
    assert epoch_end.error is not None


@pytest.mark.asyncio
async def test_cancel_by_timeout_delivers_fit_ended() -> None:
    trainer, recorder = cancelling_trainer()
    seen: list[Any] = []
    with anyio.move_on_after(0.5):
        try:
            await trainer.fit()
        finally:
            seen = list(recorder.items)
    check_cancelled(trainer, seen)


async def cancel_and_check_propagation() -> tuple[bool, bool]:
    trainer, recorder = cancelling_trainer()
    returned = False
    with anyio.CancelScope() as scope:
        trainer.bus.subscribe(trainer.bus.stream(ev.StepEnded),
                              lambda e: scope.cancel() if e.step == 2 else None)  # fmt: skip
        await trainer.fit()
        returned = True
    check_cancelled(trainer, recorder.items)
    return returned, scope.cancelled_caught


@pytest.mark.asyncio
async def test_cancellation_propagates_out_of_fit_asyncio() -> None:
    returned, caught = await cancel_and_check_propagation()
    assert not returned and caught


def test_cancellation_propagates_out_of_fit_trio() -> None:
    returned, caught = anyio.run(cancel_and_check_propagation, backend="trio")
    assert not returned and caught


@pytest.mark.asyncio
async def test_cancel_while_waiting_at_a_barrier_reports_cancelled() -> None:
    trainer = make_trainer(max_epochs=50)
    bus = trainer.bus
    recorder = EventRecorder(bus)

    async def slow(e: ev.EvaluationEnded) -> None:
        await anyio.sleep(0.5)

    bus.subscribe_async(bus.stream(ev.EvaluationEnded), slow, decides=True)  # the loop waits
    with anyio.CancelScope() as scope:
        bus.subscribe(bus.stream(ev.EvaluationEnded), lambda e: scope.cancel())
        try:
            await trainer.fit()
        except BaseException:
            pass  # the outcome is checked below
    end = assert_well_formed(recorder.items)
    assert end.reason == "cancelled", end


# ====================================================================== failing subscriber
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_subscriber_with_on_error_raise_fails_the_run(kind: str) -> None:
    trainer = make_trainer()
    bus = trainer.bus
    recorder = EventRecorder(bus)
    oops = KeyError("oops")

    def bad(e: ev.StepEnded) -> None:
        if e.step == 2:
            raise oops

    async def bad_async(e: ev.StepEnded) -> None:
        bad(e)

    if kind == "sync":
        bus.subscribe(bus.stream(ev.StepEnded), bad, on_error="raise", name="bad")
    else:
        bus.subscribe_async(bus.stream(ev.StepEnded), bad_async, on_error="raise", name="bad")
    # The user's exception comes out as itself (``except KeyError`` matches), with a note
    # naming the subscription and the event it handled.
    with pytest.raises(KeyError) as caught:
        trainer.fit_sync()

    assert caught.value is oops
    (note,) = [n for n in caught.value.__notes__ if n.startswith("trainbus:")]
    assert "subscriber 'bad'" in note and "StepEnded (step 2" in note
    end = assert_well_formed(recorder.items)
    assert end.reason == "failed" and end.error is caught.value
    # Raised at the first poll point after the failure: at the latest after the evaluation
    # barrier that ends epoch 0 (step 3).
    assert end.epoch == 0 and 2 <= end.step <= 3
    (epoch_end,) = recorder.of_type(ev.EpochEnded)
    assert epoch_end.error is caught.value
    assert trainer.result is not None and trainer.result.reason == "failed"
    assert trainer.result.subscriber_failures == {"bad": 1}


# ====================================================================== max_steps mid-epoch
def test_max_steps_mid_epoch_resumes_where_it_stopped(tmp_path: Path) -> None:
    first = make_trainer(batches=5, max_steps=2, max_epochs=None, eval_data=None,
                         checkpoint_dir=tmp_path)  # fmt: skip
    recorder = EventRecorder(first.bus)
    first.fit_sync()
    assert_well_formed(recorder.items)
    second = make_trainer(batches=5, max_steps=4, max_epochs=None, eval_data=None,
                          checkpoint_dir=tmp_path)  # fmt: skip
    recorder = EventRecorder(second.bus)
    second.fit_sync(resume="latest")
    fetched = [(e.epoch, e.batch_index) for e in recorder.of_type(ev.BatchFetched)]
    assert fetched == [(0, 2), (0, 3)]
