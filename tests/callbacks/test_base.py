"""Class-based callbacks: on_<event> subscribers (sync and async), hook_<point> inline hooks,
adding and removing, process-wide registration, and delivery order core -> user -> global."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from trainbus import Callback, ConfigError, StepContext, Trainer
from trainbus import events as ev
from trainbus.callbacks import global_callbacks, register_global_callback
from trainbus.testing import EventRecorder, tiny_loader, tiny_model


@pytest.fixture(autouse=True)
def _no_leftover_globals() -> Iterator[None]:
    """Process-wide registrations must not leak between tests."""
    assert global_callbacks() == ()
    yield
    leftover = global_callbacks()
    from trainbus.callbacks._base import GlobalCallbackHandle

    for cb in leftover:
        GlobalCallbackHandle(cb).remove()
    assert leftover == (), "a test left a global callback registered"


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.allclose(x, y, atol=1e-6) for x, y in zip(a, b, strict=True))


def _trainer(model: torch.nn.Module | None = None, **kwargs: Any) -> Trainer:
    model = model if model is not None else tiny_model()
    kwargs.setdefault("on_signal", None)
    kwargs.setdefault("device", "cpu")  # tests compare with CPU copies: same on a GPU host
    if "max_steps" not in kwargs and "max_epochs" not in kwargs:
        kwargs["max_steps"] = 3
    data = kwargs.pop("data", tiny_loader(3, 8))
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                   loss_fn=F.cross_entropy, **kwargs)  # fmt: skip


# ---------------------------------------------------------------------------- on_<event>


class Listener(Callback):
    def __init__(self) -> None:
        self.steps: list[int] = []
        self.epochs: list[int] = []
        self.fit_ended: list[str] = []
        self.all: list[str] = []

    def on_step_ended(self, event: ev.StepEnded) -> None:
        self.steps.append(event.step)

    async def on_epoch_ended(self, event: ev.EpochEnded) -> None:
        self.epochs.append(event.epoch)

    def on_fit_ended(self, event: ev.FitEnded) -> None:
        self.fit_ended.append(event.reason)


def test_sync_and_async_on_methods_become_subscribers() -> None:
    cb = Listener()
    trainer = _trainer(callbacks=[cb], max_epochs=2, data=tiny_loader(2, 8))
    kinds = {s.name: s.statistics().kind for s in trainer.bus.subscriptions}
    assert kinds["Listener.on_step_ended"] == "sync"
    assert kinds["Listener.on_epoch_ended"] == "async"
    result = trainer.fit_sync()
    assert result.reason == "completed"
    assert cb.steps == [1, 2, 3, 4]
    assert cb.epochs == [0, 1]
    assert cb.fit_ended == ["completed"]


def test_on_event_receives_every_event() -> None:
    class All(Callback):
        def __init__(self) -> None:
            self.names: list[str] = []

        def on_event(self, event: ev.BaseEvent) -> None:
            self.names.append(type(event).__name__)

    cb = All()
    trainer = _trainer(callbacks=[cb])
    rec = EventRecorder(trainer.bus)
    trainer.fit_sync()
    assert cb.names == rec.names() and cb.names[:2] == ["TrainerBuilt", "FitStarted"]


def test_callback_class_is_instantiated() -> None:
    trainer = _trainer(callbacks=[Listener])
    (cb,) = trainer.callbacks
    assert isinstance(cb, Listener)
    trainer.fit_sync()
    assert cb.steps == [1, 2, 3]  # type: ignore[attr-defined]


def test_setup_builds_pipelines_on_the_bus() -> None:
    class Piped(Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []

        def setup(self, bus: Any) -> None:
            bus.stream(ev.StepEnded).subscribe(lambda e: self.losses.append(float(e.loss)))

    cb = Piped()
    _trainer(callbacks=[cb]).fit_sync()
    assert len(cb.losses) == 3


def test_misspelt_on_method_lists_known_names() -> None:
    class Typo(Callback):
        def on_step_end(self, event: Any) -> None:
            pass

    with pytest.raises(ConfigError) as info:
        _trainer(callbacks=[Typo()])
    message = str(info.value)
    assert "on_step_end" in message
    assert "on_step_ended" in message and "on_fit_started" in message and "on_event" in message


def test_misspelt_hook_method_is_a_config_error() -> None:
    class Typo(Callback):
        def hook_los(self, ctx: Any) -> None:
            pass

    with pytest.raises(ConfigError, match="hook_loss"):
        _trainer(callbacks=[Typo()])
    with pytest.raises(ConfigError):
        register_global_callback(Typo())
    assert global_callbacks() == ()


# ---------------------------------------------------------------------------- hook_<point>


def test_hook_loss_scaling_by_zero_freezes_the_parameters() -> None:
    class Zero(Callback):
        def __init__(self) -> None:
            self.seen: list[float] = []

        def hook_loss(self, ctx: StepContext) -> None:
            assert ctx.loss is not None and ctx.outputs is not None
            self.seen.append(float(ctx.loss.detach()))
            ctx.loss = ctx.loss * 0.0

    model = tiny_model()
    before = _params(model)
    cb = Zero()
    trainer = _trainer(model, callbacks=[cb])
    rec = EventRecorder(trainer.bus)
    result = trainer.fit_sync()
    assert result.steps == 3 and len(cb.seen) == 3 and cb.seen[0] > 0
    assert _equal(_params(model), before)
    assert all(float(e.loss) == 0.0 for e in rec.of_type(ev.StepEnded))

    control = tiny_model()  # without the hook, the same run moves the parameters
    _trainer(control).fit_sync()
    assert not _equal(_params(control), before)


def test_hook_batch_skips_a_batch() -> None:
    class SkipSecond(Callback):
        def hook_batch(self, ctx: StepContext) -> None:
            if ctx.batch_index == 1:
                ctx.skip_batch()

    data = tiny_loader(3, 8)
    model = tiny_model()
    trainer = _trainer(model, callbacks=[SkipSecond()], max_epochs=1, data=data, trace=True)
    rec = EventRecorder(trainer.bus)
    result = trainer.fit_sync()
    assert result.steps == 2
    traced = rec.of_type(ev.SpanTraced)
    assert [e.batch_index for e in traced if e.span == "forward"] == [0, 2]
    assert [e.batch_index for e in traced if e.span == "data_wait"] == [0, 1, 2]

    ref = tiny_model()
    _trainer(ref, max_epochs=1, data=[data[0], data[2]]).fit_sync()
    assert _close(_params(model), _params(ref))


def test_hook_batch_may_replace_the_batch() -> None:
    data = tiny_loader(2, 8)

    class Replace(Callback):
        def hook_batch(self, ctx: StepContext) -> None:
            ctx.batch = data[1]

    model = tiny_model()
    _trainer(model, callbacks=[Replace()], max_steps=1, data=data).fit_sync()
    ref = tiny_model()
    _trainer(ref, max_steps=1, data=[data[1]]).fit_sync()
    assert _close(_params(model), _params(ref))


def test_hook_before_optimizer_step_zeroing_grads_freezes_parameters() -> None:
    class ZeroGrads(Callback):
        def hook_before_optimizer_step(self, ctx: StepContext) -> None:
            for p in ctx.model.parameters():
                assert p.grad is not None
                p.grad.zero_()

    model = tiny_model()
    before = _params(model)
    result = _trainer(model, callbacks=[ZeroGrads()]).fit_sync()
    assert result.steps == 3
    assert _equal(_params(model), before)


def test_hook_before_optimizer_step_skips_the_step() -> None:
    class Skip(Callback):
        def __init__(self) -> None:
            self.calls = 0

        def hook_before_optimizer_step(self, ctx: StepContext) -> None:
            self.calls += 1
            ctx.skip_batch()

    model = tiny_model()
    before = _params(model)
    cb = Skip()
    trainer = _trainer(model, callbacks=[cb], max_epochs=1, trace=True)
    rec = EventRecorder(trainer.bus)
    trainer.fit_sync()
    assert cb.calls == 3
    assert _equal(_params(model), before)
    assert not [e for e in rec.of_type(ev.SpanTraced) if e.span == "optimizer_step"]
    assert [e.span for e in rec.of_type(ev.SpanTraced)].count("zero_grad") == 3
    assert all(p.grad is None for p in model.parameters())  # gradients dropped


def test_hook_after_optimizer_step_sees_the_updated_model() -> None:
    class Ema(Callback):
        def __init__(self) -> None:
            self.steps: list[int] = []
            self.snapshots: list[list[torch.Tensor]] = []

        def hook_after_optimizer_step(self, ctx: StepContext) -> None:
            self.steps.append(ctx.step)
            self.snapshots.append(_params(ctx.model))

    model = tiny_model()
    cb = Ema()
    _trainer(model, callbacks=[cb]).fit_sync()
    assert cb.steps == [1, 2, 3]
    assert _equal(cb.snapshots[-1], _params(model))
    assert not _equal(cb.snapshots[0], cb.snapshots[1])


# ----------------------------------------------------------------------------- add / remove


def test_remove_callback_before_fit_receives_nothing() -> None:
    class Both(Listener):
        def __init__(self) -> None:
            super().__init__()
            self.hooked = 0

        def hook_loss(self, ctx: StepContext) -> None:
            self.hooked += 1

    cb = Both()
    trainer = _trainer()
    assert trainer.add_callback(cb) is cb
    assert trainer.callbacks == (cb,)
    with pytest.raises(ConfigError):
        trainer.add_callback(cb)  # already added
    trainer.remove_callback(cb)
    assert trainer.callbacks == ()
    with pytest.raises(ConfigError):
        trainer.remove_callback(cb)  # not added any more
    trainer.fit_sync()
    assert cb.steps == [] and cb.epochs == [] and cb.fit_ended == [] and cb.hooked == 0


def test_remove_callback_during_the_run_stops_delivery() -> None:
    """Removed at the end of epoch 0 (a barrier, so removal happens before epoch 1 starts)."""

    class Both(Callback):
        def __init__(self) -> None:
            self.events: list[tuple[str, int]] = []
            self.hooked: list[int] = []

        def on_step_ended(self, event: ev.StepEnded) -> None:
            self.events.append(("step", event.epoch))

        async def on_span_traced(self, event: ev.SpanTraced) -> None:
            if event.span == "data_wait":
                self.events.append(("batch", event.epoch))

        def hook_loss(self, ctx: StepContext) -> None:
            self.hooked.append(ctx.epoch)

    cb = Both()
    trainer = _trainer(callbacks=[cb], max_epochs=2, data=tiny_loader(2, 8), trace=True)
    removed: list[int] = []

    def remover(event: ev.EpochEnded) -> None:
        if not removed:
            removed.append(event.epoch)
            trainer.remove_callback(cb)

    trainer.bus.subscribe(trainer.bus.stream(ev.EpochEnded), remover)
    rec = EventRecorder(trainer.bus)
    trainer.fit_sync()
    assert removed == [0]
    assert len(rec.of_type(ev.StepEnded)) == 4
    assert sorted(cb.events) == [("batch", 0), ("batch", 0), ("step", 0), ("step", 0)]
    assert cb.hooked == [0, 0]
    assert trainer.callbacks == ()


# ---------------------------------------------------------------------------- global tier


def test_global_callback_with_context_manager() -> None:
    cb = Listener()
    with cb as entered:
        assert entered is cb
        assert global_callbacks() == (cb,)
        trainer = _trainer()
        trainer.fit_sync()
        assert trainer.callbacks == ()  # detached when the run ended
    assert global_callbacks() == ()
    assert cb.steps == [1, 2, 3] and cb.fit_ended == ["completed"]
    _trainer().fit_sync()  # after the with-block: not added any more
    assert cb.steps == [1, 2, 3]


def test_register_global_callback_and_remove() -> None:
    kept, removed = Listener(), Listener()
    handle_kept = register_global_callback(kept)
    handle_removed = register_global_callback(removed)
    handle_removed.remove()
    handle_removed.remove()  # idempotent
    try:
        _trainer().fit_sync()
        _trainer(max_steps=1).fit_sync()
    finally:
        handle_kept.remove()
    assert kept.steps == [1, 2, 3, 1]
    assert removed.steps == [] and removed.fit_ended == []
    with pytest.raises(ConfigError):
        register_global_callback(Listener)  # type: ignore[arg-type]  # a class, not an instance


def test_a_callback_both_user_and_global_is_added_once() -> None:
    cb = Listener()
    with cb:
        _trainer(callbacks=[cb]).fit_sync()
    assert cb.steps == [1, 2, 3]


# ---------------------------------------------------------------------------- delivery order


class Tagged(Callback):
    def __init__(self, name: str, log: list[tuple[str, Any]], hooks: list[tuple[str, Any]]) -> None:
        self.name, self.log, self.hooks = name, log, hooks

    def on_event(self, event: ev.BaseEvent) -> None:
        self.log.append((self.name, event))

    def hook_batch(self, ctx: StepContext) -> None:
        self.hooks.append((self.name, ("batch", ctx.step, ctx.batch_index)))

    def hook_loss(self, ctx: StepContext) -> None:
        self.hooks.append((self.name, ("loss", ctx.step, ctx.batch_index)))

    def hook_before_optimizer_step(self, ctx: StepContext) -> None:
        self.hooks.append((self.name, ("before", ctx.step)))

    def hook_after_optimizer_step(self, ctx: StepContext) -> None:
        self.hooks.append((self.name, ("after", ctx.step)))


def test_delivery_order_is_core_then_user_then_global() -> None:
    log: list[tuple[str, Any]] = []
    hooks: list[tuple[str, Any]] = []
    glob = Tagged("global", log, hooks)
    user = Tagged("user", log, hooks)
    user2 = Tagged("user2", log, hooks)
    core = Tagged("core", log, hooks)
    trainer = _trainer(callbacks=[user], eval_data=tiny_loader(1, 8), max_epochs=1, trace=True)
    trainer.add_callback(core, tier="core")  # added after the user one: still first
    trainer.add_callback(user2)  # user tier, after `user`
    with glob:
        trainer.fit_sync()

    order = ["core", "user", "user2", "global"]
    assert len(log) % 4 == 0 and len(log) >= 4 * 20
    for i in range(0, len(log), 4):
        group = log[i : i + 4]
        assert [name for name, _ in group] == order, group
        assert all(e is group[0][1] for _, e in group)  # the same event, one after the other
    assert type(log[0][1]) is ev.TrainerBuilt and type(log[-1][1]) is ev.FitEnded

    assert len(hooks) == 4 * (3 * 4)  # 3 steps x 4 hook points x 4 callbacks
    for i in range(0, len(hooks), 4):
        group = hooks[i : i + 4]
        assert [name for name, _ in group] == order, group
        assert len({point for _, point in group}) == 1


def test_skipped_optimizer_step_does_not_step_the_scheduler_or_repeat_step_ended() -> None:
    class SkipOnce(Callback):
        def __init__(self) -> None:
            self.skipped = False

        def hook_before_optimizer_step(self, ctx: StepContext) -> None:
            if ctx.step == 1 and not self.skipped:
                self.skipped = True
                ctx.skip_batch()

    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    trainer = Trainer(model, opt, tiny_loader(4, 8), loss_fn=F.cross_entropy, max_steps=3,
                      scheduler=sched, callbacks=[SkipOnce()], on_signal=None,
                      device="cpu")  # fmt: skip
    rec = EventRecorder(trainer.bus)
    result = trainer.fit_sync()
    assert result.steps == 3
    assert [e.step for e in rec.of_type(ev.StepEnded)] == [1, 2, 3]
    assert len(rec.of_type(ev.SchedulerStepped)) == 3  # one per optimizer step taken
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)


def test_state_key_is_the_class_name_until_set_and_checked_when_set() -> None:
    class Counter(Callback):
        def state_dict(self) -> dict[str, Any]:
            return {"n": 1}

    cb = Counter()
    assert cb.state_key == "Counter"  # the one name: what the state is saved under
    cb.state_key = "first"
    assert cb.state_key == "first"
    cb.state_key = None
    assert cb.state_key == "Counter"
    with pytest.raises(ConfigError, match=r"^state_key="):
        cb.state_key = ""


def test_a_method_for_a_removed_phase_event_names_its_replacement() -> None:
    class Old(Callback):
        def on_forward_started(self, event: Any) -> None:
            pass

    with pytest.raises(ConfigError, match=r"Old\.on_forward_started.*ForwardStarted was "
                       r"removed.*SpanTraced\(span=\"forward\"\)"):  # fmt: skip
        _trainer(callbacks=[Old()])


@pytest.mark.parametrize(
    ("attribute", "value", "field"),
    [
        ("decides", True, "decides"),
        ("overflow", "block", "overflow"),
        ("error_policy", "raise", "on_error"),
        ("on_error", "log", "on_error"),
        ("buffer", 8, "buffer"),
        ("concurrency", 2, "concurrency"),
    ],
)
def test_a_former_subscription_attribute_is_refused_naming_subscribe_options(
    attribute: str, value: object, field: str
) -> None:
    """Ignored, a former decider would stop holding its barrier and a former "block"
    subscriber would drop: the class is refused where it is written."""
    with pytest.raises(ConfigError, match=rf"SubscribeOptions\({field}="):
        type("Old", (Callback,), {attribute: value})
