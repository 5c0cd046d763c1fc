"""Custom steps (``train_step=``) and several optimizers, as a researcher meets them: a GAN with
two optimizers and schedulers, a two-view contrastive step under accumulation, both resumed
bit-identically; the events, hooks and commands around them; and the bad inputs."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trainbus import (
    CheckpointError,
    ConfigError,
    NonFiniteLossError,
    StepContext,
    TrainContext,
    Trainer,
    TrainingError,
    default_train_step,
)
from trainbus import commands as cmd
from trainbus import events as ev
from trainbus.testing import EventRecorder, tiny_loader, tiny_model

bce = F.binary_cross_entropy_with_logits


def gan_parts(seed: int = 0, batches: int = 10) -> tuple[nn.ModuleDict, dict[str, Any], list]:
    torch.manual_seed(seed)
    model = nn.ModuleDict({
        "g": nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)),
        "d": nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 1)),
    })  # fmt: skip
    opts = {
        "g": torch.optim.Adam(model["g"].parameters(), lr=1e-2),
        "d": torch.optim.SGD(model["d"].parameters(), lr=1e-2, momentum=0.9),
    }
    data = [torch.randn(6, 2) + 1.0 for _ in range(batches)]
    return model, opts, data


def gan_step(ctx: TrainContext) -> dict[str, torch.Tensor]:
    g, d = ctx.model["g"], ctx.model["d"]  # type: ignore[index]
    real = ctx.batch
    fake = g(torch.randn(len(real), 4, device=ctx.device))  # tensors made here: the run's device
    ones = torch.ones(len(real), 1, device=ctx.device)
    zeros = torch.zeros(len(real), 1, device=ctx.device)
    d_loss = bce(d(real), ones) + bce(d(fake.detach()), zeros)
    ctx.backward(d_loss)
    ctx.optimizer_step("d")
    g_loss = bce(d(fake), ones)
    ctx.backward(g_loss)
    ctx.optimizer_step("g")
    return {"loss": g_loss, "d_loss": d_loss}


def gan_trainer(tmp: Path | None, **kw: Any) -> Trainer:
    model, opts, data = gan_parts()
    scheds = {n: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5)
              for n, o in opts.items()}  # fmt: skip
    kw.setdefault("max_steps", 10)
    trainer = Trainer(model, opts, data, train_step=gan_step, scheduler=scheds, log_every=2,
                      seed=7, checkpoint_dir=tmp, progress=False, **kw)  # fmt: skip
    return trainer


def weights(trainer: Trainer) -> list[torch.Tensor]:
    return [t.detach().clone() for t in trainer.settings.model.state_dict().values()]


def states_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(states_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(states_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


# ------------------------------------------------------------------------------ GAN, resume
def test_gan_resumes_bit_identically(tmp_path: Path) -> None:
    whole = gan_trainer(tmp_path / "whole")
    result = whole.fit_sync()
    assert result.reason == "completed" and result.steps == 10

    stopped = gan_trainer(tmp_path / "split", max_steps=4)  # ends with a checkpoint at 4
    assert stopped.fit_sync().steps == 4
    resumed = gan_trainer(tmp_path / "split")
    again = resumed.fit_sync(resume="latest")
    assert again.steps == 10 and again.resumed_from is not None
    assert all(torch.equal(x, y) for x, y in zip(weights(whole), weights(resumed), strict=True))
    for name in ("g", "d"):  # every optimizer and scheduler, not only the first
        assert states_equal(whole.settings.optimizers[name].state_dict(),
                            resumed.settings.optimizers[name].state_dict())  # fmt: skip
        assert states_equal(whole.settings.schedulers[name].state_dict(),
                            resumed.settings.schedulers[name].state_dict())  # fmt: skip
    # The returned mapping's other entries are metrics, with each optimizer's lr.
    assert set(result.train_metrics) >= {"loss", "d_loss", "lr", "lr/g", "lr/d"}
    assert result.train_metrics["lr/g"] == pytest.approx(1e-2 * 0.5**3)


def test_contrastive_step_with_accumulation_resumes_bit_identically(tmp_path: Path) -> None:
    def two_views(ctx: TrainContext) -> torch.Tensor:
        x = ctx.batch
        z1 = F.normalize(ctx.model(x + 0.1 * torch.randn_like(x)), dim=1)
        z2 = F.normalize(ctx.model(x + 0.1 * torch.randn_like(x)), dim=1)
        logits = z1 @ z2.T / 0.5
        loss = F.cross_entropy(logits, torch.arange(len(x), device=ctx.device))
        ctx.backward(loss)
        assert ctx.optimizer_step() is ctx.last_micro_batch
        return loss

    def run(directory: Path, max_steps: int | None = None, resume: str | None = None) -> Trainer:
        torch.manual_seed(0)
        model = nn.Linear(8, 8)
        data = [torch.randn(5, 8) for _ in range(9)]  # 9 batches, accumulate 2: a short last step
        trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), data,
                          train_step=two_views, accumulate=2, clip_grad_norm=1.0, max_epochs=2,
                          max_steps=max_steps, seed=1, checkpoint_dir=directory,
                          progress=False)  # fmt: skip
        trainer.fit_sync(resume=resume)
        return trainer

    whole = run(tmp_path / "a")
    assert whole.result is not None and whole.result.steps == 10  # 5 steps an epoch, 2 epochs
    run(tmp_path / "b", max_steps=3)  # mid-epoch: the data order is replayed
    resumed = run(tmp_path / "b", resume="latest")
    assert all(torch.equal(x, y) for x, y in zip(weights(whole), weights(resumed), strict=True))


# ------------------------------------------------------------------------------ events, hooks
def test_custom_step_publishes_the_steps_events_and_runs_the_hooks() -> None:
    trainer = gan_trainer(None, max_steps=3, trace=True)
    rec = EventRecorder(trainer.bus)
    seen: list[tuple[str, int]] = []

    def before(ctx: StepContext) -> None:
        name = next(n for n, o in trainer.settings.optimizers.items() if o is ctx.optimizer)
        seen.append((name, ctx.step))

    trainer.add_hook("before_optimizer_step", before)
    trainer.add_hook("after_backward", lambda ctx: ctx.log("backwards", 1.0))
    trainer.fit_sync()
    assert seen == [("d", 0), ("g", 0), ("d", 1), ("g", 1), ("d", 2), ("g", 2)]
    assert [e.step for e in rec.of_type(ev.StepEnded)] == [1, 2, 3]
    # Traced like the default step: per optimizer its update and zero_grad, at the step they
    # begin in (the run's step advances once, after both optimizers stepped).
    traced = [(e.span, e.step) for e in rec.of_type(ev.SpanTraced) if e.span != "data_wait"]
    one = [("backward", 0), ("optimizer_step", 0), ("zero_grad", 0),  # d
           ("backward", 0), ("optimizer_step", 0), ("zero_grad", 0),  # g
           ("scheduler_step", 1)]  # fmt: skip
    assert traced == [(span, s + k) for k in range(3) for span, s in one]
    assert all(e.started <= e.ended and e.error is None for e in rec.of_type(ev.SpanTraced))
    assert [e.step for e in rec.of_type(ev.SchedulerStepped)] == [1, 2, 3]
    logged = rec.of_type(ev.MetricsLogged)
    assert logged and logged[0].metrics["backwards"] == 1.0
    assert "d_loss" in logged[0].metrics


def test_default_step_steps_every_optimizer_of_a_mapping() -> None:
    model = tiny_model()
    *_, head = model.children()
    body = next(iter(model.children()))
    opts = {"body": torch.optim.SGD(body.parameters(), lr=0.1),
            "head": torch.optim.SGD(head.parameters(), lr=0.1)}  # fmt: skip
    before = [p.detach().clone() for p in model.parameters()]
    result = Trainer(model, opts, tiny_loader(4), loss_fn=F.cross_entropy, max_steps=2,
                     log_every=1, progress=False).fit_sync()  # fmt: skip
    assert result.steps == 2
    after = [p.detach().cpu() for p in model.parameters()]  # on the run's device
    assert all(not torch.equal(a, p) for a, p in zip(before, after, strict=True))
    assert {"lr/body", "lr/head"} <= set(result.train_metrics)


def test_learning_rate_commands_name_one_optimizer_or_apply_to_all() -> None:
    model, opts, data = gan_parts()
    trainer = Trainer(model, opts, data, train_step=gan_step, max_steps=4, progress=False)
    rec = EventRecorder(trainer.bus)
    sent = [cmd.SetLearningRate(lr=0.5, optimizer="d"), cmd.ScaleLearningRate(factor=2.0),
            cmd.SetLearningRate(lr=0.1, optimizer="nope")]  # fmt: skip

    def send(e: ev.StepEnded) -> None:
        if e.step == 1:
            for c in sent:
                trainer.bus.send(c)

    trainer.bus.stream(ev.StepEnded).subscribe(send)
    trainer.fit_sync()
    assert opts["d"].param_groups[0]["lr"] == 1.0
    assert opts["g"].param_groups[0]["lr"] == pytest.approx(2e-2)
    applied = rec.of_type(ev.CommandApplied)
    refused = [a for a in applied if a.error is not None]
    assert len(refused) == 1 and "'nope'" in str(refused[0].error)
    assert "'g', 'd'" in str(refused[0].error)


# ------------------------------------------------------------------------------ bad input
def test_a_step_that_returns_nothing_names_itself() -> None:
    def forgetful(ctx: TrainContext) -> None:
        loss = ctx.model(ctx.batch[0]).sum()
        ctx.backward(loss)
        ctx.optimizer_step()

    model = tiny_model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(2),
                      train_step=forgetful, max_steps=1, progress=False)  # fmt: skip
    with pytest.raises(TrainingError, match=r"train_step .*forgetful returned None"):
        trainer.fit_sync()


def test_a_mapping_without_a_loss_names_its_keys() -> None:
    def misspelt(ctx: TrainContext) -> dict[str, torch.Tensor]:
        loss = ctx.model(ctx.batch[0]).sum()
        ctx.backward(loss)
        ctx.optimizer_step()
        return {"los": loss}

    model = tiny_model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(2),
                      train_step=misspelt, max_steps=1, progress=False)  # fmt: skip
    with pytest.raises(TrainingError, match=r"misspelt returned a mapping without a 'loss' "
                       r"entry \(keys: 'los'\) at step 1"):  # fmt: skip
        trainer.fit_sync()


def test_a_non_finite_loss_names_the_step() -> None:
    def nan_step(ctx: TrainContext) -> torch.Tensor:
        loss = ctx.model(ctx.batch[0]).sum() * float("nan")
        ctx.backward(loss)
        ctx.optimizer_step()
        return loss

    model = tiny_model()
    # The CPU reads each step's losses before its update, where the note is added; a GPU reads
    # them at the next sync (docs/trainer.md, Custom steps), so the device is named.
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(2),
                      train_step=nan_step, max_steps=2, device="cpu", progress=False)  # fmt: skip
    with pytest.raises(NonFiniteLossError) as info:
        trainer.fit_sync()
    assert any("nan_step" in note and "'default'" in note for note in info.value.__notes__)


def test_a_non_finite_loss_skips_every_optimizer_of_the_step() -> None:
    calls = []

    def step(ctx: TrainContext) -> dict[str, torch.Tensor]:
        out = gan_step(ctx)
        calls.append(ctx.step)
        return out

    model, opts, data = gan_parts()  # the second batch makes the discriminator's loss NaN
    trainer = Trainer(model, opts, [*data[:1], torch.full((6, 2), float("nan")), *data[2:]],
                      train_step=step, max_steps=3, on_nonfinite="skip",
                      progress=False)  # fmt: skip
    result = trainer.fit_sync()
    assert result.skipped_nonfinite == 1 and result.steps == 3
    assert calls == [0, 1, 1, 2]  # the skipped step took no step: step 1 ran again


def test_forgetting_to_step_a_declared_optimizer_warns_naming_it() -> None:
    def only_d(ctx: TrainContext) -> torch.Tensor:
        d = ctx.model["d"]  # type: ignore[index]
        loss = bce(d(ctx.batch), torch.ones(len(ctx.batch), 1, device=ctx.device))
        ctx.backward(loss)
        ctx.optimizer_step("d")
        return loss

    model, opts, data = gan_parts()
    trainer = Trainer(model, opts, data, train_step=only_d, max_steps=3, progress=False)
    with pytest.warns(RuntimeWarning, match=r"only_d did not step optimizer 'g'") as record:
        trainer.fit_sync()
    assert len([w for w in record if "did not step" in str(w.message)]) == 1  # warned once


def test_an_unknown_optimizer_name_in_the_step_is_refused() -> None:
    def typo(ctx: TrainContext) -> torch.Tensor:
        loss = ctx.model["d"](ctx.batch).mean()  # type: ignore[index]
        ctx.backward(loss)
        ctx.optimizer_step("disc")
        return loss

    model, opts, data = gan_parts()
    trainer = Trainer(model, opts, data, train_step=typo, max_steps=1, progress=False)
    with pytest.raises(ConfigError, match=r"'disc'.*'g', 'd'"):
        trainer.fit_sync()


def test_one_scheduler_with_several_optimizers_names_its_optimizer() -> None:
    model, opts, data = gan_parts()
    sched = torch.optim.lr_scheduler.StepLR(opts["d"], step_size=1)
    with pytest.raises(ConfigError, match=r"belongs to optimizer 'd'.*=\{'d': scheduler\}"):
        Trainer(model, opts, data, train_step=gan_step, scheduler=sched, max_steps=1)
    wrong = {"g": torch.optim.lr_scheduler.StepLR(opts["d"], step_size=1)}
    with pytest.raises(ConfigError, match=r"scheduler\['g'\].*drives optimizer 'd'"):
        Trainer(model, opts, data, train_step=gan_step, scheduler=wrong, max_steps=1)
    with pytest.raises(ConfigError, match=r"names of the optimizers"):
        Trainer(model, opts, data, train_step=gan_step, scheduler={"x": sched}, max_steps=1)


@pytest.mark.parametrize(
    ("optimizer", "match"),
    [
        ("list", r"a torch\.optim\.Optimizer, or a mapping of names to optimizers"),
        ("empty", r"at least one optimizer"),
        ("shared", r"disjoint parameters .*optimizer\['a'\]"),
        ("badname", r"names that are identifiers"),
    ],
)
def test_bad_optimizer_mappings_are_refused(optimizer: str, match: str) -> None:
    model = tiny_model()
    a = torch.optim.SGD(model.parameters(), lr=0.1)
    b = torch.optim.SGD(model.parameters(), lr=0.1)
    value = {"list": [a, b], "empty": {}, "shared": {"a": a, "b": b}, "badname": {"a-b": a}}
    with pytest.raises(ConfigError, match=match):
        Trainer(model, value[optimizer], tiny_loader(2), loss_fn=F.cross_entropy, max_steps=1)


def test_a_train_step_that_is_not_callable_is_refused() -> None:
    model = tiny_model()
    with pytest.raises(ConfigError, match=r"train_step.*a callable step\(ctx\)"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(2),
                train_step="gan", max_steps=1)  # type: ignore[arg-type]  # fmt: skip


def test_a_checkpoint_of_two_optimizers_does_not_load_into_other_names(tmp_path: Path) -> None:
    gan_trainer(tmp_path, max_steps=2).fit_sync()
    model, opts, data = gan_parts()
    renamed = {"gen": opts["g"], "disc": opts["d"]}

    def step(ctx: TrainContext) -> torch.Tensor:
        raise AssertionError("never reached")

    trainer = Trainer(model, renamed, data, train_step=step, max_steps=4,
                      checkpoint_dir=tmp_path, progress=False)  # fmt: skip
    with pytest.raises(CheckpointError, match=r"optimizers \['d', 'g'\] but this run has"):
        trainer.fit_sync(resume="latest")


class RecordingScaler:
    """A grad scaler that scales by 1 and records its calls (fp16 needs CUDA: this checks the
    order trainbus drives a scaler in under several optimizers, on the CPU)."""

    def __init__(self, names: dict[int, str]) -> None:
        self.names, self.calls = names, []

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        self.calls.append("scale")
        return loss

    def unscale_(self, opt: torch.optim.Optimizer) -> None:
        self.calls.append(f"unscale {self.names[id(opt)]}")

    def step(self, opt: torch.optim.Optimizer) -> None:
        self.calls.append(f"step {self.names[id(opt)]}")
        opt.step()

    def update(self) -> None:
        self.calls.append("update")

    def get_scale(self) -> float:
        return 1.0


def test_the_grad_scaler_unscales_and_steps_each_optimizer_and_updates_once() -> None:
    model, opts, data = gan_parts()
    scaler = RecordingScaler({id(o): n for n, o in opts.items()})
    trainer = Trainer(model, opts, data, train_step=gan_step, max_steps=1, progress=False)
    trainer.settings = dataclasses.replace(trainer.settings, scaler=scaler)
    trainer.fit_sync()
    assert scaler.calls == ["scale", "unscale d", "step d", "scale", "unscale g", "step g",
                            "update"]  # fmt: skip


def test_a_step_whose_every_update_a_hook_skipped_still_updates_the_grad_scaler() -> None:
    """``unscale_`` was called: without ``update()`` the next step's ``unscale_`` raises."""
    model, opts, data = gan_parts()
    scaler = RecordingScaler({id(o): n for n, o in opts.items()})
    trainer = Trainer(model, opts, data, train_step=gan_step, max_steps=1, progress=False)
    trainer.settings = dataclasses.replace(trainer.settings, scaler=scaler)
    calls = {"n": 0}

    def skip_the_first_step(ctx: StepContext) -> None:
        calls["n"] += 1
        if calls["n"] <= 2:  # both updates of the first step
            ctx.skip_batch()

    trainer.add_hook("before_optimizer_step", skip_the_first_step)
    result = trainer.fit_sync()
    assert result.steps == 1
    assert scaler.calls == ["scale", "unscale d", "scale", "unscale g", "update",  # skipped
                            "scale", "unscale d", "step d", "scale", "unscale g", "step g",
                            "update"]  # fmt: skip


