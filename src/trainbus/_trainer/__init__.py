"""The Trainer and its own rooms: the parts of :class:`~trainbus.Trainer` no other layer uses.

``trainer.py`` holds the :class:`~trainbus.Trainer` itself, which ``trainbus`` re-exports; the
other modules are the rooms it hands its work to (its options and their checks, the added
callbacks, the bus around a call, resume, one rank's setup, how the bus is held across calls,
how a run ends), each named for what it holds.
"""
