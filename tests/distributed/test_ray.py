"""trainbus.ray end to end on a local Ray (2 workers of 1 CPU, gloo): the same Trainer code
as under torchrun, its rank 0 streaming to the driver's bus, the driver's commands applied on
every rank at the same step. Few runs (each starts a Ray Train worker group), bounded."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import structlog

from trainbus import ConfigError, EventBus, LaunchError, MissingExtraError
from trainbus import commands as cmd
from trainbus import events as ev

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
    # Ray Train copies Ray Data's context, whose setter warns about its own deprecated names.
    pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.data.context"),
]


def train_fn(config: dict[str, Any]) -> None:
    """What every Ray Train worker runs: a plain Trainer script."""
    import torch
    from torch import nn
    from torch.nn import functional as F
    from torch.utils.data import DataLoader, Dataset

    import trainbus
    import trainbus.ray

    class Indexed(Dataset[tuple[torch.Tensor, torch.Tensor]]):
        def __init__(self) -> None:
            g = torch.Generator().manual_seed(0)
            self.x, self.y = (
                torch.randn(64, 8, generator=g),
                torch.randint(0, 3, (64,), generator=g),
            )
            self.seen: list[int] = []

        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            self.seen.append(int(i))
            return self.x[i], self.y[i]

    data = Indexed()
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    t = trainbus.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                         DataLoader(data, batch_size=4, shuffle=True), loss_fn=F.cross_entropy,
                         max_epochs=config["epochs"], log_every=3, seed=0, progress=False,
                         checkpoint_dir=config["ckpt"], on_signal=None,
                         callbacks=[report := trainbus.ray.ReportToRay()])  # fmt: skip
    saved: list[str] = []
    t.bus.stream(ev.CheckpointSaved).subscribe(lambda e: saved.append(e.tag), ranks="all")
    r = t.fit_sync()
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    out = {"rank": t.bus.rank, "steps": r.steps, "reason": r.reason,
           "stop_reason": r.stop_reason, "digest": h.hexdigest(), "seen": data.seen,
           "saved": saved, "reports": report.reports}  # fmt: skip
    (Path(config["out"]) / f"rank{t.bus.rank}.json").write_text(json.dumps(out))


def restart_fn(config: dict[str, Any]) -> None:
    """Two epochs, a checkpoint every 4 steps reported to Ray, ``resume="latest"``; with
    ``config["crash"]`` one rank fails once at step 10 (a marker file makes it once):
    ``"raise"`` (rank 0 raises from a hook) or ``"exit"`` (rank 1's process dies)."""
    import os
    import time

    import torch
    from torch import nn
    from torch.nn import functional as F
    from torch.utils.data import DataLoader, TensorDataset

    import trainbus
    import trainbus.ray
    from trainbus.callbacks import Checkpointing

    class Crash(trainbus.Callback):
        def hook_after_optimizer_step(self, ctx: Any) -> None:
            crash, marker = config.get("crash"), Path(config["out"]) / "crashed"
            rank = 0 if crash == "raise" else 1
            if crash is None or ctx.step != 10 or t.bus.rank != rank or marker.exists():
                return
            marker.touch()
            # Fail once Ray holds the step-8 checkpoint (reported at steps 4 and 8 by
            # ReportToRay on its own thread): what it hands the restarted workers is known.
            import ray.train

            while report.reports < 2:
                time.sleep(0.01)
            ray.train.get_all_reported_checkpoints()  # waits for Ray to take in the reports
            if crash == "raise":
                raise RuntimeError("boom at step 10")
            os._exit(1)

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g))
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    t = trainbus.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                         DataLoader(data, batch_size=4, shuffle=True), loss_fn=F.cross_entropy,
                         max_epochs=2, seed=0, progress=False, checkpoint_dir=config["ckpt"],
                         on_signal=None,
                         callbacks=[Checkpointing(every_steps=4),
                                    report := trainbus.ray.ReportToRay(), Crash()])  # fmt: skip
    r = t.fit_sync(resume="latest")
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    out = {"steps": r.steps, "digest": h.hexdigest(), "resumed_from": r.resumed_from}
    (Path(config["out"]) / f"rank{t.bus.rank}.json").write_text(json.dumps(out))


def no_trainer(config: dict[str, Any]) -> None:
    """A train function that never builds a Trainer."""


@pytest.fixture
def ray_train(ray_cluster: Any) -> Any:
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
    from ray.train import RunConfig, ScalingConfig

    return ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}), RunConfig


