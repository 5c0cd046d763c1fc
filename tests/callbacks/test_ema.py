"""EMA: the average against a hand-computed one, evaluations of the average, training on with
the raw weights, the swap undone after a failure or a cancel, checkpoints and exact resume."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
import torch.nn.functional as F

from trainbus import CheckpointError, ConfigError, EvalSchedule, Trainer
from trainbus import commands as cmd
from trainbus import events as ev
from trainbus._hookpoints import StepContext
from trainbus.callbacks import EMA
from trainbus.checkpoint import read_checkpoint
from trainbus.testing import EventRecorder, tiny_loader


class Net(torch.nn.Module):
    """Parameters, a BatchNorm (float running stats, an int counter) and a tied weight."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.inp = torch.nn.Linear(32, 16)
        self.norm = torch.nn.BatchNorm1d(16)
        self.mid = torch.nn.Linear(16, 16)
        self.mid2 = torch.nn.Linear(16, 16)
        self.mid2.weight = self.mid.weight  # tied: one tensor, two state-dict keys
        self.out = torch.nn.Linear(16, 10)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm(self.inp(x)))
        return self.out(torch.relu(self.mid2(torch.relu(self.mid(h)))))


def make_trainer(model: torch.nn.Module | None = None, **overrides: Any) -> Trainer:
    model = model if model is not None else Net()
    kwargs: dict[str, Any] = dict(loss_fn=F.cross_entropy, max_epochs=1, device="cpu",
                                  on_signal=None, progress=False)  # fmt: skip
    kwargs.update(overrides)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return Trainer(model, opt, tiny_loader(kwargs.pop("batches", 8)), **kwargs)


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k].cpu(), b[k].cpu()), k  # values: DataParallel moves to a GPU


def hand_ema(
    history: list[tuple[int, dict[str, torch.Tensor]]], ema: EMA, *, buffers: str = "average"
) -> dict[str, torch.Tensor]:
    """The average by hand: per state-dict key, torch.lerp at each update step."""
    avg: dict[str, torch.Tensor] | None = None
    n = 0
    for step, w in history:
        if step <= ema.start_step or step % ema.every:
            continue
        n += 1
        if avg is None:
            avg = {k: v.clone() for k, v in w.items()}
            continue
        decay = ema.decay_for(n)
        for k, v in w.items():
            averaged = v.is_floating_point() and (buffers == "average" or "running" not in k)
            avg[k] = torch.lerp(avg[k], v, 1 - decay) if averaged else v.clone()
    assert avg is not None
    return avg


def record_steps(trainer: Trainer) -> list[tuple[int, dict[str, torch.Tensor]]]:
    history: list[tuple[int, dict[str, torch.Tensor]]] = []
    trainer.add_hook(
        "after_optimizer_step", lambda ctx: history.append((ctx.step, weights(ctx.model)))
    )
    return history


# ====================================================================== numerics
@pytest.mark.parametrize(
    "options",
    [
        dict(decay=0.9),
        dict(decay=0.75, every=2, start_step=1),
        dict(decay=0.999, warmup=True, warmup_power=0.75),
        dict(decay=0.8, buffers="copy"),
    ],
)
def test_the_average_equals_a_hand_computed_ema(options: dict[str, Any]) -> None:
    ema = EMA(**options)
    trainer = make_trainer(callbacks=[ema])
    history = record_steps(trainer)
    trainer.fit_sync()
    expected = hand_ema(history, ema, buffers=options.get("buffers", "average"))
    got = ema.averaged_state_dict()
    assert_equal(got, expected)
    # The tied weight is one tensor in the average too; the counter is copied, not averaged.
    assert got["mid.weight"] is got["mid2.weight"]
    assert got["norm.num_batches_tracked"].item() == 8
    updates = [s for s, _ in history if s > ema.start_step and s % ema.every == 0]
    assert ema.updates == len(updates)
    # And it is not the raw model (the average lags it).
    assert not torch.equal(got["out.weight"], trainer.settings.model.state_dict()["out.weight"])