class TwoParts(nn.Module):
    """A model trained by two optimizers under the default step (it returns its loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(2, 4), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)).pow(2).mean()


def test_the_default_step_drives_the_grad_scaler_over_every_optimizer() -> None:
    model = TwoParts()
    opts = {"body": torch.optim.SGD(model.body.parameters(), lr=0.1),
            "head": torch.optim.SGD(model.head.parameters(), lr=0.1)}  # fmt: skip
    scaler = RecordingScaler({id(o): n for n, o in opts.items()})
    trainer = Trainer(model, opts, [torch.randn(4, 2)], max_steps=1, progress=False)
    trainer.settings = dataclasses.replace(trainer.settings, scaler=scaler)
    trainer.fit_sync()
    assert scaler.calls == ["scale", "unscale body", "unscale head", "step body", "step head",
                            "update"]  # fmt: skip


def test_an_error_in_the_step_reaches_the_caller_as_itself_with_a_note() -> None:
    def broken(ctx: TrainContext) -> torch.Tensor:
        raise KeyError("no such layer")

    model = tiny_model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(2),
                      train_step=broken, max_steps=1, progress=False)  # fmt: skip
    with pytest.raises(KeyError, match="no such layer") as info:
        trainer.fit_sync()
    assert any("train_step" in n and "broken at step 1" in n for n in info.value.__notes__)
    assert trainer.result is not None and trainer.result.reason == "failed"


# ------------------------------------------------------------------ the default step, one path
def _plain_run(train_step: Any = None, **kw: Any) -> tuple[list[torch.Tensor], list[float]]:
    torch.manual_seed(0)
    model = tiny_model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(7),
                      loss_fn=F.cross_entropy, max_epochs=2, accumulate=2, clip_grad_norm=1.0,
                      train_step=train_step, progress=False, **kw)  # fmt: skip
    rec = EventRecorder(trainer.bus)
    trainer.fit_sync()
    return weights(trainer), [float(e.loss) for e in rec.of_type(ev.StepEnded)]


def test_the_default_step_written_out_by_a_user_runs_the_same_steps() -> None:
    """``default_train_step`` is plain code on the context a custom step gets: a user's copy
    of it, passed as ``train_step=``, trains to the same weights and losses, accumulation,
    clipping and the epoch's short last step included."""
    from trainbus import default_train_step

    def my_step(ctx: TrainContext) -> torch.Tensor | None:
        loss = ctx.compute_loss()
        if loss is None:
            return None
        ctx.backward(loss)
        ctx.optimizer_step()
        return loss

    default_w, default_losses = _plain_run()
    for step in (default_train_step, my_step):
        w, losses = _plain_run(step)
        assert losses == default_losses
        assert all(torch.equal(a, b) for a, b in zip(w, default_w, strict=True))


