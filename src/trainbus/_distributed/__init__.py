"""Past one process: the process group, rank-agreed commands, and the worker
side of the launcher's link (see ``docs/distributed.md``).

Layer: imports ``events``, ``commands``, ``wire`` (the record codec), the leaf utilities and
torch; nothing of the bus, the loop, the callbacks or the trainer (the launcher's driver lives
in ``trainbus._launcher``).
"""
