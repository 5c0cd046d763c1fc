"""One training thread per Trainer: every call (fit, evaluate, predict, their sync twins, a
resumed fit) runs its loop on the same thread, which ends with the Trainer's close or drop; what
the caller set on its own thread reaches it when torch keeps it in a contextvar (dynamo's
config), not when torch keeps it per thread (grad mode); a model compiled with
``torch.compile`` traces there; the loss handed on from an accelerator is a copy a CUDA graph's
next replay cannot overwrite (docs/compile.md)."""

from __future__ import annotations

import gc
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
import torch.nn.functional as F
from tests._fake_cuda import FakeCuda, HostModel, placed_batches

from trainbus import EvalSchedule, EventBus, TrainbusError, Trainer
from trainbus import commands as cmd
from trainbus import events as ev
from trainbus.testing import EventRecorder, tiny_loader, tiny_model


def make_trainer(tmp: Path, model: torch.nn.Module | None = None, **overrides: Any) -> Trainer:
    model = model if model is not None else tiny_model()
    kwargs: dict[str, Any] = dict(loss_fn=F.cross_entropy, max_steps=4, device="cpu",
                                  eval_data=tiny_loader(1, seed=1), checkpoint_dir=tmp,
                                  on_signal=None, progress=False,
                                  eval_schedule=EvalSchedule(epoch_end=False))  # fmt: skip
    kwargs.update(overrides)
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(4), **kwargs)


class Threads:
    """Which thread ran each call's steps and batches (inline hooks: on the training thread)."""

    def __init__(self, trainer: Trainer) -> None:
        self.seen: list[tuple[str, int]] = []
        trainer.add_hook("after_optimizer_step", lambda ctx: self._saw("fit"))
        trainer.add_hook("eval_batch", lambda ctx: self._saw(ctx.phase))

    def _saw(self, what: str) -> None:
        self.seen.append((what, threading.get_ident()))

    def one(self) -> int:
        """The one thread every hook ran on."""
        idents = {ident for _, ident in self.seen}
        assert len(idents) == 1, self.seen
        return idents.pop()


def stop_at(trainer: Trainer, step: int) -> None:
    """Stop the first fit at ``step`` (a resumed fit then goes on to ``max_steps``)."""
    stopped: list[int] = []

    def hook(ctx: Any) -> None:
        if ctx.step == step and not stopped:
            stopped.append(step)
            trainer.bus.send(cmd.StopTraining(reason="pause"))

    trainer.add_hook("after_optimizer_step", hook)


def alive(ident: int) -> bool:
    return any(t.ident == ident for t in threading.enumerate())


# ------------------------------------------------------------------ one thread, every call
def test_sync_twins_and_a_resumed_fit_run_on_one_thread_that_close_ends(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path)
    threads = Threads(trainer)
    stop_at(trainer, 2)
    trainer.evaluate_sync()
    assert trainer.fit_sync().steps == 2
    trainer.predict_sync(tiny_loader(2))
    assert trainer.fit_sync(resume="latest").steps == 4
    trainer.evaluate_sync()
    assert [what for what, _ in threads.seen] == (
        ["eval"] + ["fit"] * 2 + ["predict"] * 2 + ["fit"] * 2 + ["eval"]
    )
    ident = threads.one()
    assert ident != threading.get_ident()
    assert threading.current_thread() is threading.main_thread()
    assert alive(ident)  # between calls it idles, ready for the next call
    trainer.close()
    assert not alive(ident)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_async_calls_run_on_one_thread_that_aclose_ends(tmp_path: Path, backend: str) -> None:
    trainer = make_trainer(tmp_path)
    threads = Threads(trainer)
    stop_at(trainer, 2)

    async def main() -> None:
        await trainer.fit()
        await trainer.evaluate()
        await trainer.predict(tiny_loader(1))
        await trainer.fit(resume="latest")
        assert alive(threads.one())
        await trainer.aclose()

    anyio.run(main, backend=backend)
    assert [what for what, _ in threads.seen] == ["fit"] * 2 + ["eval", "predict"] + ["fit"] * 2
    assert not alive(threads.one())


def test_the_end_of_a_with_block_ends_the_thread(tmp_path: Path) -> None:
    with make_trainer(tmp_path) as trainer:
        threads = Threads(trainer)
        trainer.fit_sync()
        trainer.evaluate_sync()
        assert alive(threads.one())
    assert not alive(threads.one())


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_the_end_of_an_async_with_block_ends_the_thread(tmp_path: Path, backend: str) -> None:
    trainer = make_trainer(tmp_path)
    threads = Threads(trainer)

    async def main() -> None:
        async with trainer:
            await trainer.fit()
            await trainer.predict(tiny_loader(1))
            assert alive(threads.one())

    anyio.run(main, backend=backend)
    assert not alive(threads.one())


