"""The data layer's errors (standard library only: the vLLM environment imports them too)."""

from __future__ import annotations


class DataError(ValueError):
    """Bad input to the data layer; the message names the source, file, field or tokenizer path."""


class BadRow(Exception):
    """One unusable row; ``reason`` is one of the names in the module docstring."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