def test_compute_loss_runs_the_forward_hooks_in_a_custom_step() -> None:
    """A custom step that calls ``ctx.compute_loss()`` gets the ``after_forward`` and ``loss``
    hooks; a ``loss`` hook's skip reaches it as None, and the step counts no update for it."""
    seen: list[str] = []
    skipped = {"n": 0}

    def after_forward(ctx: StepContext) -> None:
        seen.append("after_forward")

    def loss_hook(ctx: StepContext) -> None:
        seen.append("loss")
        if ctx.batch_index == 1:
            ctx.skip = True

    def my_step(ctx: TrainContext) -> torch.Tensor | None:
        loss = ctx.compute_loss()
        if loss is None:
            skipped["n"] += 1
            return None
        ctx.backward(loss * 2)
        ctx.optimizer_step()
        return loss

    model = tiny_model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(3),
                      loss_fn=F.cross_entropy, max_epochs=1, train_step=my_step,
                      progress=False)  # fmt: skip
    trainer.add_hook("after_forward", after_forward)
    trainer.add_hook("loss", loss_hook)
    result = trainer.fit_sync()
    assert seen == ["after_forward", "loss"] * 3
    assert skipped["n"] == 1 and result.steps == 2


def test_returning_none_without_a_hook_skip_still_names_the_step() -> None:
    def forgot_return(ctx: TrainContext) -> None:
        loss = ctx.compute_loss()
        assert loss is not None
        ctx.backward(loss)
        ctx.optimizer_step()

    model = tiny_model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(2),
                      loss_fn=F.cross_entropy, max_steps=1, train_step=forgot_return,
                      progress=False)  # fmt: skip
    with pytest.raises(TrainingError, match=r"train_step .*forgot_return returned None"):
        trainer.fit_sync()


