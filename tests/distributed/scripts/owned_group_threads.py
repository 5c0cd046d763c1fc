"""The script-owned group under trainbus: ``import trainbus`` first (as a script does), then
``init_process_group``, then the first optimizer; a ``ProcessGroup`` that owns the group closes
it. One rank (WORLD_SIZE=1 unless the caller says otherwise).

    owned_group_threads.py [--hold]

``--hold`` keeps a reference to the default group past ``close()`` (as a user's own
DistributedDataParallel would). Prints one JSON line: the gloo threads still running after
``close()``, whether the group is alive, and the events trainbus logged.
"""

from __future__ import annotations

import json
import os
import sys
import weakref

from _threads import thread_names  # the scripts' folder is sys.path[0]
from structlog.testing import capture_logs

import trainbus  # first, as a script imports it: before any process group exists

for name, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": "29513"}.items():  # fmt: skip
    os.environ.setdefault(name, value)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from trainbus._distributed.group import ProcessGroup  # noqa: E402

dist.init_process_group("gloo")
world = dist.group.WORLD
assert world is not None
group = weakref.ref(world)
held = [world] if "--hold" in sys.argv else []
del world
optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)  # imports torch._dynamo
del optimizer
owner = ProcessGroup(rank=0, world_size=1, local_rank=0, backend="gloo",
                     device=torch.device("cpu"), created=True)  # fmt: skip
with capture_logs() as logs:
    owner.close()


def gloo_threads() -> list[str]:
    return [n for n in thread_names() if "gloo" in n]


threads = gloo_threads()
alive = group() is not None
held.clear()  # let go: the group and its threads end now, while Python is whole
print(json.dumps({"threads": threads, "group_alive": alive, "trainbus": trainbus.__file__,
                  "logs": [e["event"] for e in logs]}), flush=True)  # fmt: skip
