"""Built-in callbacks, one module each, and the :class:`Callback` base class."""

from ._base import Callback as Callback
from ._base import GlobalCallbackHandle as GlobalCallbackHandle
from ._base import global_callbacks as global_callbacks
from ._base import register_global_callback as register_global_callback

__all__ = ["Callback", "GlobalCallbackHandle", "global_callbacks", "register_global_callback"]
