"""Evaluation jobs on every checkpoint: a command line or an async function per ``CheckpointSaved``,
run while training goes on, reported back on the bus as ``ExternalEvaluationEnded``."""

from __future__ import annotations

import inspect
import json
import math
import os
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import anyio

from .. import events as ev
from .._exceptions import ConfigError, EvaluationJobError
from .._log import get_logger
from .._validate import check_int, check_optional_seconds
from ._base import Callback

if TYPE_CHECKING:
    from .._bus import EventBus

__all__ = ["EvaluateCheckpoints", "EvaluationFn"]

log = get_logger(__name__)

EvaluationFn: TypeAlias = Callable[[ev.CheckpointSaved], Awaitable[Mapping[str, float]]]
"""``async def fn(event: CheckpointSaved) -> Mapping[str, float]``."""

_STDERR_LINES = 20
_FIELD = re.compile(r"\{(checkpoint|step|epoch)\}")


def _metrics(value: object, source: str, **context: Any) -> dict[str, float]:
    """``value`` as metrics, else an ``EvaluationJobError`` saying what ``source`` gave."""
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise EvaluationJobError(
            f"{source} gave {value!r}, not a mapping of metric names to numbers", **context
        )
    for k, v in value.items():
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise EvaluationJobError(f"{source} gave metric {k}={v!r}, not a number", **context)
    return {k: float(v) for k, v in value.items()}


class EvaluateCheckpoints(Callback):
    """Runs an evaluation job for every saved checkpoint, off the training loop, and publishes
    its result as ``ExternalEvaluationEnded(checkpoint, metrics, error)``. See
    docs/callbacks/evaluate.md.

    Args:
        run: A command line (a non-empty list of strings in which ``{checkpoint}``, ``{step}``
            and ``{epoch}`` are replaced, run without a shell, printing a JSON object of
            metrics) or an ``async def fn(event) -> Mapping[str, float]``.
        concurrency: Jobs running at once (>= 1).
        timeout: Seconds a job may run before it is cancelled (the process killed) and
            reported as timed out; None for no limit.
        buffer: Checkpoints that may wait for a free job slot (>= 1); beyond that the bus
            waits (nothing is skipped).
        cwd: Working directory of the command (default: the current one).

    Raises:
        ConfigError: for a ``run`` that is neither, or an option out of range.
    """

    publishes = (ev.ExternalEvaluationEnded,)

    def __init__(
        self,
        run: Sequence[str] | EvaluationFn,
        *,
        concurrency: int = 1,
        timeout: float | None = None,
        buffer: int = 16,
        cwd: str | os.PathLike[str] | None = None,
    ) -> None:
        if isinstance(run, str) or not (
            inspect.iscoroutinefunction(run)
            or (isinstance(run, Sequence) and len(run) > 0 and all(isinstance(a, str) for a in run))
        ):
            raise ConfigError.invalid(
                "run",
                run,
                "a command as a list of strings (e.g. ['python', 'eval.py', "
                "'{checkpoint}']) or an async def fn(event) -> Mapping[str, float]",
            )
        self.run: tuple[str, ...] | EvaluationFn = (
            run if inspect.iscoroutinefunction(run) else tuple(run)  # type: ignore[arg-type]
        )
        self.jobs = check_int("concurrency", concurrency, 1)
        self.timeout = check_optional_seconds("timeout", timeout)
        self.job_buffer = check_int("buffer", buffer, 1)
        self.cwd = None if cwd is None else os.fspath(cwd)
        self._results: list[ev.ExternalEvaluationEnded] = []

    @property
    def results(self) -> tuple[ev.ExternalEvaluationEnded, ...]:
        """Every job's result so far, in the order the jobs ended (all runs of this instance)."""
        return tuple(self._results)

    def setup(self, bus: EventBus) -> None:
        """Subscribe the job runner to ``CheckpointSaved``."""

        async def job(saved: ev.CheckpointSaved) -> None:
            result = await self.evaluate(saved)
            self._results.append(result)
            failed = result.error is not None
            (log.warning if failed else log.info)(
                "external_evaluation_ended",
                step=result.step,
                epoch=result.epoch,
                checkpoint=result.checkpoint,
                **({"error": str(result.error)} if failed else dict(result.metrics)),
            )
            if bus.state == "running":
                bus.publish(result)
            else:  # the bus completed its streams: nobody could receive it
                log.warning(
                    "external_evaluation_not_delivered",
                    checkpoint=result.checkpoint,
                    reason="the run had ended",
                )

        bus.subscribe_async(
            bus.stream(ev.CheckpointSaved),
            job,
            concurrency=self.jobs,
            buffer=self.job_buffer,
            overflow="block",
            name="EvaluateCheckpoints",
        )

    async def evaluate(self, saved: ev.CheckpointSaved) -> ev.ExternalEvaluationEnded:
        """Run the job for ``saved`` (a failure is the event's ``error``, never raised).

        Args:
            saved: The checkpoint to evaluate.

        Returns:
            ``ExternalEvaluationEnded`` with the checkpoint's step and epoch.
        """
        metrics: Mapping[str, float] = {}
        error: BaseException | None = None
        with anyio.move_on_after(math.inf if self.timeout is None else self.timeout) as scope:
            try:
                metrics = await self._job(saved)
            except EvaluationJobError as exc:
                error = exc
            except Exception as exc:  # the user's function failed: report, never fail the run
                error = EvaluationJobError(
                    f"the evaluation function raised {exc!r}", checkpoint=saved.path
                )
                error.__cause__ = exc
        if scope.cancelled_caught:
            error = EvaluationJobError(
                f"the evaluation job timed out after {self.timeout} s", checkpoint=saved.path
            )
        return ev.ExternalEvaluationEnded(
            step=saved.step,
            epoch=saved.epoch,
            checkpoint=saved.path,
            metrics=metrics if error is None else {},
            error=error,
        )

    async def _job(self, saved: ev.CheckpointSaved) -> dict[str, float]:
        if not isinstance(self.run, tuple):
            return _metrics(await self.run(saved), "the evaluation function", checkpoint=saved.path)
        fields = {"checkpoint": saved.path, "step": str(saved.step), "epoch": str(saved.epoch)}
        args = [_FIELD.sub(lambda m: fields[m[1]], a) for a in self.run]
        try:
            done = await anyio.run_process(args, check=False, cwd=self.cwd)
        except OSError as exc:  # command not found, not executable
            raise EvaluationJobError(
                f"could not start {args[0]!r}: {exc}", checkpoint=saved.path
            ) from exc
        stderr = (done.stderr or b"").decode("utf-8", errors="replace").rstrip()
        tail = "\n".join(stderr.splitlines()[-_STDERR_LINES:])
        context: dict[str, Any] = {
            "checkpoint": saved.path,
            "returncode": done.returncode,
            "stderr": tail,
        }
        if done.returncode != 0:
            raise EvaluationJobError(f"{args[0]!r} exited with status {done.returncode}", **context)
        # The JSON object printed: the whole stdout, else its last line (a job may log first).
        text = done.stdout.decode("utf-8", errors="replace").strip()
        for candidate in [text, text.splitlines()[-1]] if text else []:
            try:
                value = json.loads(candidate)
            except ValueError:
                continue
            return _metrics(value, "the command's JSON", **context)
        raise EvaluationJobError(
            f"the command printed no JSON object of metrics; last output: {text[-200:]!r}",
            **context,
        )
