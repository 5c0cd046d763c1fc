"""What a checkpoint holds: :func:`build_payload`'s dict of tensors and plain containers only,
so it loads with ``torch.load(weights_only=True)``, which cannot run code from the file;
:func:`parse_payload` checks it back into a :class:`Checkpoint`."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from importlib import metadata
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar

import torch

from .._exceptions import CheckpointError, ConfigError
from ._rng import restore_rng

__all__ = [
    "FORMAT_VERSION",
    "Checkpoint",
    "TrainState",
    "build_payload",
    "check_plain",
    "parse_payload",
    "restore_scheduler_scaler",
]

_MAGIC = "trainbus-checkpoint"
FORMAT_VERSION = 2
"""1: trainbus 0.1 before the weights_only format (pickled Python RNG state); 2: this one."""

_PLAIN = (int, float, str, bool, type(None), torch.Tensor)

# Checkpoints write the original module's parameter names, without the ``_orig_mod`` parts
# torch.compile adds, and loading maps them onto the live model's: a compiled run's checkpoint
# loads into the plain model and back.
_WRAPPER = "_orig_mod"
V = TypeVar("V")


def canonical_key(key: str) -> str:
    """``key`` without its ``_orig_mod`` parts (``"_orig_mod.0.weight"`` -> ``"0.weight"``)."""
    if _WRAPPER not in key:
        return key
    return ".".join(part for part in key.split(".") if part != _WRAPPER)


def canonical_names(items: Iterable[tuple[str, V]]) -> dict[str, V]:
    """``{canonical_key(name): value}`` for ``(name, value)`` pairs."""
    return {canonical_key(name): value for name, value in items}


def canonical_state(state: Mapping[str, Any]) -> OrderedDict[str, Any]:
    """A model's ``state_dict()`` (and its ``_metadata``) under canonical keys."""
    return _rekeyed(state, canonical_key, canonical_key)


def live_state(saved: Mapping[str, Any], model: torch.nn.Module) -> Mapping[str, Any]:
    """A saved state dict keyed as ``model`` names its entries (a key it lacks stays)."""
    live_keys = list(model.state_dict().keys())
    if set(saved) == set(live_keys):
        return saved
    to_live = {canonical_key(k): k for k in live_keys}
    prefixes = {canonical_key(name): name for name, _ in model.named_modules()}
    return _rekeyed(
        saved,
        lambda k: to_live.get(canonical_key(k), canonical_key(k)),
        lambda k: prefixes.get(canonical_key(k), k),
    )


def _rekeyed(
    state: Mapping[str, Any], key: Callable[[str], str], meta_key: Callable[[str], str]
) -> OrderedDict[str, Any]:
    """``state`` with each key mapped by ``key`` and its ``_metadata``'s by ``meta_key``."""
    out: OrderedDict[str, Any] = OrderedDict((key(k), v) for k, v in state.items())
    meta = getattr(state, "_metadata", None)
    if meta is not None:
        out._metadata = OrderedDict((meta_key(k), v) for k, v in meta.items())  # type: ignore[attr-defined]
    return out


