"""Stage 1, prepare data: chat conversations -> verifier token ids + assistant loss mask.

Where it sits: sources (json / jsonl / parquet files or folders, fsspec URLs, Hugging Face datasets) -> **prepare**
-> ``<stage folder>/dataset/`` (Arrow: ``input_ids`` int32 list, ``loss_mask`` int8 list, ``source_index`` int64) and
``<stage folder>/stats.json`` (described by a ``PreparedData`` artifact), read by capacity, vocab and extraction.

Rows are ShareGPT (``conversations``: ``from``/``value`` with human/user, gpt/assistant, system) or OpenAI
(``messages``: ``role``/``content``); both normalise to the same ``[{"role", "content"}]`` list, so the same
conversation gives the same tokens in either format. Each conversation is rendered with the VERIFIER's own chat
template (what the verifier sees when it serves), never with a hand-written format.

Loss mask (1 = the draft is trained to predict this token): exactly the tokens the verifier GENERATES in each
assistant turn, i.e. the assistant content plus the end-of-turn special token the template puts right after it
(``<|im_end|>``, ``<|eot_id|>``: the draft must learn to predict the end of a turn too); 0 elsewhere (system and
user turns, role headers, the ``\\n`` a template writes after the end-of-turn token). Where the mask lies is found
from the template itself, never by guessing its strings:

* templates with ``{% generation %}`` blocks mark the generated text themselves (one render per conversation);
* otherwise, for each assistant message i, ``render(messages[:i], add_generation_prompt=True)`` must be a prefix of
  ``render(messages[:i+1])``, itself a prefix of the full rendering; the assistant text lies between the two
  (a template that ``| trim``s contents masks the trimmed text), and the end-of-turn part is the first special
  token after it when only whitespace separates them. A conversation whose renderings are not prefix-stable is
  reported as a bad row, never masked approximately.

Tokenisation: the rendered text is cut at the mask boundaries and the pieces are tokenised in one batched call, so
no token ever straddles a boundary and decoding the masked tokens gives back exactly the masked text (the prompt
and the generated reply are tokenised apart at serving time too). This needs a tokenizer that does not prepend
anything to each call (byte-level BPE / tiktoken do not; legacy SentencePiece "add a leading space" ones do);
that is checked once and refused with a clear error.

Bad rows are skipped and counted in ``stats.json`` by reason, with the first row indices (index = position in the
concatenated sources, in the order given, the same number as ``source_index``):

    invalid_json         the line / element is not a JSON object
    invalid_utf8         undecodable bytes in the source, or lone surrogates in a string
    missing_field        no ``messages``/``conversations`` list, or a message without role/content (from/value)
    unknown_role         a role other than system/user/assistant (human/gpt in ShareGPT)
    empty_content        a message whose content is empty or whitespace only
    non_string_content   a message whose content is not a string (e.g. content parts, tool calls)
    no_assistant_turn    no assistant message at all
    template_error       the chat template raised on this conversation
    not_prefix_stable    rendering a prefix of the conversation is not a prefix of the full rendering
    content_not_rendered an assistant text cannot be found where the template renders that turn
    overlong             more than ``max_seq_len`` tokens (``overlong="skip"``, the default)
    no_assistant_tokens  ``overlong="truncate"`` cut away every assistant token
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import random
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import pyarrow as pa
from jinja2 import TemplateError
from pydantic import BaseModel, ConfigDict, Field

from eagle3.support.artifacts import Artifact, file_problem
from eagle3.support.chat import FORMATS, canonical_role, detect_format
from eagle3.support.io import atomic_path, atomic_write_json, fingerprint_paths, sha256_file, sha256_json
from eagle3.support.progress import Progress, fmt_duration
from eagle3.support.settings import RUNTIME

log = logging.getLogger("eagle3.prepare")

STATS_FORMAT = "eagle3-prepared-data/1"
DATA_EXTENSIONS = (".jsonl", ".json", ".parquet")
FIRST_INDICES_KEPT = 5
_RENDER_BATCH = 256  # conversations rendered + tokenised per batched tokenizer call

class DataError(ValueError):
    """Bad input to the data stage; the message names the source, file, field or tokenizer path."""


def load_prepared(dataset_dir: str | Path, columns: tuple[str, ...] = ("input_ids", "loss_mask"),
                  error: type[Exception] = DataError):
    """Open the data stage's output (a ``datasets.Dataset.save_to_disk`` folder) and check it holds one split with
    ``columns``; any problem raises one ``error`` naming the folder. Later stages read prepared data through this."""
    import datasets

    path = Path(dataset_dir)
    if not path.is_dir():
        raise error(f"dataset folder not found: {path} (expected datasets.Dataset.save_to_disk output)")
    try:
        ds = datasets.load_from_disk(str(path))
    except (OSError, ValueError) as e:  # FileNotFoundError, ArrowInvalid, ... for broken folders
        raise error(f"cannot open dataset {path}: {e}") from None
    if not isinstance(ds, datasets.Dataset):
        raise error(f"dataset folder {path} holds a DatasetDict ({list(ds)}); pass one split's folder")
    missing = [c for c in columns if c not in ds.column_names]
    if missing:
        raise error(f"dataset {path} lacks column(s) {missing} (has {ds.column_names}); run the data stage")
    return ds


class PrepareConfig(BaseModel):
    """Where the conversations come from and how they become verifier tokens."""

    model_config = ConfigDict(extra="forbid")

    sources: list[str] = Field(
        min_length=1,
        description=(
            "Conversation sources, read in this order: local .json/.jsonl/.parquet files or folders of them "
            "(recursive, sorted), fsspec URLs (memory://, file://, s3://, ...), or Hugging Face datasets "
            "loaded with datasets.load_dataset, written 'hf:' + a dataset id or local path, optionally followed by "
            "':' + a split (a bare 'org/name' that is not a local path is read as a dataset id too)."
        ),
        json_schema_extra=RUNTIME,  # keyed by content: describe_sources / describe_tokenizer
    )
    hf_split: str = Field("train", description="Split of a Hugging Face dataset source that names none.")
    format: Literal["auto", "sharegpt", "openai"] = Field(
        "auto",
        description="Row format: 'sharegpt' (conversations: from/value), 'openai' (messages: role/content), or "
        "'auto' (per row, by which of the two keys it has).",
    )
    tokenizer_path: str = Field(
        description="Verifier (or its tokenizer) folder: its tokenizer and chat template render the conversations.",
        json_schema_extra=RUNTIME,  # keyed by content: describe_sources / describe_tokenizer
    )
    chat_template: str | None = Field(
        None,
        description="Chat template overriding the tokenizer's own: Jinja text, a path to a template file, or the name "
        "of one of the tokenizer's named templates.",
    )
    trust_remote_code: bool = Field(
        False, description="Allow the tokenizer's own Python code (needed by e.g. Kimi's tiktoken tokenizer)."
    )
    mask_method: Literal["auto", "generation", "prefix"] = Field(
        "auto",
        description="How assistant tokens are located: 'generation' (the template's {% generation %} blocks), "
        "'prefix' (prefix renderings), 'auto' (generation blocks when the template has them).",
    )
    max_samples: int | None = Field(
        None, ge=1, description="Stop after this many KEPT samples (conversations); None = all."
    )
    shuffle_seed: int | None = Field(
        None, description="Seed of the row shuffle applied before max_samples; None = keep the source order."
    )
    max_seq_len: int = Field(2048, ge=2, description="Longest sample, in tokens (the rendered conversation).")
    overlong: Literal["skip", "truncate"] = Field(
        "skip", description="Samples over max_seq_len tokens: 'skip' (counted in stats) or 'truncate' to it."
    )


_PATH_KEYS = ("sources", "tokenizer_path", "config")  # stats.json keys that name where things lie, not what they are


def content_fingerprint(dataset_path: str | Path, stats: dict[str, Any]) -> str:
    """The prepared data's identity: the Arrow dataset's bytes and the stats without the keys that name paths, so
    the same data prepared from another folder or checkout keys every downstream stage the same."""
    return sha256_json([fingerprint_paths([dataset_path]), {k: v for k, v in stats.items() if k not in _PATH_KEYS}])


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


def describe_tokenizer(cfg: PrepareConfig) -> DataSources:
    """The identity of what renders and tokenizes the conversations: the tokenizer folder's tokenizer and template
    files, and a chat_template override (its text, or the content of the file it names)."""
    from eagle3.support.verifier import tokenizer_fingerprint

    template = cfg.chat_template
    if template is not None and "{" not in template and Path(template).is_file():
        template = Path(template).read_text(encoding="utf-8")
    return DataSources(sources=[cfg.tokenizer_path], fingerprint=sha256_json([
        tokenizer_fingerprint(cfg.tokenizer_path) if Path(cfg.tokenizer_path).is_dir() else cfg.tokenizer_path,
        template]))


class PreparedData(Artifact):
    """The data stage's output: token ids + assistant loss masks of every kept sample, and the counts."""

    stage: ClassVar[str] = "prepare-data"

    dataset_path: str = Field(description="Arrow dataset folder (datasets.load_from_disk): input_ids int32 lists, "
                              "loss_mask int8 lists, source_index int64.")
    stats_path: str = Field(description="stats.json: counts, skipped rows by reason, length histogram.")
    max_seq_len: int = Field(description="Longest sample kept, in tokens (longer ones were skipped or truncated).")
    rows_read: int = Field(description="Source rows read (conversations), bad ones included.")
    samples: int = Field(description="Samples kept: rows of the dataset.")
    rows_skipped: int = Field(description="Source rows not kept: bad rows and over-long conversations.")
    rows_skipped_by_reason: dict[str, int] = Field(description="rows_skipped by reason (see eagle3.prepare).")
    samples_truncated: int = Field(description="Samples kept but cut to max_seq_len (overlong='truncate').")
    total_tokens: int = Field(description="Tokens over all kept samples.")
    assistant_tokens: int = Field(description="Tokens with loss_mask = 1.")
    elapsed_s: float = Field(description="Wall time of the stage, seconds.")
    stats_sha256: str | None = Field(None, description="sha256 of stats.json as written (the reuse check).")
    dataset_bytes: dict[str, int] | None = Field(None, description="Byte size of each file of the dataset folder "
                                                 "(relative name -> bytes) as written (the reuse check).")

    def outputs(self) -> list[str]:
        return [self.dataset_path, self.stats_path]

    def problems(self) -> list[str]:
        """Reuse check: stats.json's sha256 and every dataset file's byte size as recorded (sizes, not content:
        hashing a multi-GB dataset on every cache hit costs more than it protects; docs/DESIGN.md "Caching")."""
        if missing := super().problems():
            return missing
        out = [p for p in [file_problem(self.stats_path, sha256=self.stats_sha256)] if p]
        for name, size in (self.dataset_bytes or {}).items():
            if p := file_problem(Path(self.dataset_path) / name, size=size):
                out.append(p)
        return out

    @property
    def stats(self) -> dict[str, Any]:
        """The content of stats.json."""
        return json.loads(Path(self.stats_path).read_text())


