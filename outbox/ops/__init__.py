"""What operators read: the report of everything stuck, shared by ``outbox status`` and the console.

It sits above ``relay`` and ``inbox`` (it reads both) and below ``cli`` and
``console``, which only present it.
"""

from ._stuck import VERSION, gather

__all__ = ["VERSION", "gather"]
