"""The upstream reproducer, pure torch (no trainbus): a destroyed gloo group's threads live on.

    python torch_gloo_threads.py [--import-first]          # one rank (WORLD_SIZE=1 by default)
    torchrun --nproc_per_node=2 torch_gloo_threads.py [--import-first]

``torch.distributed.nn.functional`` evaluates ``group=group.WORLD`` as the default argument of
its ten collectives when it is first imported. The first ``torch.optim`` optimizer imports it
(``Optimizer.__init__`` -> ``torch._dynamo`` -> ``torch.distributed.fsdp`` -> ``_shard`` ->
``torch.distributed.nn``), so an optimizer built after ``init_process_group`` binds the live
default group into those defaults for good: ``destroy_process_group()`` then leaves the group and
gloo's threads (``gloo_tcp_loop``, two ``pt_gloo_runloop``) running until interpreter teardown,
where a finished rank occasionally aborts (``terminate called without an active exception``).
With ``--import-first`` the module is imported before the group exists (defaults bind None) and
nothing is left. Prints one JSON line: the gloo threads still running and whether the group is
still alive after ``destroy_process_group()``. Seen with torch 2.13.0 (CPU build, Linux).
"""

from __future__ import annotations

import json
import os
import sys
import weakref

from _threads import thread_names  # the scripts' folder is sys.path[0]

# One rank unless torchrun (or the caller) says otherwise.
for name, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": "29512"}.items():  # fmt: skip
    os.environ.setdefault(name, value)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

if "--import-first" in sys.argv:
    import torch.distributed.nn.functional

dist.init_process_group("gloo")
world = dist.group.WORLD
assert world is not None
group = weakref.ref(world)
del world
optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)  # imports torch._dynamo
del optimizer
dist.barrier()
dist.destroy_process_group()


def gloo_threads() -> list[str]:
    return [n for n in thread_names() if "gloo" in n]


fn = sys.modules.get("torch.distributed.nn.functional")
held = group()
bound = held is not None and fn is not None and any(d is held for d in fn.broadcast.__defaults__)
del held
print(
    json.dumps(
        {
            "rank": dist.get_rank() if dist.is_initialized() else int(os.environ["RANK"]),
            "threads": gloo_threads(),
            "group_alive": group() is not None,
            "bound_in_defaults": bound,
            "torch": torch.__version__,
        }
    ),
    flush=True,
)