class TrainState:
    """Where the loop is: enough to resume exactly. Each keyword argument sets the read-only
    property of its name; the position advances only through the methods below."""

    __slots__ = (
        "_batch_in_epoch",
        "_closed_epoch",
        "_epoch",
        "_evaluated_step",
        "_samples_seen",
        "_step",
    )

    FIELDS = ("step", "epoch", "batch_in_epoch", "samples_seen", "evaluated_step", "closed_epoch")
    """The names :meth:`as_dict` writes and :meth:`from_dict` expects, in order."""

    OPTIONAL: Mapping[str, int] = MappingProxyType({"evaluated_step": -1, "closed_epoch": -1})
    """Fields a checkpoint of an earlier version lacks, with the value read for them."""

    def __init__(
        self,
        *,
        step: int = 0,
        epoch: int = 0,
        batch_in_epoch: int = 0,
        samples_seen: int = 0,
        evaluated_step: int = -1,
        closed_epoch: int = -1,
    ) -> None:
        self._step, self._epoch = step, epoch
        self._batch_in_epoch, self._samples_seen = batch_in_epoch, samples_seen
        self._evaluated_step, self._closed_epoch = evaluated_step, closed_epoch

    @property
    def step(self) -> int:
        """Optimizer steps completed."""
        return self._step

    @property
    def epoch(self) -> int:
        """The epoch in progress (or about to start)."""
        return self._epoch

    @property
    def batch_in_epoch(self) -> int:
        """Training batches of ``epoch`` already consumed."""
        return self._batch_in_epoch

    @property
    def samples_seen(self) -> int:
        """Training samples consumed since the run began (across resumes)."""
        return self._samples_seen

    @property
    def evaluated_step(self) -> int:
        """The step whose evaluation round ran last (-1: none yet): a step is evaluated once,
        also across a resume."""
        return self._evaluated_step

    def evaluated(self) -> None:
        """An evaluation round of the current step ran."""
        self._evaluated_step = self._step

    @property
    def closed_epoch(self) -> int:
        """The last epoch whose end work ran (-1: none yet); equal to :attr:`epoch`, a resume
        starts the next epoch."""
        return self._closed_epoch

    def epoch_closed(self) -> None:
        """The current epoch's end work (evaluation, epoch scheduler step) ran."""
        self._closed_epoch = self._epoch

    def batch_taken(self) -> int:
        """A training batch was fetched: count it; return its index in the epoch."""
        bi = self._batch_in_epoch
        self._batch_in_epoch = bi + 1
        return bi

    def samples_done(self, samples: int) -> None:
        """``samples`` training samples went through a forward and backward."""
        self._samples_seen += samples

    def step_done(self) -> None:
        """An optimizer step was taken."""
        self._step += 1

    def epoch_done(self) -> None:
        """The epoch is over: the next one starts at its first batch."""
        self._epoch += 1
        self._batch_in_epoch = 0

    def as_dict(self) -> dict[str, int]:
        """The position as a checkpoint stores it: ``{name: int}`` for :attr:`FIELDS`."""
        return {name: getattr(self, f"_{name}") for name in self.FIELDS}

    @classmethod
    def from_dict(cls, saved: Mapping[str, int]) -> TrainState:
        """The position a checkpoint stored (:attr:`OPTIONAL` fields may be missing).

        Raises:
            KeyError: a field is missing (the reader checks the names first).
        """
        merged = {**cls.OPTIONAL, **saved}
        return cls(**{name: merged[name] for name in cls.FIELDS})

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TrainState):
            return NotImplemented
        return self.as_dict() == other.as_dict()

    __hash__ = None  # type: ignore[assignment]  # mutable: equal by value, not hashable

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v}" for k, v in self.as_dict().items())
        return f"TrainState({fields})"


def _trainbus_version() -> str:
    try:
        return metadata.version("trainbus")
    except metadata.PackageNotFoundError:  # running from a source tree that is not installed
        return "unknown"


def _run_metadata(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, world_size: int = 1
) -> dict[str, Any]:
    """What a checkpoint records about the run that wrote it, to refuse a mismatched resume."""
    return {
        "trainbus_version": _trainbus_version(),
        "torch_version": str(torch.__version__),
        "world_size": int(world_size),
        "param_shapes": {
            n: list(p.shape) for n, p in canonical_names(model.named_parameters()).items()
        },
        "optimizer": type(optimizer).__name__,
    }


def check_plain(value: object, where: str) -> None:
    """``ConfigError`` naming where in ``value`` is what ``weights_only`` could not load."""
    stack: list[tuple[object, str]] = [(value, where)]
    while stack:
        item, at = stack.pop()
        if isinstance(item, dict):
            for k, v in item.items():
                if not isinstance(k, str | int) or isinstance(k, bool):
                    raise ConfigError.invalid(at, k, "dict keys that are str or int")
                stack.append((v, f"{at}[{k!r}]"))
        elif isinstance(item, list | tuple):
            stack.extend((v, f"{at}[{i}]") for i, v in enumerate(item))
        elif not isinstance(item, _PLAIN):
            raise ConfigError.invalid(
                at,
                type(item).__name__,
                "tensors, dict/list/tuple and int/float/str/bool/None (what weights_only loads)",
            )


