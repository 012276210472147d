"""Conversation sources: files, folders, fsspec URLs and Hugging Face datasets -> rows -> normalised messages; the
held-out prompts validation generates from; the sources' content identity (the data stage's cache key).

Rows are ShareGPT or OpenAI (eagle3.chat.formats); both normalise to ``[{"role", "content"}]``. A bad row becomes a
``BadRow`` with its reason (the reasons are listed in eagle3/prepare.py); a missing source is one DataError.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from eagle3.chat.errors import BadRow, DataError
from eagle3.chat.formats import FORMATS, canonical_role, detect_format
from eagle3.support.io import fingerprint_paths, sha256_json

DATA_EXTENSIONS = (".jsonl", ".json", ".parquet")


class DataSources(BaseModel):
    """The chat sources of a run and their content fingerprint (the data stage's cache key reads it)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sources: list[str] = Field(description="As configured (resolved paths, URLs, hf: ids).")
    fingerprint: str = Field(description="Local files and folders by content; URLs and hub ids by their string.")


def describe_sources(sources: list[str]) -> DataSources:
    """Local files/folders by content; URLs and hub ids by their string (pin a revision in the id to key on it)."""
    parts = []
    for src in sources:
        local = Path(src.removeprefix("file://"))
        parts.append(fingerprint_paths([local]) if local.exists() else f"remote:{src}")
    return DataSources(sources=list(sources), fingerprint=sha256_json(parts))


_HF_SPEC = re.compile(r"^(?P<name>.+?)(?::(?P<split>[A-Za-z_][\w-]*(?:\[[^\]]*\])?))?$")
_HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(?:/[\w.-]+)?(?::[A-Za-z_][\w-]*(?:\[[^\]]*\])?)?$")


@dataclass
class SourcePart:
    source: str  # as given in the config
    file: str  # the file (or dataset spec) it came from
    first_index: int
    rows: int = 0


def _classify(source: str) -> tuple[str, str]:
    if source.startswith("hf:"):
        return "hf", source[3:]
    if "://" in source or Path(source).expanduser().exists():
        return "fsspec", source
    if _HF_ID.fullmatch(source) and not source.lower().endswith(DATA_EXTENSIONS):
        return "hf", source
    raise DataError(f"source {source!r} not found: no such file or folder")


def _list_files(source: str) -> list[tuple[Any, str]]:
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(source if "://" in source else str(Path(source).expanduser()))
    except (ValueError, ImportError) as e:
        raise DataError(f"source {source!r}: cannot open ({e})") from e
    if not fs.exists(root):
        raise DataError(f"source {source!r} not found: no such file or folder")
    if fs.isdir(root):
        files = sorted(
            f for f in fs.find(root)
            if f.lower().endswith(DATA_EXTENSIONS) and not any(p.startswith(".") for p in f[len(root):].split("/"))
        )
        if not files:
            raise DataError(f"source {source!r}: folder holds no {'/'.join(DATA_EXTENSIONS)} files")
        return [(fs, f) for f in files]
    if not root.lower().endswith(DATA_EXTENSIONS):
        raise DataError(f"source {source!r}: unsupported file type (expected {', '.join(DATA_EXTENSIONS)})")
    return [(fs, root)]


def _jsonl_rows(lines: Iterator[bytes]) -> Iterator[dict | BadRow]:
    for line in lines:
        if not line.strip():
            continue
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            yield BadRow("invalid_utf8", str(e))
            continue
        try:
            row = json.loads(text)
        except json.JSONDecodeError as e:
            yield BadRow("invalid_json", str(e))
            continue
        yield row if isinstance(row, dict) else BadRow("invalid_json", f"a JSON {type(row).__name__}, not an object")


def _file_rows(fs: Any, path: str, source: str) -> Iterator[dict | BadRow]:
    lower = path.lower()
    if lower.endswith(".parquet"):
        import pyarrow.parquet as pq

        with fs.open(path, "rb") as f:
            try:
                pf = pq.ParquetFile(f)
            except Exception as e:  # pyarrow raises ArrowInvalid / OSError on a broken file
                raise DataError(f"source {source!r}: {path} is not a readable parquet file ({e})") from e
            for batch in pf.iter_batches(batch_size=1024):
                yield from batch.to_pylist()
        return
    if lower.endswith(".jsonl"):
        with fs.open(path, "rb") as f:
            yield from _jsonl_rows(f)
        return
    with fs.open(path, "rb") as f:
        data = f.read()
    # surrogateescape keeps a row with undecodable bytes readable; its strings then hold lone surrogates and
    # normalisation reports that row (only that row) as invalid_utf8.
    text = data.decode("utf-8", errors="surrogateescape")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        if text.lstrip().startswith("["):  # a broken JSON array is one error, not N invalid rows
            raise DataError(f"source {source!r}: {path} is not valid JSON ({e})") from None
        yield from _jsonl_rows(iter(data.splitlines()))  # JSON lines in a .json file, as datasets accepts
        return
    if isinstance(doc, dict) and ("messages" in doc or "conversations" in doc):
        doc = [doc]
    if not isinstance(doc, list):
        raise DataError(f"source {source!r}: {path} must hold a JSON list of rows (or JSON lines)")
    for row in doc:
        yield row if isinstance(row, dict) else BadRow("invalid_json", f"a JSON {type(row).__name__}, not an object")