def test_warmup_decay_follows_timms_formula() -> None:
    ema = EMA(0.99, warmup=True, warmup_power=2 / 3, warmup_gamma=1.0)
    assert ema.decay_for(1) == 0.0  # the first update copies
    assert ema.decay_for(2) == pytest.approx(1 - 2 ** (-2 / 3))
    assert ema.decay_for(10) == pytest.approx(1 - 10 ** (-2 / 3))
    assert ema.decay_for(10_000_000) == 0.99  # capped at decay
    assert EMA(0.5).decay_for(2) == 0.5 and EMA(0.5).decay_for(1) == 0.0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(decay=1.0), "EMA.decay"),
        (dict(decay=-0.1), "EMA.decay"),
        (dict(decay="0.9"), "EMA.decay"),
        (dict(every=0), "EMA.every"),
        (dict(start_step=-1), "EMA.start_step"),
        (dict(buffers="skip"), "EMA.buffers"),
        (dict(device="nowhere"), "EMA.device"),
        (dict(warmup_power=0), "EMA.warmup_power"),
        (dict(warmup=1), "EMA.warmup"),
        (dict(state_key=""), "state_key"),
    ],
)
def test_bad_options_are_config_errors_naming_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        EMA(**kwargs)
    assert str(info.value).startswith(f"{field}=")


def test_no_average_before_the_first_update() -> None:
    ema = EMA(start_step=100)
    trainer = make_trainer(callbacks=[ema], eval_data=tiny_loader(2, seed=1))
    before = weights(trainer.settings.model)
    result = trainer.fit_sync()
    assert ema.updates == 0 and ema.state_dict() == {"updates": 0}
    with pytest.raises(RuntimeError, match="no average yet"):
        ema.averaged_state_dict()
    assert result.eval_metrics["val_loss"] > 0  # evaluated the model as it is
    assert not torch.equal(before["out.weight"], trainer.settings.model.state_dict()["out.weight"])


# ====================================================================== evaluation
def test_evaluations_score_the_average_and_training_goes_on_with_its_own_weights() -> None:
    eval_data = tiny_loader(2, seed=1)
    ema = EMA(0.8)
    trainer = make_trainer(
        callbacks=[ema],
        eval_data=eval_data,
        eval_schedule=EvalSchedule(every_steps=3),
        max_epochs=2,
    )
    seen: list[tuple[int, str | None, dict[str, torch.Tensor]]] = []
    raw_after: list[dict[str, torch.Tensor]] = []

    def in_evaluation(ctx: StepContext) -> None:  # the model as the evaluation runs it
        if ctx.batch_index == 0:
            seen.append((ctx.step, ctx.trigger, weights(ctx.model)))

    trainer.add_hook("eval_batch", in_evaluation)
    recorder = EventRecorder(trainer.bus)
    history = record_steps(trainer)
    trainer.add_hook("batch", lambda ctx: raw_after.append(weights(ctx.model)))
    result = trainer.fit_sync()

    # Evaluations at steps 3, 6 (eval_every), 8 (end of epoch 0), 9, 12, 15 and 16.
    assert [(s, t) for s, t, _ in seen] == [
        (3, "steps"),
        (6, "steps"),
        (8, "epoch"),
        (9, "steps"),
        (12, "steps"),
        (15, "steps"),
        (16, "epoch"),
    ]
    by_step = dict(history)
    for step, _, in_eval in seen:
        # The model held the average of the steps so far, bit for bit.
        expected = hand_ema([(s, w) for s, w in history if s <= step], ema)
        assert_equal(in_eval, expected)
        assert not torch.equal(in_eval["out.weight"], by_step[step]["out.weight"])
    # After each evaluation the next step started from the raw weights of the step before it.
    for step, _, _ in seen[:-1]:
        assert_equal(raw_after[step], by_step[step])
    # The metrics are the average's: evaluate a copy of the final average by hand.
    final = Net()
    final.load_state_dict(ema.averaged_state_dict())
    final.eval()
    with torch.no_grad():
        losses = [F.cross_entropy(final(x), y).double() * len(y) for x, y in eval_data]
    expected_loss = (torch.stack(losses).sum() / sum(len(y) for _, y in eval_data)).item()
    assert result.eval_metrics["val_loss"] == expected_loss
    last = recorder.of_type(ev.EvaluationEnded)[-1]
    assert last.metrics["val_loss"] == expected_loss