class BadRow(Exception):
    """One unusable row; ``reason`` is one of the names in the module docstring."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass
class Encoded:
    input_ids: list[int]
    loss_mask: list[int]


# ---------------------------------------------------------------------------------------------------------------
# Sources -> raw rows
# ---------------------------------------------------------------------------------------------------------------

_HF_SPEC = re.compile(r"^(?P<name>.+?)(?::(?P<split>[A-Za-z_][\w-]*(?:\[[^\]]*\])?))?$")
_HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(?:/[\w.-]+)?(?::[A-Za-z_][\w-]*(?:\[[^\]]*\])?)?$")


@dataclass
class _SourcePart:
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


def iter_rows(sources: list[str], hf_split: str = "train", parts: list[_SourcePart] | None = None
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
            part = _SourcePart(source=source, file=name, first_index=index)
            if parts is not None:
                parts.append(part)
            for row in rows:
                yield index, row
                index += 1
                part.rows += 1


# ---------------------------------------------------------------------------------------------------------------
# Rows -> normalised messages
# ---------------------------------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------------------------------
# Messages -> rendered text + assistant character spans -> tokens + mask
# ---------------------------------------------------------------------------------------------------------------

def load_chat_tokenizer(tokenizer_path: str, chat_template: str | None = None, trust_remote_code: bool = False):
    """Load the verifier's tokenizer; return ``(tokenizer, template_text)``; DataError without a template."""
    from transformers import AutoTokenizer

    local = Path(tokenizer_path)
    if (local.is_absolute() or tokenizer_path.startswith(".") or len(local.parts) > 2) and not local.exists():
        # a folder path (a hub id is "org/name"): say so, not the hub's "repo id must be in the form ..." error
        raise DataError(f"tokenizer not found: {tokenizer_path} does not exist (tokenizer_path: a tokenizer folder, "
                        f"by default the verifier's, verifier_path)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise DataError(f"tokenizer_path {tokenizer_path!r}: cannot load a tokenizer ({e})") from e
    named = tokenizer.chat_template if isinstance(tokenizer.chat_template, dict) else {}
    if chat_template is not None and "{" not in chat_template and chat_template not in named:
        # no Jinja in it: a file path (a template always has {{ or {%), or a typo that must not render as text
        if not Path(chat_template).is_file():
            raise DataError(f"chat_template {chat_template!r}: no such file (nor a template of {tokenizer_path!r})")
        chat_template = Path(chat_template).read_text(encoding="utf-8")
    try:
        template = tokenizer.get_chat_template(chat_template)
    except ValueError as e:
        raise DataError(
            f"tokenizer at {tokenizer_path!r} has no chat template: set PrepareConfig.chat_template ({e})"
        ) from e
    return tokenizer, template


class ChatEncoder:
    """Renders conversations with one tokenizer + template and tokenises them with the assistant mask."""

    def __init__(self, tokenizer: Any, chat_template: str, mask_method: str = "auto", name: str = ""):
        from transformers.utils.chat_template_utils import render_jinja_template

        self._render_jinja = render_jinja_template
        self.tokenizer, self.template, self.name = tokenizer, chat_template, name or "tokenizer"
        self.template_sha256 = hashlib.sha256(chat_template.encode("utf-8")).hexdigest()
        has_generation = re.search(r"\{%-?\s*generation\s*-?%\}", chat_template) is not None
        if mask_method == "generation" and not has_generation:
            raise DataError(f"mask_method='generation' but the chat template of {self.name} has no {{% generation %}}")
        self.method = "generation" if (mask_method == "generation" or (mask_method == "auto" and has_generation)) \
            else "prefix"
        # apply_chat_template passes the special tokens (bos_token, eos_token, ...) to the template: so do we
        self._template_kwargs = dict(tokenizer.special_tokens_map)
        added = getattr(tokenizer, "added_tokens_decoder", {}).values()
        specials = sorted({t.content for t in added if t.special}, key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, specials))) if specials else None
        fast = getattr(tokenizer, "is_fast", False) and hasattr(tokenizer.backend_tokenizer, "encode_batch_fast")
        self._backend = tokenizer.backend_tokenizer if fast else None
        self._check_concatenation()

    def _check_concatenation(self) -> None:
        pieces = ["Hello", " world", "\n\nnew line", " and  spaces"]
        ids = [i for p in self._tokenize(pieces) for i in p]
        text = self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if text != "".join(pieces):
            raise DataError(
                f"tokenizer {self.name}: tokenising text in pieces does not concatenate ({text!r} != "
                f"{''.join(pieces)!r}); it adds something to every call (SentencePiece leading space?), "
                "which the exact assistant mask cannot be built with"
            )

    def _tokenize(self, texts: list[str]) -> list[list[int]]:
        if self._backend is not None:  # the Rust tokenizer itself: what tokenizer(texts) calls, minus offsets
            return [e.ids for e in self._backend.encode_batch_fast(texts, add_special_tokens=False)]
        return self.tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self._render_jinja([messages], chat_template=self.template, add_generation_prompt=add_generation_prompt,
                                  **self._template_kwargs)[0][0]

    def assistant_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """Rendered conversation and the ``[start, end)`` character spans to mask; raises BadRow."""
        assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        try:
            if self.method == "generation":
                (text,), (spans,) = self._render_jinja([messages], chat_template=self.template,
                                                       return_assistant_tokens_mask=True, **self._template_kwargs)
                spans = [tuple(s) for s in spans if s[1] > s[0]]
                if len(spans) != len(assistant) or not all(
                    messages[i]["content"].strip() in text[a:b] for i, (a, b) in zip(assistant, spans)
                ):
                    raise BadRow("content_not_rendered", "generation blocks do not hold the assistant messages")
                return text, spans
            text = self.render(messages)
            spans = []
            for i in assistant:
                before = self.render(messages[:i], add_generation_prompt=True)
                through = text if i == len(messages) - 1 else self.render(messages[: i + 1])
                if not (through.startswith(before) and text.startswith(through)):
                    raise BadRow("not_prefix_stable", f"message {i}")
                spans.append(self._turn_span(text, len(before), len(through), messages[i]["content"], i))
            return text, spans
        except BadRow:
            raise
        except (TemplateError, TypeError, KeyError, IndexError, AttributeError, ValueError) as e:
            # raise_exception() in the template, or e.g. `'+'` on a value the template did not expect
            raise BadRow("template_error", f"{type(e).__name__}: {e}") from None

    def _turn_span(self, text: str, start: int, end: int, content: str, i: int) -> tuple[int, int]:
        turn = text[start:end]  # what the template writes for assistant message i after the generation prompt
        at, length = turn.find(content), len(content)
        if at < 0:  # templates that `| trim` the content
            at, length = turn.find(content.strip()), len(content.strip())
        if at < 0:
            raise BadRow("content_not_rendered", f"message {i}")
        stop = start + at + length
        if self._special_re is not None:
            m = self._special_re.search(text, stop, end)
            if m and not text[stop:m.start()].strip():
                stop = m.end()  # the end-of-turn token the verifier generates
        return start + at, stop

    def encode(self, conversations: list[list[dict]]) -> list[Encoded | BadRow]:
        """Render + tokenise a batch; one tokenizer call for all pieces of all conversations."""
        pieces: list[str] = []
        layout: list[list[tuple[int, int]] | BadRow] = []  # per conversation: (piece index, mask flag) list
        for messages in conversations:
            try:
                text, spans = self.assistant_spans(messages)
            except BadRow as bad:
                layout.append(bad)
                continue
            entry, pos = [], 0
            for a, b in _merge(spans):
                for s, e, flag in ((pos, a, 0), (a, b, 1)):
                    if e > s:
                        entry.append((len(pieces), flag))
                        pieces.append(text[s:e])
                pos = b
            if len(text) > pos:
                entry.append((len(pieces), 0))
                pieces.append(text[pos:])
            layout.append(entry)
        ids = self._tokenize(pieces) if pieces else []
        out: list[Encoded | BadRow] = []
        for entry in layout:
            if isinstance(entry, BadRow):
                out.append(entry)
                continue
            input_ids: list[int] = []
            mask: list[int] = []
            for k, flag in entry:
                input_ids.extend(ids[k])
                mask.extend([flag] * len(ids[k]))
            out.append(Encoded(input_ids, mask))
        return out


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[list[int]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


# ---------------------------------------------------------------------------------------------------------------
# The stage
# ---------------------------------------------------------------------------------------------------------------

class _Tally:
    def __init__(self) -> None:
        self.read = 0
        self.skipped: dict[str, dict[str, Any]] = {}

    def bad(self, index: int, reason: str) -> None:
        entry = self.skipped.setdefault(reason, {"count": 0, "first_indices": []})
        entry["count"] += 1
        if len(entry["first_indices"]) < FIRST_INDICES_KEPT:
            entry["first_indices"].append(index)


class _Kept:
    """Kept samples, converted to Arrow per batch (5 bytes/token instead of ~40 as Python ints)."""

    def __init__(self) -> None:
        self.schema = pa.schema([("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8())),
                                 ("source_index", pa.int64())])
        self.batches: list = []
        self.lengths: list[int] = []
        self.assistant_tokens = 0
        self._ids: list[list[int]] = []
        self._mask: list[list[int]] = []
        self._index: list[int] = []

    @property
    def count(self) -> int:
        return len(self.lengths)

    def add(self, index: int, sample: Encoded) -> None:
        self._ids.append(sample.input_ids)
        self._mask.append(sample.loss_mask)
        self._index.append(index)
        self.lengths.append(len(sample.input_ids))
        self.assistant_tokens += sum(sample.loss_mask)

    def flush(self) -> None:
        if self._index:
            self.batches.append(pa.RecordBatch.from_arrays(
                [pa.array(self._ids, pa.list_(pa.int32())), pa.array(self._mask, pa.list_(pa.int8())),
                 pa.array(self._index, pa.int64())], schema=self.schema))
        self._ids, self._mask, self._index = [], [], []


def _histogram(lengths: list[int], max_seq_len: int) -> list[dict[str, int]]:
    edges = [0]
    while edges[-1] < max_seq_len:
        edges.append(min(max(64, edges[-1] * 2), max_seq_len))
    edges[-1] = max(edges[-1], max(lengths, default=0)) + 1
    counts = [0] * (len(edges) - 1)
    for n in lengths:
        counts[bisect.bisect_right(edges, n) - 1] += 1
    return [{"min_tokens": lo, "max_tokens": hi - 1, "count": c} for lo, hi, c in zip(edges, edges[1:], counts)]


def prepare_data(cfg: PrepareConfig | dict, out_dir: str | Path, on_update=None) -> PreparedData:
    """Read, normalise, render, tokenise and mask the sources; write ``out_dir/dataset`` and ``out_dir/stats.json``.

    ``on_update(done, total, line)`` mirrors the progress log lines (e.g. to a Prefect task). Raises DataError on a
    missing source, a tokenizer without a chat template, or when no row is usable; nothing is written then.
    """
    cfg = PrepareConfig.model_validate(cfg)
    out_dir = Path(out_dir)
    t0 = time.monotonic()
    log.info("[data] reading %s with the tokenizer of %s%s", ", ".join(map(str, cfg.sources)), cfg.tokenizer_path,
             f" (the first {cfg.max_samples:,} usable samples)" if cfg.max_samples else "")
    tokenizer, template = load_chat_tokenizer(cfg.tokenizer_path, cfg.chat_template, cfg.trust_remote_code)
    encoder = ChatEncoder(tokenizer, template, cfg.mask_method, name=repr(cfg.tokenizer_path))

    parts: list[_SourcePart] = []
    rows: Iterator[tuple[int, dict | BadRow]] = iter_rows(cfg.sources, cfg.hf_split, parts)
    lazy = cfg.shuffle_seed is None  # stream rows; only a shuffle needs them all in memory
    if not lazy:
        materialised = list(rows)
        random.Random(cfg.shuffle_seed).shuffle(materialised)
        rows = iter(materialised)
    # progress counts what the stage will really process: rows when every row is read (shuffled, no cap), kept
    # samples up to the cap otherwise (a stream without a cap: total 0 = open-ended)
    count_rows = not lazy and not cfg.max_samples
    if count_rows:
        total = len(materialised)
    else:
        total = min(cfg.max_samples, len(materialised)) if not lazy and cfg.max_samples else (cfg.max_samples or 0)
    progress = Progress("data", total, unit="rows" if count_rows else "samples", every_s=30.0, on_update=on_update)

    tally = _Tally()
    kept = _Kept()
    truncated = 0
    limit = cfg.max_samples or float("inf")
    exhausted = False
    while kept.count < limit and not exhausted:
        want = min(_RENDER_BATCH, max(8, int(limit - kept.count))) if cfg.max_samples else _RENDER_BATCH
        batch: list[tuple[int, dict | BadRow]] = []
        for item in rows:
            batch.append(item)
            if len(batch) >= want:
                break
        else:
            exhausted = True
        convs, conv_rows, results = [], [], {}
        for index, row in batch:
            try:
                if isinstance(row, BadRow):
                    raise row
                convs.append(normalize_row(row, cfg.format))
                conv_rows.append(index)
            except BadRow as bad:
                results[index] = bad
        results.update(zip(conv_rows, encoder.encode(convs)))
        for index, _ in batch:
            if kept.count >= limit:
                break
            tally.read += 1
            res = results[index]
            if isinstance(res, Encoded) and len(res.input_ids) > cfg.max_seq_len:
                if cfg.overlong == "skip":
                    res = BadRow("overlong")
                else:
                    res = Encoded(res.input_ids[: cfg.max_seq_len], res.loss_mask[: cfg.max_seq_len])
                    if any(res.loss_mask):
                        truncated += 1  # kept, shortened
                    else:
                        res = BadRow("no_assistant_tokens")
            if isinstance(res, BadRow):
                tally.bad(index, res.reason)
                progress.update(1 if count_rows else 0)
                continue
            kept.add(index, res)
            progress.update(1, tokens=len(res.input_ids))
        kept.flush()

    skipped = {k: tally.skipped[k] for k in sorted(tally.skipped)}
    summary = ", ".join(f"{k}: {v['count']} (rows {v['first_indices']})" for k, v in skipped.items())
    if not kept.count:
        raise DataError(f"no usable row in sources {cfg.sources}: {summary or 'no rows'}")
    if skipped:
        log.warning("[data] skipped %d of %d rows: %s", tally.read - kept.count, tally.read, summary)

    lengths = kept.lengths
    total_tokens, assistant_tokens = sum(lengths), kept.assistant_tokens
    stats = {
        "format": STATS_FORMAT,
        "sources": [{"source": p.source, "file": p.file, "first_index": p.first_index, "rows": p.rows} for p in parts],
        "samples_read": tally.read,
        "samples_kept": kept.count,
        "samples_skipped": sum(v["count"] for v in skipped.values()),
        "skipped": skipped,
        "truncated": truncated,
        "total_tokens": total_tokens,
        "assistant_tokens": assistant_tokens,
        "assistant_fraction": round(assistant_tokens / total_tokens, 6),
        "max_len_tokens": max(lengths),
        "mean_len_tokens": round(total_tokens / len(lengths), 3),
        "length_histogram": _histogram(lengths, cfg.max_seq_len),
        "tokenizer_path": str(cfg.tokenizer_path),
        "chat_template_sha256": encoder.template_sha256,
        "mask_method": encoder.method,
        "config": cfg.model_dump(mode="json"),
    }

    table = pa.Table.from_batches(kept.batches)
    import datasets

    dataset_path = out_dir / "dataset"
    bars_were_on = not datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()  # a tqdm bar per save: noise in task logs
    try:
        with atomic_path(dataset_path) as tmp:
            datasets.Dataset(table).save_to_disk(str(tmp))
    finally:
        if bars_were_on:
            datasets.enable_progress_bars()
    stats_path = atomic_write_json(out_dir / "stats.json", stats)
    elapsed = time.monotonic() - t0
    progress.finish()
    log.info("[data] kept %s of %s rows read (%s skipped); dataset written in %s", f"{kept.count:,}",
             f"{tally.read:,}", f"{stats['samples_skipped']:,}", fmt_duration(elapsed))
    prepared = PreparedData(
        out_dir=str(out_dir), dataset_path=str(dataset_path), stats_path=str(stats_path),
        fingerprint=content_fingerprint(dataset_path, stats),
        stats_sha256=sha256_file(stats_path), dataset_bytes={
            f.relative_to(dataset_path).as_posix(): f.stat().st_size for f in sorted(dataset_path.rglob("*"))
            if f.is_file()},
        max_seq_len=cfg.max_seq_len, rows_read=tally.read, samples=kept.count,
        rows_skipped=stats["samples_skipped"], rows_skipped_by_reason={k: v["count"] for k, v in skipped.items()},
        samples_truncated=truncated, total_tokens=total_tokens, assistant_tokens=assistant_tokens,
        elapsed_s=round(elapsed, 3))
    prepared.save()
    return prepared
