"""The Trainer (``trainer.py``, re-exported by ``trainbus``) and the parts no other layer uses."""