def test_training_with_the_swaps_equals_training_without_them() -> None:
    """The raw weights of a run whose every evaluation swapped the average in and out are
    bit-identical to a run with no EMA at all."""
    plain = make_trainer(
        eval_data=tiny_loader(2, seed=1), eval_schedule=EvalSchedule(every_steps=2), max_epochs=2
    )
    plain.fit_sync()
    ema = EMA(0.5)
    swapped = make_trainer(
        callbacks=[ema],
        eval_data=tiny_loader(2, seed=1),
        eval_schedule=EvalSchedule(every_steps=2),
        max_epochs=2,
    )
    swapped.fit_sync()
    assert_equal(weights(swapped.settings.model), weights(plain.settings.model))
    assert_equal(swapped.settings.optimizer.state_dict()["state"][0],
                 plain.settings.optimizer.state_dict()["state"][0])  # fmt: skip
    assert ema.updates == 16 and not ema.swapped


def test_trainer_evaluate_scores_the_average_and_restores_the_model() -> None:
    eval_data = tiny_loader(3, seed=2)
    ema = EMA(0.7)
    trainer = make_trainer(callbacks=[ema])
    trainer.fit_sync()
    raw = weights(trainer.settings.model)
    metrics = trainer.evaluate_sync(eval_data)
    assert_equal(weights(trainer.settings.model), raw)
    averaged = Net()
    ema.copy_to(averaged)
    plain = make_trainer(averaged)
    assert metrics == plain.evaluate_sync(eval_data)
    assert metrics != make_trainer(trainer.settings.model).evaluate_sync(eval_data)


def test_evaluate_false_averages_without_swapping() -> None:
    ema = EMA(0.7, evaluate=False)
    trainer = make_trainer(callbacks=[ema])
    trainer.fit_sync()
    raw_metrics = make_trainer(trainer.settings.model).evaluate_sync(tiny_loader(2, seed=2))
    assert trainer.evaluate_sync(tiny_loader(2, seed=2)) == raw_metrics
    assert ema.updates == 8


# ====================================================================== failures
class Boom(Exception):
    pass


def test_the_swap_is_undone_when_the_evaluation_raises() -> None:
    ema = EMA(0.5)
    trainer = make_trainer(
        callbacks=[ema], eval_data=tiny_loader(3, seed=1), eval_schedule=EvalSchedule(every_steps=4)
    )
    history = record_steps(trainer)
    in_eval: list[dict[str, torch.Tensor]] = []

    def fail_on_second_batch(ctx: StepContext) -> None:
        in_eval.append(weights(ctx.model))
        if ctx.batch_index == 1:
            raise Boom("the model blew up on an evaluation batch")

    trainer.add_hook("eval_batch", fail_on_second_batch)
    recorder = EventRecorder(trainer.bus)
    with pytest.raises(Boom):
        trainer.fit_sync()
    assert trainer.result is not None and trainer.result.reason == "failed"
    step, raw = history[-1]
    assert step == 4
    assert_equal(in_eval[0], ema.averaged_state_dict())  # it was swapped in
    assert_equal(weights(trainer.settings.model), raw)  # and swapped back, bit for bit
    assert not ema.swapped
    (round_end,) = recorder.of_type(ev.EvaluationRoundEnded)
    assert isinstance(round_end.error, Boom)


def test_the_swap_is_undone_when_a_later_before_evaluation_hook_raises() -> None:
    ema = EMA(0.5)
    trainer = make_trainer(callbacks=[ema])
    trainer.fit_sync()
    raw = weights(trainer.settings.model)
    after: list[BaseException | None] = []

    def refuse(ctx: StepContext) -> None:
        raise Boom("refused")

    trainer.add_hook("before_evaluation", refuse)  # runs after the EMA's (same tier, later)
    trainer.add_hook("after_evaluation", lambda ctx: after.append(ctx.error))
    with pytest.raises(Boom):
        trainer.evaluate_sync(tiny_loader(1, seed=3))
    assert_equal(weights(trainer.settings.model), raw)
    assert len(after) == 1 and isinstance(after[0], Boom)


