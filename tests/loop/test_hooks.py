"""The inline hook points added for ported callbacks: after_forward, after_backward, eval_batch,
and the evaluation round's before_evaluation / after_evaluation."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from trainbus import Callback, ConfigError, EvalSchedule, Trainer, TrainingError
from trainbus import commands as cmd
from trainbus import events as ev
from trainbus._hookpoints import HOOK_POINTS, StepContext
from trainbus.testing import EventRecorder, tiny_loader, tiny_model


def make_trainer(**overrides: Any) -> Trainer:
    model = tiny_model()
    kwargs: dict[str, Any] = dict(loss_fn=F.cross_entropy, max_epochs=1, device="cpu",
                                  on_signal=None, progress=False)  # fmt: skip
    kwargs.update(overrides)
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(4), **kwargs)


def test_after_forward_may_replace_the_outputs_the_loss_is_computed_from() -> None:
    trainer = make_trainer()
    seen: list[tuple[int, Any]] = []

    def zero_logits(ctx: StepContext) -> None:
        seen.append((ctx.batch_index, ctx.loss))
        ctx.outputs = torch.zeros_like(ctx.outputs, requires_grad=True) + 0 * ctx.outputs

    trainer.add_hook("after_forward", zero_logits)
    losses: list[float] = []
    trainer.add_hook("loss", lambda ctx: losses.append(float(ctx.loss.detach())))
    trainer.fit_sync()
    # Uniform logits over 10 classes: the cross-entropy is exactly ln(10), whatever the model.
    assert losses == pytest.approx([math.log(10)] * 4)
    assert seen == [(0, None), (1, None), (2, None), (3, None)]  # before the loss exists


def test_after_forward_may_skip_the_batch() -> None:
    trainer = make_trainer()
    trainer.add_hook(
        "after_forward", lambda ctx: ctx.skip_batch() if ctx.batch_index == 1 else None
    )
    losses: list[int] = []
    trainer.add_hook("loss", lambda ctx: losses.append(ctx.batch_index))
    backwards: list[int] = []
    trainer.add_hook("after_backward", lambda ctx: backwards.append(ctx.batch_index))
    result = trainer.fit_sync()
    assert losses == backwards == [0, 2, 3] and result.steps == 3


def test_after_backward_sees_each_micro_batchs_gradients_before_clipping() -> None:
    trainer = make_trainer(accumulate=2, clip_grad_norm=1e-6)
    norms: list[tuple[int, float]] = []

    def measure(ctx: StepContext) -> None:
        grads = [p.grad for p in ctx.model.parameters() if p.grad is not None]
        norms.append((ctx.micro_batch, float(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(g) for g in grads])))))  # fmt: skip
        assert ctx.loss is not None and ctx.loss.requires_grad

    trainer.add_hook("after_backward", measure)
    recorder = EventRecorder(trainer.bus)
    trainer.fit_sync()
    assert [m for m, _ in norms] == [0, 1, 0, 1]
    # The last micro-batch's gradients are the step's, before clipping: StepEnded reports the
    # same pre-clip norm, far above the clip threshold.
    pre_clip = [float(e.grad_norm) for e in recorder.of_type(ev.StepEnded)]
    assert pre_clip == pytest.approx([norms[1][1], norms[3][1]], rel=1e-5)
    assert min(pre_clip) > 1e-3


def test_eval_batch_may_replace_the_batch() -> None:
    fixed = tiny_loader(1, seed=7)[0]
    trainer = make_trainer(eval_data=tiny_loader(3, seed=1))
    phases: list[tuple[str, str | None]] = []

    def replace(ctx: StepContext) -> None:
        phases.append((ctx.phase, ctx.dataset))
        ctx.batch = fixed

    trainer.add_hook("eval_batch", replace)
    result = trainer.fit_sync()
    with torch.no_grad():
        expected = F.cross_entropy(trainer.settings.model(fixed[0]), fixed[1]).item()
    assert result.eval_metrics["val_loss"] == pytest.approx(expected, rel=1e-5)
    assert phases == [("eval", "val")] * 3


def test_eval_batch_may_skip_a_batch() -> None:
    trainer = make_trainer(eval_data=tiny_loader(3, seed=1), trace={"forward"})
    trainer.add_hook("eval_batch", lambda ctx: ctx.skip_batch() if ctx.batch_index == 0 else None)
    recorder = EventRecorder(trainer.bus)
    trainer.fit_sync()
    ended = recorder.of_type(ev.EvalBatchEnded)
    assert [(e.batch_index, e.samples) for e in ended] == [(0, 0), (1, 32), (2, 32)]
    assert math.isnan(float(ended[0].loss))
    forwards = [e.batch_index for e in recorder.of_type(ev.SpanTraced) if e.phase == "eval"]
    assert forwards == [1, 2]


def test_callback_methods_reach_the_new_points() -> None:
    calls: list[str] = []

    class Ported(Callback):
        def hook_after_forward(self, ctx: StepContext) -> None:
            calls.append("after_forward")

        def hook_after_backward(self, ctx: StepContext) -> None:
            calls.append("after_backward")

        def hook_eval_batch(self, ctx: StepContext) -> None:
            calls.append("eval_batch")

    trainer = make_trainer(eval_data=tiny_loader(1, seed=1), callbacks=[Ported()])
    trainer.fit_sync()
    assert calls == ["after_forward", "after_backward"] * 4 + ["eval_batch"]


def test_an_unknown_point_lists_the_valid_ones() -> None:
    with pytest.raises(ConfigError) as info:
        make_trainer().add_hook("after_step", lambda ctx: None)  # type: ignore[arg-type]
    message = str(info.value)
    assert message.startswith("point='after_step'")
    assert all(repr(p) in message for p in HOOK_POINTS)
    assert len(HOOK_POINTS) == 9


# ====================================================================== around every evaluation
class Broken(Exception):
    pass


def test_the_round_hooks_wrap_every_trigger_with_its_context() -> None:
    trainer = make_trainer(
        eval_data=tiny_loader(2, seed=1), eval_schedule=EvalSchedule(every_steps=2)
    )
    seen: list[tuple[str, int, str | None, str, Any, BaseException | None]] = []

    def record(point: str) -> Any:
        def hook(ctx: StepContext) -> None:
            seen.append((point, ctx.step, ctx.trigger, ctx.phase, ctx.batch, ctx.error))

        return hook

    trainer.add_hook("before_evaluation", record("before"))
    trainer.add_hook("after_evaluation", record("after"))
    trainer.add_hook(
        "after_optimizer_step",
        lambda ctx: trainer.bus.send(cmd.Evaluate()) if ctx.step == 3 else None,
    )
    trainer.fit_sync()
    trainer.evaluate_sync()
    # Step 4 ends the epoch too: one round, named by its first trigger (triggers: steps, epoch).
    expected = [(2, "steps"), (3, "command"), (4, "steps"), (4, "standalone")]
    assert seen == [
        (point, step, trigger, "eval", None, None)
        for step, trigger in expected
        for point in ("before", "after")
    ]


def test_after_evaluation_runs_when_the_round_raises_and_every_hook_runs() -> None:
    trainer = make_trainer(eval_data=tiny_loader(2, seed=1))
    calls: list[tuple[str, BaseException | None]] = []

    def fail_batch(ctx: StepContext) -> None:
        raise Broken("eval batch")

    def first(ctx: StepContext) -> None:
        calls.append(("first", ctx.error))
        raise Broken("first after_evaluation hook")

    trainer.add_hook("eval_batch", fail_batch)
    trainer.add_hook("after_evaluation", lambda ctx: calls.append(("second", ctx.error)))
    trainer.add_hook("after_evaluation", first)  # added last: runs first
    recorder = EventRecorder(trainer.bus)
    with pytest.raises(Broken, match="first after_evaluation hook") as info:
        trainer.fit_sync()
    # Both ran, in reverse order, with the round's error; the failure is raised, chained to it.
    assert [name for name, _ in calls] == ["first", "second"]
    assert all(str(error) == "eval batch" for _, error in calls)
    assert str(info.value.__context__) == "eval batch"
    assert any("'after_evaluation'" in note for note in info.value.__notes__)
    (end,) = recorder.of_type(ev.EvaluationRoundEnded)
    assert end.error is info.value


def test_after_evaluation_runs_when_a_before_evaluation_hook_raises() -> None:
    trainer = make_trainer()
    after: list[BaseException | None] = []

    def refuse(ctx: StepContext) -> None:
        raise Broken("before")

    trainer.add_hook("before_evaluation", refuse)
    trainer.add_hook("after_evaluation", lambda ctx: after.append(ctx.error))
    recorder = EventRecorder(trainer.bus)
    with pytest.raises(Broken):
        trainer.evaluate_sync(tiny_loader(1))
    trainer.close()
    assert len(after) == 1 and isinstance(after[0], Broken)
    # No set was scored; the round's span still closes, with the error.
    assert recorder.names()[1:] == ["EvaluationRoundStarted", "EvaluationRoundEnded"]
    assert isinstance(recorder.of_type(ev.EvaluationRoundEnded)[0].error, Broken)


def test_callback_methods_reach_the_round_points() -> None:
    calls: list[str] = []

    class Swapper(Callback):
        def hook_before_evaluation(self, ctx: StepContext) -> None:
            calls.append("before")

        def hook_eval_batch(self, ctx: StepContext) -> None:
            calls.append("batch")

        def hook_after_evaluation(self, ctx: StepContext) -> None:
            calls.append("after")

    trainer = make_trainer(eval_data=tiny_loader(2, seed=1), callbacks=[Swapper()])
    trainer.fit_sync()
    assert calls == ["before", "batch", "batch", "after"]


def test_after_evaluation_hooks_unwind_in_reverse_order_across_tiers() -> None:
    order: list[str] = []

    class Core(Callback):
        def hook_before_evaluation(self, ctx: StepContext) -> None:
            order.append("core in")

        def hook_after_evaluation(self, ctx: StepContext) -> None:
            order.append("core out")

    trainer = make_trainer()
    trainer.add_callback(Core(), tier="core")
    trainer.add_hook("before_evaluation", lambda ctx: order.append("a in"))
    trainer.add_hook("before_evaluation", lambda ctx: order.append("b in"))
    trainer.add_hook("after_evaluation", lambda ctx: order.append("a out"))
    trainer.add_hook("after_evaluation", lambda ctx: order.append("b out"))
    trainer.evaluate_sync(tiny_loader(1))
    trainer.close()
    assert order == ["core in", "a in", "b in", "b out", "a out", "core out"]


# The batch at every hook point of a step, with and without accumulation.
TRAIN_POINTS = [p for p in HOOK_POINTS if p != "eval_batch"]


def _trainer(**kwargs: Any) -> Trainer:
    model = tiny_model()
    kwargs.setdefault("max_steps", 4)
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(8, 4),
                   loss_fn=F.cross_entropy, progress=False, **kwargs)  # fmt: skip


@pytest.mark.parametrize("accumulate", [1, 2])
def test_every_hook_point_of_a_step_sees_its_batch(accumulate: int) -> None:
    """A GAN's second optimizer, stepped in after_optimizer_step, unpacks ctx.batch there."""
    trainer = _trainer(accumulate=accumulate)
    seen: dict[str, list[tuple[int, torch.Tensor]]] = {p: [] for p in TRAIN_POINTS}

    def hook_at(point: str):  # type: ignore[no-untyped-def]
        def hook(ctx: StepContext) -> None:
            inputs, _targets = ctx.batch  # the user's unpacking: a TypeError on None
            seen[point].append((ctx.batch_index, inputs.clone()))

        return hook

    for point in TRAIN_POINTS:
        trainer.add_hook(point, hook_at(point))
    trainer.fit_sync()
    steps = 4
    assert len(seen["batch"]) == len(seen["after_backward"]) == steps * accumulate
    assert len(seen["before_optimizer_step"]) == len(seen["after_optimizer_step"]) == steps
    # after_backward: the micro-batch itself; the optimizer points: the window's last one.
    for (bi, x), (bj, y) in zip(seen["batch"], seen["after_backward"], strict=True):
        assert bi == bj and torch.equal(x, y)
    last_of_window = seen["batch"][accumulate - 1 :: accumulate]
    for point in ("before_optimizer_step", "after_optimizer_step"):
        for (bi, x), (bj, y) in zip(last_of_window, seen[point], strict=True):
            assert bi == bj and torch.equal(x, y)


def test_a_hook_that_skips_every_update_fails_the_run_instead_of_looping() -> None:
    """With only ``max_steps`` to end it, a run whose epoch took no optimizer step would never
    end: it fails after that epoch, saying why."""
    model = tiny_model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(3),
                      loss_fn=F.cross_entropy, max_steps=3, progress=False)  # fmt: skip
    trainer.add_hook("before_optimizer_step", lambda ctx: setattr(ctx, "skip", True))
    with pytest.raises(TrainingError, match=r"epoch 0 ended without an optimizer step \(still "
                       r"at step 0\) and only max_steps=3 ends the run"):  # fmt: skip
        trainer.fit_sync()


def test_a_loss_class_instead_of_an_instance_is_refused() -> None:
    model = tiny_model()
    with pytest.raises(ConfigError, match=r"loss_fn=.*CrossEntropyLoss.* an instance, such as "
                       r"CrossEntropyLoss\(\), not the class"):  # fmt: skip
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(3),
                loss_fn=torch.nn.CrossEntropyLoss, max_steps=3, progress=False)  # fmt: skip