def _hf_rows(spec: str, default_split: str, source: str) -> Iterator[dict]:
    import datasets

    m = _HF_SPEC.match(spec)
    if m is None:
        raise DataError(f"source {source!r}: no dataset name (write hf:<id or local path>[:split])")
    name, split = m["name"], m["split"] or default_split
    try:
        ds = datasets.load_dataset(name, split=split)
    except Exception as e:  # offline hub misses, unknown splits, unreadable files: all one error naming the source
        raise DataError(f"source {source!r}: datasets.load_dataset({name!r}, split={split!r}) failed: {e}") from e
    for batch in ds.iter(batch_size=1024):
        keys = list(batch)
        for values in zip(*(batch[k] for k in keys)):
            yield dict(zip(keys, values))


def iter_rows(sources: list[str], hf_split: str = "train", parts: list[SourcePart] | None = None
              ) -> Iterator[tuple[int, dict | BadRow]]:
    """Yield ``(row_index, row or BadRow)`` over all sources in order; ``parts`` collects where each index lies.

    Every source is checked before the first row is read, so a missing one fails at once.
    """
    plan = []
    for source in sources:
        kind, spec = _classify(source)
        plan.append((source, kind, spec, _list_files(source) if kind == "fsspec" else None))
    index = 0
    for source, kind, spec, files in plan:
        streams = [(f"hf:{spec}", _hf_rows(spec, hf_split, source))] if kind == "hf" else [
            (fs.unstrip_protocol(path), _file_rows(fs, path, source)) for fs, path in files
        ]
        for name, rows in streams:
            part = SourcePart(source=source, file=name, first_index=index)
            if parts is not None:
                parts.append(part)
            for row in rows:
                yield index, row
                index += 1
                part.rows += 1


def _check_text(text: Any) -> str:
    if not isinstance(text, str):
        raise BadRow("non_string_content", f"content is {type(text).__name__}")
    if not text.strip():
        raise BadRow("empty_content")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRow("invalid_utf8", str(e)) from None
    return text


def normalize_row(row: dict, fmt: str = "auto") -> list[dict[str, str]]:
    """ShareGPT or OpenAI row -> ``[{"role": system|user|assistant, "content": str}, ...]``; raises BadRow."""
    if fmt == "auto":
        fmt = detect_format(row)
        if fmt is None:
            raise BadRow("missing_field", "row has neither 'messages' nor 'conversations'")
    key, role_key, text_key = FORMATS[fmt]
    turns = row.get(key)
    if not isinstance(turns, list) or not turns:
        raise BadRow("missing_field", f"'{key}' is missing or not a non-empty list")
    messages = []
    if fmt == "sharegpt" and isinstance(row.get("system"), str) and row["system"].strip():
        messages.append({"role": "system", "content": _check_text(row["system"])})
    for turn in turns:
        if not isinstance(turn, dict) or role_key not in turn or text_key not in turn:
            raise BadRow("missing_field", f"a message lacks '{role_key}' or '{text_key}'")
        role = canonical_role(turn[role_key])
        if role is None:
            raise BadRow("unknown_role", repr(turn[role_key]))
        messages.append({"role": role, "content": _check_text(turn[text_key])})
    if not any(m["role"] == "assistant" for m in messages):
        raise BadRow("no_assistant_turn")
    return messages


class PromptError(ValueError):
    """The prompts file is missing, malformed or holds too few usable conversations; the message names the line."""


def read_prompt_messages(path: str | os.PathLike, num_prompts: int) -> list[list[dict[str, str]]]:
    """The first user turn (with the system message before it, if any) of the first ``num_prompts`` conversations.

    Accepts OpenAI (``{"messages": [{"role", "content"}]}``) and ShareGPT (``{"conversations": [{"from", "value"}]}``)
    jsonl lines.
    """
    path = Path(path)
    if not path.is_file():
        raise PromptError(f"prompts file not found: {path}")
    prompts: list[list[dict[str, str]]] = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if len(prompts) >= num_prompts:
                break
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise PromptError(f"{path}:{line_no}: not valid JSON ({e})") from None
            if not isinstance(record, dict):
                raise PromptError(f"{path}:{line_no}: a JSON {type(record).__name__}, not an object")
            fmt = detect_format(record)
            if fmt is None:
                raise PromptError(f"{path}:{line_no}: neither 'messages' (OpenAI) nor 'conversations' (ShareGPT)")
            key, role_key, text_key = FORMATS[fmt]
            if not (isinstance(record[key], list) and all(isinstance(t, dict) for t in record[key])):
                raise PromptError(f"{path}:{line_no}: '{key}' must be a list of objects")
            turns = [(canonical_role(t.get(role_key)), t.get(text_key)) for t in record[key]]
            prompt = []
            for role, content in turns:
                if role not in ("system", "user") or not isinstance(content, str):
                    break
                prompt.append({"role": role, "content": content})
                if role == "user":
                    break
            if not prompt or prompt[-1]["role"] != "user":
                raise PromptError(f"{path}:{line_no}: no user turn before the first assistant turn")
            prompts.append(prompt)
    if len(prompts) < num_prompts:
        raise PromptError(f"{path} holds {len(prompts)} conversations, {num_prompts} prompts were asked for")
    return prompts