def test_a_dropped_trainer_ends_its_thread_without_gc(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path)
    threads = Threads(trainer)
    trainer.fit_sync()
    ident = threads.one()
    (thread,) = [t for t in threading.enumerate() if t.ident == ident]
    gc.collect()
    gc.disable()
    try:
        del trainer
        thread.join(timeout=30)
        assert not thread.is_alive()
    finally:
        gc.enable()


def test_close_while_a_call_runs_is_the_clear_error_and_the_thread_goes_on(
    tmp_path: Path,
) -> None:
    trainer = make_trainer(tmp_path)
    threads = Threads(trainer)
    errors: list[Exception] = []

    def close_now(e: ev.StepEnded) -> None:  # on the event loop, while fit() runs
        if not errors:
            try:
                trainer.close()
            except TrainbusError as exc:
                errors.append(exc)

    trainer.bus.stream(ev.StepEnded).subscribe(close_now)

    async def main() -> None:
        assert (await trainer.fit()).reason == "completed"
        await trainer.evaluate()  # the same thread, still there

    anyio.run(main)
    assert len(errors) == 1 and "close(): the bus runs in an event loop" in str(errors[0])
    ident = threads.one()
    trainer.close()
    assert not alive(ident)


# ------------------------------------------------------------------ what the caller set
def test_a_dynamo_setting_made_on_the_callers_thread_reaches_the_training_thread(
    tmp_path: Path,
) -> None:
    import torch._dynamo

    trainer = make_trainer(tmp_path)
    seen: list[tuple[int, bool]] = []

    def look(ctx: Any) -> None:  # on the training thread
        seen.append((torch._dynamo.config.cache_size_limit, torch._dynamo.config.suppress_errors))

    trainer.add_hook("after_optimizer_step", look)
    trainer.add_hook("eval_batch", look)
    default = torch._dynamo.config.cache_size_limit
    with torch._dynamo.config.patch(cache_size_limit=default + 3, suppress_errors=True):
        trainer.fit_sync()  # a sync twin: through the portal's event loop to the thread

        async def evaluate() -> None:
            await trainer.evaluate()

        anyio.run(evaluate, backend="trio")
    trainer.close()
    assert seen == [(default + 3, True)] * 5
    assert torch._dynamo.config.cache_size_limit == default  # the patch ended


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_no_async_library_runs_on_the_training_thread(tmp_path: Path, backend: str) -> None:
    """The caller's context is copied, not its event loop: on the thread, anyio and sniffio see
    no async library (as on anyio's worker threads)."""
    import sniffio

    trainer = make_trainer(tmp_path)
    seen: list[str | None] = []

    def look(ctx: Any) -> None:
        try:
            seen.append(sniffio.current_async_library())
        except sniffio.AsyncLibraryNotFoundError:
            seen.append(None)

    trainer.add_hook("after_optimizer_step", look)

    async def main() -> None:
        await trainer.fit()
        await trainer.aclose()

    anyio.run(main, backend=backend)
    assert seen == [None] * 4


def test_grad_mode_is_the_training_threads_own(tmp_path: Path) -> None:
    """Grad mode is per thread in torch and not carried: a fit() called under no_grad() or
    inference_mode() trains all the same (docs/compile.md, "Per-thread state")."""
    model = tiny_model()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = make_trainer(tmp_path, model=model)
    with torch.inference_mode():
        assert trainer.fit_sync().steps == 4
    trainer.close()
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


# ------------------------------------------------------------------ torch.compile
def test_a_compiled_model_traces_on_the_training_thread_over_every_call(tmp_path: Path) -> None:
    traces: list[int] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        traces.append(threading.get_ident())  # where dynamo traced this graph
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(tiny_model(), backend=backend)
    trainer = make_trainer(tmp_path, model=compiled)
    threads = Threads(trainer)
    stop_at(trainer, 2)
    assert trainer.fit_sync().steps == 2
    metrics = trainer.evaluate_sync()
    out = trainer.predict_sync(tiny_loader(2), return_outputs=True)
    assert trainer.fit_sync(resume="latest").steps == 4
    ident = threads.one()
    trainer.close()
    torch._dynamo.reset()
    # Traced for training and again for no_grad (evaluate, predict): all on the one thread.
    assert len(traces) >= 2 and set(traces) == {ident}
    assert metrics["val_loss"] > 0 and out.shape == (64, 10)


