"""The Trainer and its own rooms: the parts of :class:`~trainbus.Trainer` no other layer uses.

``trainer.py`` holds the :class:`~trainbus.Trainer` itself, which ``trainbus`` re-exports; the
other modules are the rooms it hands its work to (its options and their checks, the attached
callbacks, a call's session, resume, one rank's setup, the bus' lifetime, how a run ends, the
result), each named for what it holds.
"""
