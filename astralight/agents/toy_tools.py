"""Tools of the toy tool-use recipe (``examples/tool_use``): exact arithmetic the tiny model
cannot do in its head."""

from __future__ import annotations


def add(a: int, b: int) -> int:
    """Add two integers exactly.

    Args:
        a: the first addend
        b: the second addend
    """
    return int(a) + int(b)
