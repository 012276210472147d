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
import json
import logging
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar, Literal

import pyarrow as pa
from pydantic import Field

from eagle3.chat.encoder import ChatSettings, Encoded
from eagle3.chat.errors import BadRow, DataError
from eagle3.chat.sources import SourcePart, iter_rows, normalize_row
from eagle3.support.artifacts import Artifact, file_problem
from eagle3.support.io import atomic_path, atomic_write_json, fingerprint_paths, sha256_file, sha256_json
from eagle3.support.progress import Progress, fmt_duration
from eagle3.support.settings import RUNTIME

log = logging.getLogger("eagle3.prepare")

STATS_FORMAT = "eagle3-prepared-data/1"
FIRST_INDICES_KEPT = 5
_RENDER_BATCH = 256  # conversations rendered + tokenised per batched tokenizer call

class PrepareConfig(ChatSettings):
    """Where the conversations come from and how they become verifier tokens (the chat settings: eagle3.chat)."""

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
    encoder = cfg.encoder()

    parts: list[SourcePart] = []
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