def test_the_swap_is_undone_when_the_evaluation_is_cancelled() -> None:
    ema = EMA(0.5)
    trainer = make_trainer(callbacks=[ema])
    trainer.fit_sync()
    raw = weights(trainer.settings.model)
    reached = threading.Event()
    release = threading.Event()
    in_eval: list[dict[str, torch.Tensor]] = []

    def hold(ctx: StepContext) -> None:  # the first batch waits until the call is cancelled
        in_eval.append(weights(ctx.model))
        reached.set()
        release.wait(30)

    trainer.add_hook("eval_batch", hold)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(trainer.evaluate, tiny_loader(4, seed=3))
            await anyio.to_thread.run_sync(reached.wait, 30)
            tg.cancel_scope.cancel()
            # The cancel reaches the run from the call's own task: let it get there before the
            # held batch ends (released at once, a loaded machine ran the second batch first).
            with anyio.CancelScope(shield=True):
                await anyio.sleep(0.5)
            release.set()

    anyio.run(main)
    assert len(in_eval) == 1  # cancelled before the second batch
    assert_equal(in_eval[0], ema.averaged_state_dict())
    assert_equal(weights(trainer.settings.model), raw)
    assert not ema.swapped


# ====================================================================== checkpoints
def test_checkpoints_hold_the_average_and_a_resume_continues_it_exactly(tmp_path: Path) -> None:
    def run(folder: Path, resume: str | None = None) -> tuple[Trainer, EMA]:
        ema = EMA(0.9, warmup=True, every=2)
        trainer = make_trainer(
            callbacks=[ema],
            checkpoint_dir=folder,
            max_epochs=2,
            eval_data=tiny_loader(2, seed=1),
            eval_schedule=EvalSchedule(every_steps=3),
        )
        if resume is None:
            trainer.add_hook("after_optimizer_step", lambda ctx: trainer.bus.send(
                cmd.SaveCheckpoint(tag="mid")) if ctx.step == 5 else None)  # fmt: skip
        trainer.fit_sync(resume=resume)
        return trainer, ema

    straight, straight_ema = run(tmp_path / "a")
    (mid,) = (tmp_path / "a").glob("*-mid.pt")
    resumed, resumed_ema = run(tmp_path / "b", resume=str(mid))
    assert resumed.result is not None and resumed.result.resumed_from == str(mid)
    assert_equal(resumed_ema.averaged_state_dict(), straight_ema.averaged_state_dict())
    assert resumed_ema.updates == straight_ema.updates == 8
    assert_equal(weights(resumed.settings.model), weights(straight.settings.model))
    assert resumed.result.eval_metrics == straight.result.eval_metrics  # type: ignore[union-attr]

    # What to deploy: the checkpoint's EMA weights load into a fresh model.
    final = read_checkpoint(Path(straight.result.last_checkpoint))  # type: ignore[union-attr,arg-type]
    deployed = Net(seed=5)
    deployed.load_state_dict(final.callbacks["EMA"]["weights"])
    assert_equal(weights(deployed), straight_ema.averaged_state_dict())
    assert final.callbacks["EMA"]["updates"] == 8
    # The checkpoint's model entry is the training weights.
    assert_equal(final.model, weights(straight.settings.model))


def test_a_checkpoint_average_that_does_not_fit_the_model_is_refused(tmp_path: Path) -> None:
    ema = EMA(0.9)
    trainer = make_trainer(callbacks=[ema], checkpoint_dir=tmp_path)
    trainer.fit_sync()
    (path,) = tmp_path.glob("*.pt")
    state = dict(read_checkpoint(path).callbacks["EMA"])
    other = EMA(0.9)
    other.load_state_dict({**state, "weights": {**state["weights"], "extra.bias": torch.zeros(3)}})
    with pytest.raises(CheckpointError, match=r"does not fit the model: .*extra\.bias"):
        other.update(Net())
    with pytest.raises(CheckpointError, match="not an EMA state"):
        other.load_state_dict({"updates": 2})


