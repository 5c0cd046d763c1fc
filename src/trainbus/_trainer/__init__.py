"""The Trainer and its own rooms: the parts of :class:`~trainbus.Trainer` no other layer uses.

Every module of the package, each once (``tests/test_layers.py`` checks the list):

- ``trainer.py``: the :class:`~trainbus.Trainer` itself, which ``trainbus`` re-exports.
- ``options.py``: the options, declared once (``TrainerOptions``), the Trainer's signature and
  docstring from them, the bus they configure, the loop's ``Settings`` built from them.
- ``checks.py``: the check of each single option, named in its declaration.
- ``hf_options.py``: Hugging Face's option names and their trainbus equivalents (the
  ``TypeError`` for one, docs/migration.md's ``TrainingArguments`` table).
- ``added.py``: the added callbacks, their subscriptions and hooks (``AddedCallbacks``).
- ``calls.py``: the bus around one call (``CallRunner``), the standalone runs, the training
  thread, cancellation and SIGINT/SIGTERM.
- ``resume.py``: ``fit(resume=...)`` checked and loaded; the callbacks' states at each save.
- ``rank_setup.py``: one rank's part of a ``fit()``: process group, device, DDP, sharded data.
- ``holder.py``: how the Trainer holds its bus across calls (``BusHolder``); the one
  blocking portal of the sync twins.
- ``endings.py``: what ``fit()`` raises after a signal's graceful stop; skipped final saves.
- ``workers.py``: DataLoader worker processes ended with the call that started them.
"""
