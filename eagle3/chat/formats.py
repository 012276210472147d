"""Chat-row formats and role names: the one table every reader and writer of conversations uses.

Two row formats are read and written: OpenAI ``{"messages": [{"role", "content"}]}`` and ShareGPT
``{"conversations": [{"from", "value"}]}`` (an optional top-level ``system`` string in ShareGPT). Both normalise to
``[{"role": "system" | "user" | "assistant", "content": str}]``. Standard library only (the vLLM environment
imports this module too).
"""

from __future__ import annotations

from typing import Any

ROLE_ALIASES = {  # any spelling in a source row -> the canonical role
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
}
SHAREGPT_ROLE = {"system": "system", "user": "human", "assistant": "gpt"}  # canonical -> ShareGPT's spelling
# format -> (list key, role key, text key)
FORMATS = {"openai": ("messages", "role", "content"), "sharegpt": ("conversations", "from", "value")}


def detect_format(row: dict[str, Any]) -> str | None:
    """"openai" or "sharegpt" by which list key the row has; None when it has neither."""
    return "openai" if "messages" in row else "sharegpt" if "conversations" in row else None


def canonical_role(name: Any) -> str | None:
    """The canonical role of a source spelling (human -> user, gpt -> assistant, ...); None when unknown."""
    return ROLE_ALIASES.get(name) if isinstance(name, str) else None


def to_openai(messages: list[dict[str, str]], **extra: Any) -> dict[str, Any]:
    """Canonical messages -> an OpenAI-format row (``extra`` keys kept beside ``messages``)."""
    return {**extra, "messages": [{"role": m["role"], "content": m["content"]} for m in messages]}


def to_sharegpt(messages: list[dict[str, str]], **extra: Any) -> dict[str, Any]:
    """Canonical messages -> a ShareGPT-format row."""
    return {**extra, "conversations": [{"from": SHAREGPT_ROLE[m["role"]], "value": m["content"]} for m in messages]}
