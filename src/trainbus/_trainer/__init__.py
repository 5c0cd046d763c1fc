"""The Trainer's own rooms: the parts of :class:`~trainbus.Trainer` no other layer uses.

- ``options.py``: the options, declared once (:class:`TrainerOptions`), the Trainer's
  signature and docstring from them, and the loop's ``Settings`` built from them.
- ``checks.py``: the check of each single option, named in its declaration.
"""