def test_a_step_that_never_steps_an_optimizer_fails_instead_of_looping() -> None:
    """Without ``ctx.optimizer_step()`` no step would ever count: the run fails at the first
    step with an error saying what to call, instead of training forever at step 0."""

    def no_update(ctx: TrainContext) -> torch.Tensor:
        loss = F.cross_entropy(ctx.model(ctx.batch[0]), ctx.batch[1])
        ctx.backward(loss)
        return loss

    model = tiny_model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(4),
                      max_steps=2, train_step=no_update, progress=False)  # fmt: skip
    with pytest.raises(TrainingError, match=r"no_update never called ctx.optimizer_step\(\) "
                       r"in step 1 \(epoch 0, batch 0\)"):  # fmt: skip
        trainer.fit_sync()


def test_a_step_cut_short_by_the_data_may_leave_its_update_to_the_last_micro_batch() -> None:
    """A step that steps only at ``ctx.last_micro_batch`` is not an error when data of unknown
    length runs out before that micro-batch: the deferred rule steps nothing, nothing fails."""
    stepped: list[int] = []

    def at_last(ctx: TrainContext) -> torch.Tensor:
        loss = F.cross_entropy(ctx.model(ctx.batch[0]), ctx.batch[1])
        ctx.backward(loss)
        if ctx.last_micro_batch:
            stepped.append(ctx.step)
            ctx.optimizer_step()
        return loss

    model = tiny_model()
    data = tiny_loader(5)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                      (b for b in data), accumulate=2, max_epochs=1, train_step=at_last,
                      progress=False)  # fmt: skip
    result = trainer.fit_sync()
    assert result.reason == "completed" and result.steps == 2 and stepped == [0, 1]