# ------------------------------------------------------------------ the loss handed on
def static_loss_step(static: torch.Tensor, values: list[float]) -> Any:
    """A custom step that returns its loss in a buffer it overwrites every step, as a CUDA
    graph's replay overwrites its output: what a subscriber or the window reads later must be
    a copy taken before the next step."""

    def step(ctx: Any) -> torch.Tensor:
        loss = F.mse_loss(ctx.model.lin(ctx.batch.x), ctx.batch.y)
        ctx.backward(loss)
        ctx.optimizer_step()
        values.append(loss.item())
        static.copy_(loss.detach())
        return static

    return step


def test_on_an_accelerator_the_loss_handed_on_is_a_copy_the_next_step_cannot_overwrite(
    fake_cuda: FakeCuda,
) -> None:
    static, values = torch.zeros(()), []
    model = HostModel()
    # on_nonfinite="ignore": no guard masking the step's loss into a fresh tensor of its own.
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), placed_batches(6),
                      device="cuda:0", max_steps=6, log_every=3, on_nonfinite="ignore",
                      progress=False, on_signal=None,
                      train_step=static_loss_step(static, values))  # fmt: skip
    recorder = EventRecorder(trainer.bus)
    trainer.fit_sync()
    trainer.close()
    published = [e.loss.item() for e in recorder.of_type(ev.StepEnded)]  # read after the run
    assert published == values and len(set(values)) == 6
    logged = [e.metrics["loss"] for e in recorder.of_type(ev.MetricsLogged)]
    assert logged == pytest.approx([sum(values[:3]) / 3, sum(values[3:]) / 3])


@pytest.mark.cuda
@pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::FutureWarning", "ignore:TensorFloat32 tensor cores"
)
def test_reduce_overhead_losses_survive_the_next_replay(tmp_path: Path) -> None:
    """torch.compile(mode="reduce-overhead") on a GPU: a model returning its loss returns it
    in a CUDA graph's output buffer; subscribers and the log window read copies."""

    class WithLoss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(),
                                           torch.nn.Linear(32, 3))  # fmt: skip

        def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self.net(x), y)

    torch.manual_seed(0)
    data = [(torch.randn(16, 8), torch.randint(0, 3, (16,))) for _ in range(8)]
    model = WithLoss().cuda()
    compiled = torch.compile(model, mode="reduce-overhead")
    trainer = Trainer(compiled, torch.optim.SGD(model.parameters(), lr=0.1), data,
                      device="cuda", max_steps=8, log_every=4, progress=False,
                      on_signal=None)  # fmt: skip
    values: list[float] = []
    trainer.add_hook("loss", lambda ctx: values.append(ctx.loss.item()))
    recorder = EventRecorder(trainer.bus)
    trainer.fit_sync()
    trainer.close()
    published = [e.loss.item() for e in recorder.of_type(ev.StepEnded)]  # read after the run
    assert published == pytest.approx(values) and len(set(published)) == 8
    logged = [e.metrics["loss"] for e in recorder.of_type(ev.MetricsLogged)]
    assert logged == pytest.approx([sum(values[:4]) / 4, sum(values[4:]) / 4], rel=1e-5)


# ------------------------------------------------------------------ cancelled with the caller
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_cancel_reaches_the_barrier_the_training_thread_waits_at(
    tmp_path: Path, backend: str
) -> None:
    """The loop waits at a barrier for a decider through the training thread: the caller's
    cancellation ends that wait at once (not after the hour-long barrier timeout) and the fit
    ends cancelled at the barrier's step, though the subscriber waited for runs on in the bus
    (``async with trainer`` holds it outside the cancelled scope). Only a decider holds the
    loop there: a plain async subscriber's cancel would land at whatever step the loop had
    reached when its task ran."""
    trainer = make_trainer(
        tmp_path,
        eval_schedule=EvalSchedule(every_steps=2),
        bus=EventBus(close_timeout=1, barrier_timeout=3600),
    )
    threads = Threads(trainer)

    async def main() -> bool:
        async with trainer:
            with anyio.CancelScope() as scope:

                async def hold(e: ev.EvaluationEnded) -> None:
                    scope.cancel()  # the caller gives up while the loop waits for this one
                    await anyio.sleep_forever()

                trainer.bus.subscribe_async(
                    trainer.bus.stream(ev.EvaluationEnded), hold, decides=True
                )
                await trainer.fit()
        return scope.cancelled_caught

    assert anyio.run(main, backend=backend)
    assert trainer.result is not None and trainer.result.reason == "cancelled"
    assert trainer.result.steps == 2
    assert not alive(threads.one())