# ====================================================================== several, wrappers
def test_two_averages_nest_and_the_last_added_is_evaluated(tmp_path: Path) -> None:
    fast, slow = EMA(0.5, state_key="fast"), EMA(0.9, state_key="slow")
    trainer = make_trainer(callbacks=[fast, slow], checkpoint_dir=tmp_path)
    trainer.fit_sync()
    raw = weights(trainer.settings.model)
    fast_avg = {k: v.clone() for k, v in fast.averaged_state_dict().items()}
    slow_avg = {k: v.clone() for k, v in slow.averaged_state_dict().items()}
    in_eval: list[dict[str, torch.Tensor]] = []
    trainer.add_hook("eval_batch", lambda ctx: in_eval.append(weights(ctx.model)))
    trainer.evaluate_sync(tiny_loader(1, seed=2))
    # The swaps unwound in reverse: every tensor back where it was.
    assert_equal(in_eval[0], slow_avg)
    assert_equal(weights(trainer.settings.model), raw)
    assert_equal(fast.averaged_state_dict(), fast_avg)
    assert_equal(slow.averaged_state_dict(), slow_avg)
    (path,) = tmp_path.glob("*.pt")
    saved = read_checkpoint(path).callbacks
    assert_equal(saved["fast"]["weights"], fast_avg)
    assert_equal(saved["slow"]["weights"], slow_avg)


def test_wrapped_models_are_averaged_by_the_original_modules_names() -> None:
    class Compiled(torch.nn.Module):  # what torch.compile returns: the module as _orig_mod
        def __init__(self, module: torch.nn.Module) -> None:
            super().__init__()
            self._orig_mod = module

    model = Net()
    compiled = Compiled(model)
    assert set(compiled.state_dict()) != set(model.state_dict())  # "_orig_mod." keys
    ema = EMA(0.5)
    ema.update(compiled)
    ema.update(torch.nn.DataParallel(model))
    assert set(ema.averaged_state_dict()) == set(model.state_dict())
    assert_equal(ema.averaged_state_dict(), weights(model))
    fresh = Net(seed=9)
    ema.copy_to(torch.nn.DataParallel(fresh))
    assert_equal(weights(fresh), weights(model))


def test_the_average_can_live_on_another_device_than_the_model() -> None:
    ema = EMA(0.5, device="cpu")
    model = Net().double()  # another dtype than the default: kept as the model's
    ema.update(model)
    assert all(v.device.type == "cpu" for v in ema.averaged_state_dict().values())
    assert ema.averaged_state_dict()["inp.weight"].dtype == torch.float64
    assert ema.averaged_state_dict()["inp.weight"] is not model.inp.weight


def test_a_custom_step_with_two_optimizers_moves_the_average_once_a_step() -> None:
    """``after_optimizer_step`` runs once per optimizer a custom step steps, each with the step
    the update completes; the average moves once a step, not once per optimizer."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(32, 10), "b": torch.nn.Linear(10, 10)})
    opts = {name: torch.optim.SGD(model[name].parameters(), lr=0.1) for name in ("a", "b")}

    def two_updates(ctx: Any) -> torch.Tensor:
        x, y = ctx.batch
        loss = F.cross_entropy(ctx.model["b"](ctx.model["a"](x)), y)
        ctx.backward(loss)
        ctx.optimizer_step("a")
        ctx.optimizer_step("b")
        return loss

    seen: list[tuple[int, int]] = []
    ema = EMA(decay=0.5)
    trainer = Trainer(model, opts, tiny_loader(5), train_step=two_updates, callbacks=[ema],
                      max_epochs=1, device="cpu", on_signal=None, progress=False,
                      eval_schedule=EvalSchedule(at_end=False))  # fmt: skip
    trainer.add_hook("after_optimizer_step", lambda ctx: seen.append((ctx.step, id(ctx.optimizer))))
    trainer.fit_sync()
    assert [step for step, _ in seen] == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    assert {opt for _, opt in seen} == {id(opts["a"]), id(opts["b"])}
    assert ema.updates == 5