def test_a_step_without_backward_warns_once_that_it_trains_nothing() -> None:
    def no_backward(ctx: TrainContext) -> torch.Tensor:
        loss = F.cross_entropy(ctx.model(ctx.batch[0]), ctx.batch[1])
        ctx.optimizer_step()
        return loss

    model = tiny_model()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(3),
                      max_steps=3, train_step=no_backward, progress=False)  # fmt: skip
    with pytest.warns(RuntimeWarning, match=r"no_backward stepped the optimizer with no "
                      r"gradients at step 1: call ctx.backward\(loss\)") as record:  # fmt: skip
        trainer.fit_sync()
    assert len([w for w in record if "no gradients" in str(w.message)]) == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_a_step_with_its_own_backward_is_not_warned() -> None:
    import warnings

    def own_backward(ctx: TrainContext) -> torch.Tensor:
        loss = F.cross_entropy(ctx.model(ctx.batch[0]), ctx.batch[1])
        loss.backward()
        ctx.optimizer_step()
        return loss

    model = tiny_model()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(3),
                      max_steps=3, train_step=own_backward, progress=False)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert trainer.fit_sync().steps == 3
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_the_context_names_the_runs_optimizer() -> None:
    seen: list[torch.optim.Optimizer] = []

    def step(ctx: TrainContext) -> torch.Tensor | None:
        seen.append(ctx.optimizer)
        return default_train_step(ctx)

    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = Trainer(model, opt, tiny_loader(2), loss_fn=F.cross_entropy, max_steps=2,
                      train_step=step, progress=False)  # fmt: skip
    trainer.fit_sync()
    assert seen == [opt, opt]


