"""Poll points and command application: how the loop obeys the back-channel (docs/bus.md);
the cancel and stop flags that end a run."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, assert_never

from .. import commands as cmd
from .. import events as ev
from .._exceptions import CheckpointError, ConfigError

if TYPE_CHECKING:
    from .._bus import LoopPort
    from .._bus.commands import Doorbell
    from .._distributed.sync import RankSync
    from ..checkpoint import TrainState
    from .evaluation import Evaluator
    from .saving import CheckpointWriter
    from .settings import Settings

__all__ = ["BarrierWait", "CommandHandler", "RunStop"]

# wait(event or None at the end, resume) -> "done", "timeout" or "request" (then resume=True)
BarrierWait = Callable[[ev.BaseEvent | None, bool], str]

_MAX_ROUNDS = 100  # drains of the commands sent while commands are applied


class RunStop:
    """Whether the run stops (``reason``: the first one given); a stop rings the doorbell."""

    __slots__ = ("_doorbell", "reason")

    def __init__(self, doorbell: Doorbell) -> None:
        self._doorbell = doorbell
        self.reason: str | None = None

    def stop(self, reason: str) -> None:
        self.reason = self.reason or reason
        self._doorbell.ring()


class CommandHandler:
    """Applies the commands at the loop's poll points (docs/bus.md; under torchrun only at
    the points every rank reaches: docs/distributed.md)."""

    def __init__(
        self,
        settings: Settings,
        port: LoopPort,
        state: TrainState,
        *,
        wait_barrier: BarrierWait,
        check_cancel: Callable[[], None],
        checkpoints: CheckpointWriter,
        evaluator: Evaluator,
        sync: RankSync | None = None,
        log_metric: Callable[[str, float], None],
        stop: RunStop,
    ) -> None:
        self._s, self._port, self._state = settings, port, state
        self._log_metric = log_metric
        self._wait_barrier, self._check_cancel = wait_barrier, check_cancel
        self._checkpoints, self._evaluator = checkpoints, evaluator
        self._sync = sync
        self._stop = stop
        self.stop_epoch = False  # a StopEpoch arrived in this epoch

    def begin_epoch(self) -> None:
        self.stop_epoch = False

    def barrier_then_poll(
        self, event: ev.BaseEvent | None, *earlier: ev.BaseEvent, common: bool = False
    ) -> None:
        """Wait at ``earlier`` then ``event`` where they are barrier types, then poll."""
        for e in (*earlier, event):
            if e is None or type(e) in self._s.barriers:
                self._barrier(e)
        self.poll(common=common)

    def decide(
        self, ended: ev.StepEnded | None, barrier: ev.BaseEvent | None, *, common: bool
    ) -> None:
        """A decision step: wait at its ``barrier`` event, then at its ``StepEnded`` (None:
        everything published), then poll."""
        if barrier is not None:
            self._barrier(barrier)
        if barrier is None or (ended is not None and ended is not barrier):
            self._barrier(ended)
        self.poll(common=common)

    def _barrier(self, event: ev.BaseEvent | None) -> None:
        # A request is applied during the wait (under torchrun: at the next common point).
        status = self._wait_barrier(event, False)
        while status == "request" and self._sync is None:
            self.poll()
            status = self._wait_barrier(event, True)

    def poll(self, *, common: bool = False) -> None:
        """Wait for room in a full ``"block"`` buffer, raise a failure or the cancel, apply the
        commands (under torchrun only when ``common``)."""
        port = self._port
        if port.held and self._stop.reason is None:
            port.wait_for_room()
        failure = port.failure
        if failure is not None:
            raise failure
        self._check_cancel()
        if self._sync is not None:
            if common:
                self.agree()
            return
        rounds = 0
        while port.has_commands() and rounds < _MAX_ROUNDS:
            rounds += 1
            for command in port.poll_commands():
                self.apply(command)

    def agree(self) -> None:
        """Apply the commands every rank agreed on (one collective round)."""
        assert self._sync is not None
        for command in self._sync.agree(self._port.poll_commands()):
            self.apply(command)

    def apply(self, command: cmd.Command) -> None:
        """Apply one command and publish ``CommandApplied`` (with the error of a refusal)."""
        st = self._state
        result: ev.BaseEvent | None = None
        error: BaseException | None = None
        try:
            match command:
                case cmd.StopTraining(reason=reason):
                    self._stop.stop(reason)
                case cmd.StopEpoch():
                    self.stop_epoch = True
                case cmd.SaveCheckpoint(tag=tag):
                    result = self._checkpoints.save_once(tag, self._evaluator.metrics)
                case cmd.Evaluate():
                    if self._s.eval_data is None:
                        raise ConfigError.invalid("eval_data", None, "data to evaluate on")
                    ends = self._evaluator.last_ends
                    if st.evaluated_step != st.step or not ends:
                        ends = self._evaluator.run(("command",))
                        # applied on every rank alike
                        self.barrier_then_poll(ends[-1], *ends[:-1], common=True)
                    # else: answered with this step's evaluation, not run again
                    result = ends[0] if len(ends) == 1 else self._evaluator.last_round
                case cmd.SetLearningRate(lr=lr, param_group=group, optimizer=name):
                    for g in self._groups(group, name):
                        g["lr"] = lr
                case cmd.ScaleLearningRate(factor=factor, param_group=group, optimizer=name):
                    for g in self._groups(group, name):
                        g["lr"] = g["lr"] * factor
                case cmd.LogMetric(name=name, value=value):
                    self._log_metric(name, value)
                case _:
                    assert_never(command)
        except (ConfigError, CheckpointError, OSError) as exc:  # refused: never kills the run
            error = exc
        self._port.publish(
            ev.CommandApplied(
                step=st.step, epoch=st.epoch, command=command, result=result, error=error
            )
        )

    def _groups(self, group: int | None, optimizer: str | None) -> list[dict[str, Any]]:
        """The parameter groups a learning-rate command sets."""
        opts = self._s.optimizers
        if optimizer is not None and optimizer not in opts:
            allowed = "one of the optimizers: " + ", ".join(map(repr, opts))
            raise ConfigError.invalid("optimizer", optimizer, allowed)
        groups = (self._s.optimizer if optimizer is None else opts[optimizer]).param_groups
        if group is None:
            return list(groups)
        if group >= len(groups):
            raise ConfigError.invalid("param_group", group, f"an index below {len(groups)}")
        return [groups[group]]