def build_payload(
    *,
    state: TrainState,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any | None,
    scaler: Any | None,
    metrics: Mapping[str, float],
    rng: dict[str, Any] | None,
    data_order: dict[str, Any] | None = None,
    callback_states: Mapping[str, Mapping[str, Any]] | None = None,
    world_size: int = 1,
    sharded: bool = False,
    run: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A checkpoint's payload (``sharded``: empty model and optimizer entries); ``ConfigError``
    as :func:`check_plain`."""
    callbacks = {str(k): dict(v) for k, v in (callback_states or {}).items()}
    check_plain(callbacks, "callback_states")
    check_plain(data_order, "data_order")
    meta = _run_metadata(model, optimizer, world_size=world_size)
    if sharded:
        meta["sharded"] = True
    if run is not None:
        meta["run"] = dict(run)
        check_plain(meta["run"], "meta['run']")
    return {
        "magic": _MAGIC,
        "format": FORMAT_VERSION,
        "meta": meta,
        "state": state.as_dict(),
        "model": {} if sharded else canonical_state(model.state_dict()),
        "optimizer": {"state": {}, "param_groups": []} if sharded else optimizer.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "metrics": {str(k): float(v) for k, v in metrics.items()},
        "rng": rng,
        "data_order": data_order,
        "callbacks": callbacks,
    }


@dataclass(frozen=True, slots=True, kw_only=True)
class Checkpoint:
    """A checkpoint read and checked by :func:`~trainbus.checkpoint.read_checkpoint`; nothing
    is applied until :meth:`restore`.

    Attributes:
        path: The file (or a sharded run's folder) it was read from.
        state: The run's position (:class:`TrainState`).
        metrics: The last evaluation's metrics.
        model, optimizer, scheduler, scaler: Their saved ``state_dict()`` (None when absent;
            empty in a sharded run's ``trainbus.pt``).
        rng: The saved random generator states, or None.
        data_order: The data order of the epoch in progress, or None.
        callbacks: ``{state key: state dict}`` of the callbacks that keep state.
        meta: What the run that wrote it recorded (versions, shapes, optimizer, world size).
    """

    path: Path
    state: TrainState
    metrics: dict[str, float]
    model: dict[str, Any]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any] | None
    scaler: dict[str, Any] | None
    rng: dict[str, Any] | None
    data_order: dict[str, Any] | None
    callbacks: dict[str, dict[str, Any]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def check_compatible(
        self, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, world_size: int = 1
    ) -> None:
        """Refuse to resume into a different model shape, optimizer type or world size.

        Raises:
            CheckpointError: naming what differs, saved value against current value.
        """
        now = _run_metadata(model, optimizer, world_size=world_size)
        problems: list[str] = []
        saved_shapes: dict[str, list[int]] = canonical_names(self.meta["param_shapes"].items())
        shapes: dict[str, list[int]] = now["param_shapes"]
        missing = sorted(set(saved_shapes) - set(shapes))
        extra = sorted(set(shapes) - set(saved_shapes))
        if missing:
            problems.append(f"parameters {missing} are in the checkpoint but not in the model")
        if extra:
            problems.append(f"parameters {extra} are in the model but not in the checkpoint")
        for name in sorted(set(saved_shapes) & set(shapes)):
            if list(saved_shapes[name]) != shapes[name]:
                problems.append(
                    f"parameter {name!r} has shape {list(saved_shapes[name])} in the "
                    f"checkpoint but {shapes[name]} in the model"
                )
        if self.meta["optimizer"] != now["optimizer"]:
            problems.append(
                f"the optimizer is {self.meta['optimizer']} in the checkpoint but "
                f"{now['optimizer']} now"
            )
        if self.meta["world_size"] != now["world_size"]:
            problems.append(
                f"the world size is {self.meta['world_size']} in the checkpoint but "
                f"{now['world_size']} now"
            )
        if problems:
            raise CheckpointError(
                "does not fit this run: "
                + "; ".join(problems[:6])
                + (f"; and {len(problems) - 6} more" if len(problems) > 6 else "")
                + ". Resume with the model and optimizer that wrote it, or start a fresh run",
                path=str(self.path),
            )

    def restore(
        self,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any | None,
        scaler: Any | None,
        world_size: int = 1,
        rng: bool = True,
    ) -> None:
        """Load the saved states into the live objects (after :meth:`check_compatible`).

        Args:
            model, optimizer, scheduler, scaler: The objects to restore (scheduler / scaler
                skipped when None here or in the checkpoint).
            world_size: Processes training together now.
            rng: Restore the random generators now. Pass False when the loop restores them
                itself through :func:`~trainbus.checkpoint.replay_epoch` (mid-epoch resume).

        Raises:
            CheckpointError: the checkpoint does not fit the model, optimizer or world size,
                or is a sharded checkpoint folder (restored by a sharded run only).
        """
        if self.meta.get("sharded"):
            raise CheckpointError(
                "a sharded checkpoint folder (written by a fully_shard run through "
                "torch.distributed.checkpoint): resume it with the model sharded the same way, "
                "or turn it into one file an unsharded model loads with "
                "trainbus.checkpoint.export_full(folder, path) (CLI: trainbus export)",
                path=str(self.path),
            )
        self.check_compatible(model=model, optimizer=optimizer, world_size=world_size)
        model.load_state_dict(live_state(self.model, model))
        optimizer.load_state_dict(self.optimizer)
        restore_scheduler_scaler(self, scheduler=scheduler, scaler=scaler)
        if rng and self.rng is not None:
            restore_rng(self.rng)

    def restore_weights(self, model: torch.nn.Module) -> None:
        """Load only the saved model weights into ``model`` (optimizer, scheduler, train state
        and RNG untouched): the best weights at the end of a run, or a file to deploy.

        Raises:
            CheckpointError: a sharded checkpoint folder, or the saved parameters do not fit
                ``model`` (names or shapes; the message names what differs).
        """
        if self.meta.get("sharded"):
            raise CheckpointError(
                "a sharded checkpoint folder: load its weights into an unsharded model with "
                "trainbus.checkpoint.export_full(folder, path) first",
                path=str(self.path),
            )
        try:
            model.load_state_dict(live_state(self.model, model))
        except RuntimeError as exc:  # missing, unexpected or mis-shaped keys
            raise CheckpointError(f"does not fit the model: {exc}", path=str(self.path)) from exc

    def restored(self) -> Checkpoint:
        """A copy without the states :meth:`restore` loaded (model, optimizer, scheduler,
        scaler): what a resumed run keeps, so no second copy of the weights stays alive."""
        return replace(self, model={}, optimizer={}, scheduler=None, scaler=None)


def restore_scheduler_scaler(
    checkpoint: Checkpoint, *, scheduler: Any | None, scaler: Any | None
) -> None:
    """Load the saved scheduler and scaler states (each skipped when None here or there)."""
    if scheduler is not None and checkpoint.scheduler is not None:
        scheduler.load_state_dict(checkpoint.scheduler)
    if scaler is not None and checkpoint.scaler is not None:
        scaler.load_state_dict(checkpoint.scaler)


def _need(payload: Mapping[str, Any], key: str, kind: type | tuple[type, ...], path: Path) -> Any:
    if key not in payload:
        raise _bad(
            path, f"missing the {key!r} entry; the file is not a complete trainbus checkpoint"
        )
    value = payload[key]
    if not isinstance(value, kind):
        raise _bad(path, f"the {key!r} entry is a {type(value).__name__}, not what trainbus writes")
    return value


def _bad(path: Path, what: str) -> CheckpointError:
    return CheckpointError(what, path=str(path))


def _rng_ok(rng: object) -> bool:
    if not isinstance(rng, dict) or not isinstance(rng.get("torch"), torch.Tensor):
        return False
    py = rng.get("python")
    return (
        isinstance(py, dict)
        and isinstance(py.get("internal"), torch.Tensor)
        and py["internal"].numel() == 625
        and isinstance(py.get("version"), int)
    )


def parse_payload(payload: object, path: Path) -> Checkpoint:
    """A loaded payload, checked; ``CheckpointError`` naming the file and the wrong entry."""
    if not isinstance(payload, dict) or payload.get("magic") != _MAGIC:
        old = isinstance(payload, dict) and payload.get("format") == 1
        raise _bad(
            path,
            "written by an older trainbus (format 1, not loadable safely); resume from a newer "
            "checkpoint or start fresh"
            if old
            else "not a trainbus checkpoint (no trainbus magic marker)",
        )
    if payload.get("format") != FORMAT_VERSION:
        found = payload.get("format")
        raise _bad(path, f"format version {found!r}, this trainbus reads {FORMAT_VERSION}")
    meta = _need(payload, "meta", dict, path)
    for key, kind in (("param_shapes", dict), ("optimizer", str), ("world_size", int)):
        _need(meta, key, kind, path)
    raw_state = _need(payload, "state", dict, path)
    names = TrainState.FIELDS
    raw_state = {**TrainState.OPTIONAL, **raw_state}  # an earlier version's file lacks these
    if set(raw_state) != set(names) or not all(
        isinstance(raw_state[n], int)
        and not isinstance(raw_state[n], bool)
        and raw_state[n] >= TrainState.OPTIONAL.get(n, 0)
        for n in names
    ):
        raise _bad(path, f"the 'state' entry {raw_state!r} is not a train state")
    model = _need(payload, "model", dict, path)
    if not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in model.items()):
        raise _bad(path, "the 'model' entry is not a state dict of tensors")
    optimizer = _need(payload, "optimizer", dict, path)
    if not {"state", "param_groups"} <= set(optimizer):
        raise _bad(path, "the 'optimizer' entry is not an optimizer state dict")
    metrics = _need(payload, "metrics", dict, path)
    if not all(isinstance(k, str) and isinstance(v, float) for k, v in metrics.items()):
        raise _bad(path, "the 'metrics' entry is not {name: float}")
    rng = _need(payload, "rng", (dict, type(None)), path)
    if rng is not None and not _rng_ok(rng):
        raise _bad(path, "the 'rng' entry is not a saved RNG state")
    callbacks = _need(payload, "callbacks", dict, path)
    if not all(isinstance(k, str) and isinstance(v, dict) for k, v in callbacks.items()):
        raise _bad(path, "the 'callbacks' entry is not {name: state dict}")
    return Checkpoint(
        path=path,
        state=TrainState.from_dict(raw_state),
        metrics=dict(metrics),
        model=model,
        optimizer=optimizer,
        scheduler=_need(payload, "scheduler", (dict, type(None)), path),
        scaler=_need(payload, "scaler", (dict, type(None)), path),
        rng=rng,
        data_order=_need(payload, "data_order", (dict, type(None)), path),
        callbacks=callbacks,
        meta=meta,
    )
