"""Integrations with other tools, one module each, imported by name (each needs its extra):

- :mod:`trainbus.integrations.optuna`: prune Optuna trials from the bus
  (``pip install 'trainbus[optuna]'``).
"""

__all__: list[str] = []