def test_optimizer_hooks_under_accumulation_see_the_last_micro_batch() -> None:
    seen: list[tuple[str, int, int]] = []
    model = tiny_model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(6),
                      loss_fn=F.cross_entropy, accumulate=3, max_epochs=1,
                      progress=False)  # fmt: skip
    for point in ("before_optimizer_step", "after_optimizer_step"):
        trainer.add_hook(point, lambda c, p=point: seen.append((p, c.micro_batch, c.batch_index)))
    trainer.fit_sync()
    assert seen == [("before_optimizer_step", 2, 2), ("after_optimizer_step", 2, 2),
                    ("before_optimizer_step", 2, 5), ("after_optimizer_step", 2, 5)]  # fmt: skip


def test_a_hook_that_returns_a_value_instead_of_setting_it_is_warned_once() -> None:
    model = tiny_model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(3),
                      loss_fn=F.cross_entropy, max_steps=3, progress=False)  # fmt: skip
    trainer.add_hook("loss", lambda ctx: ctx.loss * 2)  # meant: ctx.loss = ctx.loss * 2
    # A lambda's `a and b` at another point is an idiom, not a mistake: not warned.
    trainer.add_hook("after_optimizer_step", lambda ctx: ctx.step == 2 and ctx.log("x", 1.0))
    with pytest.warns(RuntimeWarning, match=r"the 'loss' hook .* returned a value, which "
                      r"trainbus ignores: set ctx.loss = \.\.\.") as record:  # fmt: skip
        trainer.fit_sync()
    assert [str(w.message)[:14] for w in record if "returned a value" in str(w.message)] == [
        "the 'loss' hoo"
    ]