@pytest.mark.asyncio
async def test_driver_sees_the_run_and_its_commands_reach_every_rank_at_the_same_step(
    ray_train: Any, tmp_path: Path
) -> None:
    import trainbus.ray

    scaling, run_config = ray_train
    answers: list[Any] = []
    received: list[ev.BaseEvent] = []

    def setup(bus: EventBus) -> None:
        bus.events.subscribe(received.append)

        async def steer(e: ev.StepEnded) -> None:  # an async driver subscriber, request()
            if e.step == 4:
                answers.append(await bus.request(cmd.SaveCheckpoint(tag="from-driver")))
                bus.send(cmd.StopTraining(reason="driver"))

        bus.subscribe_async(bus.stream(ev.StepEnded), steer)

    launcher = trainbus.ray.RayLauncher(
        train_fn, scaling_config=scaling, setup=setup,
        run_config=run_config(storage_path=str(tmp_path / "ray"), name="parity"),
        train_loop_config={"epochs": 20, "ckpt": str(tmp_path / "ckpt"), "out": str(tmp_path)},
    )  # fmt: skip
    result = await launcher.launch()
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    # Distinct shards, identical parameters (DDP), the same stop step on every rank.
    first_epoch = [r["seen"][:32] for r in ranks]  # 64 samples, 2 ranks: 32 each per epoch
    assert set(first_epoch[0]).isdisjoint(first_epoch[1]) and len(set(first_epoch[0])) > 4
    assert ranks[0]["digest"] == ranks[1]["digest"]
    assert ranks[0]["steps"] == ranks[1]["steps"] < 20 * 8
    assert [r["reason"] for r in ranks] == ["stopped", "stopped"]
    assert [r["stop_reason"] for r in ranks] == ["driver", "driver"]
    # The driver's request() resolved with the checkpoint every rank saw saved.
    (answer,) = answers
    assert isinstance(answer, ev.CheckpointSaved) and answer.tag == "from-driver"
    assert Path(answer.path).is_file()  # noqa: ASYNC240
    assert all("from-driver" in r["saved"] for r in ranks)
    # ReportToRay: every rank reported at every checkpoint (the driver's and the final one),
    # the same number of times; Ray's Result holds the latest checkpoint and its metrics.
    assert ranks[0]["reports"] == ranks[1]["reports"] == len(ranks[0]["saved"]) >= 1
    # The driver saw rank 0's run, in order, and the result says how it ended.
    (started,) = [e for e in received if isinstance(e, ev.FitStarted)]
    assert started.world_size == 2 and started.rank == 0
    assert isinstance(received[-1], ev.FitEnded) and received[-1].step == ranks[0]["steps"]
    steps = [e.step for e in received if isinstance(e, ev.StepEnded)]
    assert steps == list(range(1, len(steps) + 1))
    assert result.received == len(received) and result.last_event == received[-1]
    assert result.stop_reason == "driver" and result.returncode == 0
    assert result.result is not None and result.result.error is None
    assert result.result.checkpoint is not None
    assert result.result.metrics["step"] == ranks[0]["steps"]


@pytest.mark.asyncio
async def test_a_train_fn_that_never_builds_a_trainer_is_a_clear_error(
    ray_train: Any, tmp_path: Path
) -> None:
    import trainbus.ray

    scaling, run_config = ray_train
    launcher = trainbus.ray.RayLauncher(
        no_trainer, scaling_config=scaling,
        run_config=run_config(storage_path=str(tmp_path / "ray"), name="none"),
    )  # fmt: skip
    with pytest.raises(LaunchError, match="no worker linked to the driver"):
        await launcher.launch()


def test_a_ray_data_shard_is_already_sharded(ray_cluster: Any) -> None:
    import ray.data
    import torch

    from trainbus._distributed.data import shard_loader
    from trainbus._distributed.group import ProcessGroup

    group = ProcessGroup(rank=1, world_size=2, local_rank=1, backend="gloo",
                         device=torch.device("cpu"), created=False)  # fmt: skip
    shard = ray.data.range(8).iterator()
    batches = shard.iter_torch_batches(batch_size=4)
    with structlog.testing.capture_logs() as logs:
        for data in (shard, batches, [1, 2]):
            assert shard_loader(data, group, seed=0, train=True) is data
    warned = [e["kind"] for e in logs if e["event"] == "data_not_sharded"]
    assert warned == ["list"]  # the plain list only: Ray Data's shards are this rank's rows


@pytest.mark.asyncio
async def test_a_driver_subscriber_that_raises_stops_the_workers_and_the_launch_raises_it(
    ray_train: Any, tmp_path: Path
) -> None:
    import trainbus.ray

    scaling, run_config = ray_train

    def boom(e: ev.StepEnded) -> None:
        if e.step == 3:
            raise RuntimeError("driver-side bug")

    launcher = trainbus.ray.RayLauncher(
        train_fn, scaling_config=scaling,
        setup=lambda bus: bus.stream(ev.StepEnded).subscribe(boom, on_error="raise"),
        run_config=run_config(storage_path=str(tmp_path / "ray"), name="raise"),
        train_loop_config={"epochs": 200, "ckpt": str(tmp_path / "ckpt"), "out": str(tmp_path)},
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="driver-side bug"):
        await launcher.launch()
    # Stopped, not killed: every rank ended its run at the same step, long before its end.
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["reason"] for r in ranks] == ["stopped", "stopped"]
    assert [r["stop_reason"] for r in ranks] == ["driver_subscriber_failed"] * 2
    assert ranks[0]["steps"] == ranks[1]["steps"] < 200 * 8


