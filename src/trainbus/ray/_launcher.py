"""The Ray driver: a ``TorchTrainer`` run whose rank 0 streams to this process' bus."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread

from .._bus import EventBus
from .._distributed.protocol import ADDR_ENV, TOKEN_ENV
from .._exceptions import ConfigError, LaunchError, MissingExtraError
from .._launcher import DriverBase, LaunchResult, unknown_launcher_keyword
from .._log import get_logger
from .._signals import OnSignal
from .._validate import explains_unknown_keywords
from ..callbacks._base import Callback

__all__ = ["RayLaunchResult", "RayLauncher", "launch"]

log = get_logger(__name__)


def _require_ray(feature: str) -> Any:
    try:
        import ray
        import ray.train
        import ray.train.torch
    except ImportError as exc:
        raise MissingExtraError(feature, "ray[train]", "ray") from exc
    return ray


@dataclass(frozen=True, slots=True, kw_only=True)
class RayLaunchResult(LaunchResult):
    """A :class:`~trainbus.LaunchResult` (``returncode`` 0) plus Ray's own.

    Attributes:
        result: The ``ray.train.Result`` of ``TorchTrainer.fit()``.
        links: How many times rank 0 linked: 1, plus one per restart of the workers by Ray.
    """

    result: Any = None
    links: int = 1


class _WorkerEntry:
    """What every worker runs: ``train_fn`` with the driver's address and token in its
    environment (rank 0's Trainer links by itself)."""

    def __init__(self, train_fn: Callable[..., Any], address: str, token: str) -> None:
        self.train_fn = train_fn
        self.address = address
        self.token = token
        self.takes_config = _required_params(train_fn) == 1

    def __call__(self, config: dict[str, Any]) -> Any:
        import trainbus.ray  # noqa: F401  registers the "ray" transport in this worker

        from ._transport import register_worker

        if register_worker(self.address):  # a worker Ray started after the driver aborted
            log.warning("ray_worker_not_started", reason="the driver aborted the run")
            return None
        saved = {k: os.environ.get(k) for k in (ADDR_ENV, TOKEN_ENV)}
        os.environ[ADDR_ENV], os.environ[TOKEN_ENV] = self.address, self.token
        try:
            return self.train_fn(config) if self.takes_config else self.train_fn()
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def _required_params(fn: Callable[..., Any]) -> int:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 1
    return sum(
        1
        for p in params
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    )


class RayLauncher(DriverBase[RayLaunchResult]):
    """Runs ``train_fn`` on a Ray Train ``TorchTrainer``; rank 0's events feed :attr:`bus`.
    See docs/distributed.md ("Ray").

    Args:
        train_fn: The function every worker runs (no argument, or the ``config`` dict).
        scaling_config: A ``ray.train.ScalingConfig`` (workers, resources).
        run_config: A ``ray.train.RunConfig``, or None.
        train_loop_config: The dict ``train_fn`` receives, or None (an empty one).
        setup, callbacks, bus, keep_events, stop_timeout, on_signal: As
            :class:`~trainbus.Launcher`'s (a second signal kills the workers).

    Raises:
        MissingExtraError: Ray Train is not installed (``pip install 'trainbus[ray]'``).
        ConfigError: a bad argument, naming it.
        TypeError: an unknown keyword (``handle_signals``: naming ``on_signal``).
    """

    @explains_unknown_keywords(unknown_launcher_keyword("RayLauncher"))
    def __init__(
        self,
        train_fn: Callable[..., Any],
        *,
        scaling_config: Any,
        run_config: Any = None,
        train_loop_config: Mapping[str, Any] | None = None,
        setup: Callable[[EventBus], Any] | None = None,
        callbacks: Iterable[Callback | type[Callback]] = (),
        bus: EventBus | None = None,
        keep_events: int = 100,
        stop_timeout: float = 60.0,
        on_signal: OnSignal | None = "return",
    ) -> None:
        ray = _require_ray("trainbus.ray")
        if not callable(train_fn):
            raise ConfigError.invalid("train_fn", train_fn, "a function of 0 or 1 arguments")
        if _required_params(train_fn) > 1:
            raise ConfigError.invalid(
                "train_fn", train_fn, "a function of no argument or of the config dict"
            )
        if not isinstance(scaling_config, ray.train.ScalingConfig):
            raise ConfigError.invalid(
                "scaling_config",
                scaling_config,
                "a ray.train.ScalingConfig, e.g. ScalingConfig(num_workers=2)",
            )
        if run_config is not None and not isinstance(run_config, ray.train.RunConfig):
            raise ConfigError.invalid("run_config", run_config, "None or a ray.train.RunConfig")
        if train_loop_config is not None and not isinstance(train_loop_config, Mapping):
            raise ConfigError.invalid("train_loop_config", train_loop_config, "None or a dict")
        super().__init__(
            callbacks=callbacks,
            setup=setup,
            bus=bus,
            stop_timeout=stop_timeout,
            keep_events=keep_events,
            on_signal=on_signal,
        )
        self.train_fn = train_fn
        self.scaling_config = scaling_config
        self.run_config = run_config
        self.train_loop_config = dict(train_loop_config or {})
        self._aborted = False  # the workers were killed (second signal, stop_timeout passed)
        self._driver: Any = None  # the RayDriver while launched

    async def launch(self) -> RayLaunchResult:
        """Run the ``TorchTrainer`` (``ray.init()`` first if needed), serve rank 0's link, and
        wait until it ends.

        Returns:
            The :class:`RayLaunchResult`.

        Raises:
            LaunchError: Ray reported the training failed, no worker linked (``train_fn`` never
                built a Trainer), or the workers were killed (a second signal; ``signal`` says
                which).
            Exception: a driver subscriber with ``on_error="raise"`` failed: its own exception
                (the workers are stopped first).
        """
        ray = _require_ray("trainbus.ray")
        from ray.train.torch import TorchTrainer

        from ._transport import RayDriver

        if not ray.is_initialized():
            await anyio.to_thread.run_sync(ray.init)
        # relink: after a failure Ray restarts the worker group (FailureConfig.max_failures);
        # the new rank 0 links again and the driver's bus goes on, one run for one launch.
        link = self._open_link(relink=True)
        driver = self._driver = await RayDriver.start()
        trainer = TorchTrainer(
            _WorkerEntry(self.train_fn, driver.address, self._token),
            scaling_config=self.scaling_config,
            run_config=self.run_config,
            train_loop_config=self.train_loop_config,
        )
        failure: BaseException | None = None
        result: Any = None
        try:
            async with self.bus, anyio.create_task_group() as tg:
                self._serve(tg, link, driver.serve, driver.send)
                log.info(
                    "launch_started",
                    workers=self.scaling_config.num_workers,
                    address=driver.address,
                )
                try:
                    result = await anyio.to_thread.run_sync(trainer.fit, abandon_on_cancel=True)
                except Exception as exc:  # Ray's TrainingFailedError and kin
                    failure = exc
                await self._drain(link, tg)
        finally:
            with anyio.CancelScope(shield=True):
                await driver.aclose()
        if self._aborted:
            raise self._failure(
                "the workers were killed (a second signal, or the graceful "
                f"stop took longer than stop_timeout={self.stop_timeout} s)"
            ) from failure
        if failure is not None:
            raise self._failure(f"Ray reported the training failed: {failure}") from failure
        if not link.linked:
            raise self._failure(
                "the Ray workers finished but no worker linked to the driver: train_fn must "
                "build a trainbus Trainer and call its run() or fit() (rank 0 links then)"
            )
        self._raise_if_interrupted()
        return RayLaunchResult(returncode=0, result=result, links=link.links, **self._outcome())

    def _failure(self, what: str) -> LaunchError:
        assert self._link is not None
        if self._link.linked:
            what += f"; {self._so_far()}"
        return LaunchError(what, returncode=None, **self._outcome())

    async def _abort(self) -> None:
        """Kill the workers (Ray then ends the run as failed)."""
        if self._driver is None or self._aborted:
            return
        self._aborted = True
        killed = await self._driver.abort_workers()
        log.warning("launch_workers_killed", workers=killed)


def launch(
    train_fn: Callable[..., Any], *, backend: str = "asyncio", **kwargs: Any
) -> RayLaunchResult:
    """Run ``train_fn`` on Ray Train with the subscribers in this process: a
    :class:`RayLauncher` (same arguments) run to the end.

    Returns:
        The :class:`RayLaunchResult` (``result``: Ray's ``Result``).

    Raises:
        MissingExtraError: Ray Train is not installed.
        ConfigError: a bad argument.
        LaunchError: see :meth:`RayLauncher.launch`.
    """
    return RayLauncher(train_fn, **kwargs).run(backend=backend)
