"""Send every checkpoint to an external eval service, awaited while training goes on.

The "service" is a real TCP server on 127.0.0.1 (ephemeral port) speaking one JSON line per
request: it receives a checkpoint path, loads it with ``torch.load``, scores the model on
held-out data and replies ``{"path": ..., "accuracy": ..., "loss": ...}``. It takes a while
(the scoring runs in a worker thread, plus a simulated network/queue delay), as real eval jobs do.

``bus.subscribe_async(bus.stream(ev.CheckpointSaved), ask_service, concurrency=2)`` runs
``ask_service`` in the bus' task group with at most two requests in flight. The training thread
never waits for it, not even at a barrier (only ``decides=True`` subscriptions hold training
there): the script records the training step when each request went out and when
its reply came back. When the run ends, the bus drains its async subscribers, so every
checkpoint (the final one included) has its reply before ``fit()`` returns.

Run: ``python examples/async_eval_service.py``
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import structlog
import torch
import torch.nn.functional as F
from anyio.abc import SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream
from reactivex import operators as ops

from trainbus import Trainer
from trainbus import commands as cmd
from trainbus import events as ev
from trainbus import operators as tbops
from trainbus.testing import tiny_loader, tiny_model

structlog.configure(
    processors=[
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="%H:%M:%S.%f"),
        structlog.dev.ConsoleRenderer(colors=False),
    ]
)
log = structlog.get_logger("async_eval_service")

SERVICE_DELAY_S = 0.3  # simulated queueing / network time of the remote service
SAVE_EVERY = 150


# ----------------------------------------------------------------------------- the service
Batches = Sequence[tuple[torch.Tensor, torch.Tensor]]


def score_checkpoint(path: str, held_out: Batches) -> dict[str, Any]:
    """Blocking work: load the checkpoint into a fresh model and score it."""
    payload = torch.load(path, map_location="cpu", weights_only=False)
    model = tiny_model()
    model.load_state_dict(payload["model"])
    model.eval()
    correct = total = 0
    loss = 0.0
    with torch.no_grad():
        for x, y in held_out:
            out = model(x)
            loss += float(F.cross_entropy(out, y, reduction="sum"))
            correct += int((out.argmax(1) == y).sum())
            total += len(y)
    return {"path": path, "step": payload["state"]["step"], "accuracy": correct / total,
            "loss": loss / total}  # fmt: skip


def make_handler(held_out: Batches) -> Any:
    async def handle(client: SocketStream) -> None:
        async with client:
            reader = BufferedByteReceiveStream(client)
            request = json.loads(await reader.receive_until(b"\n", 65536))
            await anyio.sleep(SERVICE_DELAY_S)
            # torch work off the event loop: the loop also runs the trainer's bus.
            reply = await anyio.to_thread.run_sync(score_checkpoint, request["path"], held_out)
            await client.send(json.dumps(reply).encode() + b"\n")

    return handle


# ----------------------------------------------------------------------------- the client
@dataclass
class Exchange:
    checkpoint_step: int
    step_at_request: int
    step_at_reply: int
    reply: dict[str, Any]


async def main() -> None:
    torch.set_num_threads(1)  # tiny model: extra intra-op threads only compete for 2 cores
    data = tiny_loader(batches=24, seed=0)
    train, held_out = data[:16], data[16:]  # same generated task, disjoint batches

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    log.info("eval_service_listening", port=port)

    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model()
        trainer = Trainer(
            model,
            torch.optim.SGD(model.parameters(), lr=0.05),
            train,
            loss_fn=F.cross_entropy,
            max_steps=900,
            checkpoint_dir=Path(tmp),
        )
        bus = trainer.bus
        current_step = 0
        exchanges: list[Exchange] = []
        saved: list[ev.CheckpointSaved] = []

        def track_step(e: ev.StepEnded) -> None:
            nonlocal current_step
            current_step = e.step

        async def ask_service(e: ev.CheckpointSaved) -> None:
            # Runs in the bus' task group, on the event loop; awaiting here never blocks the
            # training thread (it only delays this subscription's next item).
            at_request = current_step
            async with await anyio.connect_tcp("127.0.0.1", port) as conn:
                await conn.send(json.dumps({"path": e.path}).encode() + b"\n")
                reader = BufferedByteReceiveStream(conn)
                reply = json.loads(await reader.receive_until(b"\n", 65536))
            exchanges.append(Exchange(e.step, at_request, current_step, reply))
            log.info("eval_reply", checkpoint_step=e.step, step_at_request=at_request,
                     step_at_reply=current_step, accuracy=reply["accuracy"],
                     loss=round(reply["loss"], 4))  # fmt: skip

        bus.stream(ev.StepEnded).subscribe(track_step)
        bus.stream(ev.CheckpointSaved).subscribe(saved.append)
        bus.stream(ev.StepEnded).pipe(
            tbops.every(SAVE_EVERY), ops.map(lambda e: cmd.SaveCheckpoint())
        ).subscribe(bus.commands)
        sub = bus.subscribe_async(bus.stream(ev.CheckpointSaved), ask_service, concurrency=2)

        async with listener, anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, make_handler(held_out))
            result = await trainer.fit()
            tg.cancel_scope.cancel()  # training is over: shut the service down

    # fit() returned only after the bus drained ask_service: one reply per checkpoint.
    assert saved and len(exchanges) == len(saved), (len(exchanges), len(saved))
    assert sorted(x.checkpoint_step for x in exchanges) == [e.step for e in saved]
    assert all(x.reply["step"] == x.checkpoint_step for x in exchanges)
    stats = sub.statistics()
    assert stats.failed == stats.dropped == stats.cancelled == 0, stats
    # ...and the training thread kept stepping while requests were out: ask_service does not
    # decide (no decides=True), so no barrier (EpochEnded, the final one) waited for it.
    overlapped = [x for x in exchanges if x.step_at_reply > x.step_at_request]
    assert overlapped, exchanges
    assert result.waited_s == {}, result.waited_s
    print(
        f"async eval service: {len(saved)} checkpoints, {len(exchanges)} replies before fit() "
        f"returned; training advanced during {len(overlapped)} of them (e.g. request at step "
        f"{overlapped[0].step_at_request}, reply at step {overlapped[0].step_at_reply}); "
        f"final accuracy {exchanges[-1].reply['accuracy']:.2f}, run {result.reason}"
    )


if __name__ == "__main__":
    anyio.run(main)