def test_bad_arguments(ray_cluster: Any) -> None:
    from ray.train import ScalingConfig

    import trainbus.ray

    with pytest.raises(ConfigError, match="scaling_config"):
        trainbus.ray.RayLauncher(train_fn, scaling_config={"num_workers": 2})
    with pytest.raises(ConfigError, match="train_fn"):
        trainbus.ray.RayLauncher(lambda a, b: None, scaling_config=ScalingConfig(num_workers=1))
    with pytest.raises(ConfigError, match="run_config"):
        trainbus.ray.RayLauncher(train_fn, scaling_config=ScalingConfig(num_workers=1),
                                 run_config="fast")  # fmt: skip
    with pytest.raises(ConfigError, match="on_signal"):
        trainbus.ray.RayLauncher(train_fn, scaling_config=ScalingConfig(num_workers=1),
                                 on_signal="ignore")  # type: ignore[arg-type]  # fmt: skip


def test_handle_signals_is_a_type_error_naming_on_signal(ray_cluster: Any) -> None:
    """The Trainer's spelling on every launcher: ``on_signal="raise" | "return" | None``."""
    from ray.train import ScalingConfig

    import trainbus.ray

    with pytest.raises(TypeError, match=r"RayLauncher\(\) got an unexpected keyword argument "
                                        r"'handle_signals': on_signal=None"):  # fmt: skip
        trainbus.ray.RayLauncher(train_fn, scaling_config=ScalingConfig(num_workers=1),
                                 handle_signals=False)  # type: ignore[call-arg]  # fmt: skip


def test_without_ray_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import trainbus.ray

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(MissingExtraError, match=r"pip install 'trainbus\[ray\]'"):
        trainbus.ray.launch(train_fn, scaling_config=object())


def restart_launch(scaling: Any, tmp_path: Path, crash: str | None) -> tuple[Any, list[Any]]:
    """``restart_fn`` launched with ``FailureConfig(max_failures=1)``: (result, the driver's
    FitStarted and WorkersRestarted events)."""
    from ray.train import FailureConfig, RunConfig

    import trainbus.ray

    seen: list[Any] = []

    def setup(bus: EventBus) -> None:
        bus.stream(ev.FitStarted, ev.WorkersRestarted).subscribe(seen.append)

    result = trainbus.ray.launch(
        restart_fn, scaling_config=scaling, setup=setup,
        run_config=RunConfig(storage_path=str(tmp_path / "ray"), name=f"restart-{crash}",
                             failure_config=FailureConfig(max_failures=1)),
        train_loop_config={"ckpt": str(tmp_path / "ckpt"), "out": str(tmp_path),
                           "crash": crash},
    )  # fmt: skip
    return result, seen


def rank_files(folder: Path) -> list[dict[str, Any]]:
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.fixture(scope="module")
def uninterrupted(ray_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The parameters' digest of ``restart_fn`` run through without a failure."""
    from ray import cloudpickle
    from ray.train import ScalingConfig

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    folder = tmp_path_factory.mktemp("uninterrupted")
    scaling = ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1})
    result, seen = restart_launch(scaling, folder, None)
    ranks = rank_files(folder)
    assert result.links == 1 and not any(isinstance(e, ev.WorkersRestarted) for e in seen)
    assert ranks[0]["steps"] == 16 and ranks[0]["digest"] == ranks[1]["digest"]
    return str(ranks[0]["digest"])


@pytest.mark.parametrize("crash", ["raise", "exit"])
def test_a_restart_by_ray_resumes_from_rays_checkpoint_and_ends_as_an_uninterrupted_run(
    ray_train: Any, uninterrupted: str, tmp_path: Path, crash: str
) -> None:
    # One rank fails at step 10 (rank 0 raises, or rank 1's process dies); Ray restarts the
    # worker group; the new workers resume from the checkpoint Ray hands them (step 8,
    # reported by ReportToRay), and the run ends bit-identical to one that never failed.
    scaling, _ = ray_train
    result, seen = restart_launch(scaling, tmp_path, crash)
    assert (tmp_path / "crashed").exists()
    ranks = rank_files(tmp_path)
    assert [r["digest"] for r in ranks] == [uninterrupted, uninterrupted]
    assert [r["steps"] for r in ranks] == [16, 16]
    # The driver's bus lived across the restart: one launch, two links, one restart event
    # between the attempts' FitStarted, the second resumed from Ray's checkpoint of step 8.
    assert result.links == 2 and result.returncode == 0
    kinds = [type(e).__name__ for e in seen]
    assert kinds == ["FitStarted", "WorkersRestarted", "FitStarted"], kinds
    first, restart, second = seen
    assert first.resumed_from is None and first.resume_source is None
    assert restart.attempt == 2 and 8 <= restart.step <= 10
    if crash == "raise":
        assert restart.reason is not None and "boom at step 10" in restart.reason
    assert second.resume_source == "ray" and second.step == 8
    assert second.resumed_from is not None and str(tmp_path / "ray") in second.resumed_from
    assert ranks[0]["resumed_from"] == second.resumed_from
