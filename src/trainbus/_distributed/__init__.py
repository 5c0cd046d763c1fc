"""Past one process: the process group, rank-agreed commands, and both ends of the driver's
link (see docs/distributed.md; its layer rule is ARCHITECTURE.md's)."""