def test_a_loss_backwarded_twice_is_told_to_call_backward_once() -> None:
    def twice(ctx: TrainContext) -> torch.Tensor:
        loss = F.cross_entropy(ctx.model(ctx.batch[0]), ctx.batch[1])
        ctx.backward(loss)
        ctx.backward(loss)
        ctx.optimizer_step()
        return loss

    model = tiny_model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(3),
                      max_steps=3, train_step=twice, progress=False)  # fmt: skip
    with pytest.raises(RuntimeError) as info:
        trainer.fit_sync()
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "raised in backward at step 0" in notes
    assert "already backwarded (ctx.backward or loss.backward() twice on one loss)" in notes


def test_a_step_with_its_own_optimizer_step_is_told_what_replaces_it() -> None:
    """A step written as a plain PyTorch loop body (``optimizer.step()`` of its own) never
    counts a step: the error names ``ctx.optimizer_step()`` and ``accumulate=`` as the fix."""

    def own_update(ctx: TrainContext) -> torch.Tensor:
        loss = F.cross_entropy(ctx.model(ctx.batch[0]), ctx.batch[1])
        loss.backward()
        ctx.optimizer.step()
        ctx.optimizer.zero_grad()
        return loss

    model = tiny_model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(4),
                      max_steps=2, train_step=own_update, progress=False)  # fmt: skip
    with pytest.raises(TrainingError, match=r"it replaces an optimizer\.step\(\) of your own, "
                       r"and Trainer\(accumulate=n\) an accumulation of your own"):  # fmt: skip
        trainer.fit_sync()


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize(
    ("given", "match"),
    [
        (lambda ctx: 1.0, r"must be a scalar tensor; got <class 'float'> at step 0"),
        (lambda ctx: "loss", r"must be a scalar tensor; got <class 'str'> at step 0"),
        (lambda ctx: torch.ones(3, requires_grad=True), r"got a tensor of shape \(3,\) at step 0"),
        (lambda ctx: ctx.compute_loss().detach(), r"does not require grad at step 0, epoch 0"),
    ],
    ids=["float", "str", "vector", "detached"],
)
def test_ctx_backward_of_what_is_not_a_loss_is_a_training_error(
    given: Any, match: str, accumulate: int
) -> None:
    """``ctx.backward`` given a number, a string, a vector or a detached loss: a
    ``TrainingError`` saying what a loss must be, caused by torch's own error."""

    def step(ctx: TrainContext) -> torch.Tensor:
        ctx.backward(given(ctx))
        ctx.optimizer_step()
        return torch.zeros(())

    model = tiny_model()
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        tiny_loader(4),
        loss_fn=F.cross_entropy,
        max_steps=1,
        accumulate=accumulate,
        train_step=step,
        progress=False,
    )
    with pytest.raises(TrainingError, match=match) as info:
        trainer.fit_sync()
    assert info.value.__cause__ is not None
    assert trainer.result is not None and trainer.result.reason == "failed"
