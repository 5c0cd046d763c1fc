"""fit() is cancellable at any moment: a cancellation, or a SIGINT, at every await point of a
fit (start-up, training, the call's end) ends with a FitResult or the cancellation itself,
never a foreign RuntimeError about cancel scopes, and the next call in the same event loop
works. Deterministic: the k-th suspension of fit()'s coroutine triggers it, not a timer."""

from __future__ import annotations

import signal
from collections.abc import Callable, Coroutine, Generator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
import torch.nn.functional as F

from trainbus import FitResult, Trainer
from trainbus.testing import tiny_loader, tiny_model

BACKENDS = ["asyncio", "trio"]


class AtSuspension:
    """Await ``coro``, calling ``action()`` when it suspends for the ``k``-th time (each time
    it yields to the event loop: every await point that really waits). Counts them all."""

    def __init__(self, coro: Coroutine[Any, Any, Any], k: int | None,
                 action: Callable[[], None]) -> None:  # fmt: skip
        self.coro, self.k, self.action = coro, k, action
        self.count = 0

    def __await__(self) -> Generator[Any, Any, Any]:
        it = self.coro.__await__()
        send: Any = None
        error: BaseException | None = None
        while True:
            try:
                value = it.send(send) if error is None else it.throw(error)
            except StopIteration as stop:
                return stop.value
            send, error = None, None
            self.count += 1
            if self.count == self.k:
                self.action()
            try:
                send = yield value
            except BaseException as exc:  # the event loop's cancellation, delivered here
                error = exc


def make_trainer(tmp: Path, **overrides: Any) -> Trainer:
    model = tiny_model()
    kwargs: dict[str, Any] = dict(loss_fn=F.cross_entropy, max_steps=4, device="cpu",
                                  eval_data=tiny_loader(1, seed=1), handle_signals=False,
                                  progress=False, eval_every=2, checkpoint_dir=tmp)  # fmt: skip
    kwargs.update(overrides)
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(2), **kwargs)


async def next_calls_work(trainer: Trainer) -> None:
    """The next fit (resuming when the cancelled one trained) and an evaluate() run."""
    assert trainer.bus.state in ("new", "suspended")
    if trainer.result is None:  # the loop never ran: the Trainer is as before
        result = await trainer.fit()
    else:
        result = await trainer.fit(resume="latest")
    assert result.reason == "completed" and result.steps == 4
    metrics = await trainer.evaluate()
    assert "val_loss" in metrics


def count_suspensions(backend: str, tmp: Path) -> int:
    async def main() -> int:
        waiter = AtSuspension(make_trainer(tmp).fit(), None, lambda: None)
        result = await waiter
        assert result.reason == "completed"
        return waiter.count

    return anyio.run(main, backend=backend)


# One fit per await point (about 30-60 of them): minutes on a loaded 2-core machine.
@pytest.mark.timeout(360)
@pytest.mark.parametrize("backend", BACKENDS)
def test_cancel_at_every_await_point_of_fit(backend: str, tmp_path: Path) -> None:
    total = count_suspensions(backend, tmp_path / "count")
    assert total >= 5  # start-up, the thread, barriers' deliveries, the call's end
    outcomes: dict[str, int] = {}

    async def main() -> None:
        for k in range(1, total + 2):  # one past the end: cancelled after the last await
            trainer = make_trainer(tmp_path / str(k))
            with anyio.CancelScope() as scope:
                result = await AtSuspension(trainer.fit(), k, scope.cancel)
            if scope.cancelled_caught:
                outcomes["cancellation"] = outcomes.get("cancellation", 0) + 1
            else:
                # The cancel arrived once nothing could be cancelled: a clean result.
                assert isinstance(result, FitResult)
                assert result.reason in ("completed", "cancelled"), (k, result)
                outcomes[result.reason] = outcomes.get(result.reason, 0) + 1
            await next_calls_work(trainer)

    anyio.run(main, backend=backend)
    assert outcomes.get("cancellation", 0) >= total - 2, outcomes


@pytest.mark.timeout(360)
@pytest.mark.parametrize("backend", BACKENDS)
def test_sigint_at_every_await_point_of_fit(backend: str, tmp_path: Path) -> None:
    total = count_suspensions(backend, tmp_path / "count")
    reasons: dict[str, int] = {}

    async def main() -> None:
        for k in range(1, total + 1):
            # on_signal="return": the result, not the interrupt (tests/test_signals.py)
            trainer = make_trainer(tmp_path / str(k), handle_signals=True, on_signal="return")
            result = await AtSuspension(trainer.fit(), k,
                                        lambda: signal.raise_signal(signal.SIGINT))  # fmt: skip
            assert result.reason in ("stopped", "completed"), (k, result)
            reasons[result.reason] = reasons.get(result.reason, 0) + 1
            await next_calls_work(trainer)

    previous = signal.getsignal(signal.SIGINT)
    anyio.run(main, backend=backend)
    assert signal.getsignal(signal.SIGINT) is previous  # every fit restored the handler
    assert reasons.get("stopped", 0) >= 1, reasons


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_deadline_already_passed(backend: str, tmp_path: Path) -> None:
    async def main() -> None:
        trainer = make_trainer(tmp_path)
        with anyio.move_on_after(0) as scope:
            await trainer.fit()
        assert scope.cancelled_caught
        assert trainer.result is None and trainer.bus.state == "new"
        await next_calls_work(trainer)

    anyio.run(main, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("k", [1, 2, 3, 5, 8, 13])
def test_two_fits_in_one_task_group_cancelled_together(
    backend: str, k: int, tmp_path: Path
) -> None:
    async def main() -> None:
        trainers = [make_trainer(tmp_path / "a"), make_trainer(tmp_path / "b")]
        async with anyio.create_task_group() as tg:
            # The first fit's k-th suspension cancels both.
            tg.start_soon(_awaiting, AtSuspension(trainers[0].fit(), k, tg.cancel_scope.cancel))
            tg.start_soon(trainers[1].fit)
        for trainer in trainers:
            await next_calls_work(trainer)

    anyio.run(main, backend=backend)


async def _awaiting(waiter: AtSuspension) -> None:
    await waiter
