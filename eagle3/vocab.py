"""Draft vocabulary: the most frequent ASSISTANT tokens of the prepared dataset, and the d2t / t2d tables.

Pipeline position: prepare -> **vocab** -> train / validate / checkpoint.

* ``count_assistant_tokens`` counts token ids over loss-masked positions only (mask 1 = assistant token), streaming
  the Arrow dataset in record batches and counting each batch with one ``torch.bincount``.
* ``build_vocab_mapping`` keeps the ``draft_vocab_size`` most frequent ids (ties: higher count first, then lower id),
  sorted ascending by id, and builds

      d2t [draft_vocab]  int64  OFFSET table: target_id = draft_id + d2t[draft_id]
      t2d [target_vocab] bool   True exactly at the kept target ids

  as vLLM's ``Eagle3LlamaForCausalLM`` reads them (see shared/EAGLE3_FACTS.md).
* ``save_mapping`` / ``load_mapping`` write and check ``mapping.safetensors`` + ``report.json``.
* ``sized_to_data``: the vocab stage's draft vocabulary size when the data holds fewer distinct assistant tokens than
  ``draft_vocab_size`` (``VocabConfig.size_to_data``): the seen ids, rounded up to a multiple of ``VOCAB_ALIGN``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import ClassVar

import numpy as np
import pyarrow.compute as pc
import torch
from pydantic import BaseModel, Field
from safetensors import SafetensorError
from safetensors.torch import load_file

from eagle3.chat.dataset import PreparedDataset
from eagle3.prepare import PreparedData
from eagle3.support.artifacts import Artifact, file_problem
from eagle3.support.io import atomic_path, atomic_write_json, save_safetensors, sha256_file
from eagle3.support.settings import SETTINGS_MODEL

log = logging.getLogger("eagle3")

MAPPING_FILE = "mapping.safetensors"
REPORT_FILE = "report.json"
_BATCH_SAMPLES = 4096  # samples per Arrow record batch while counting (memory ~ batch tokens * 9 bytes)
_TOP_TOKENS_IN_REPORT = 50
VOCAB_ALIGN = 64  # a data-sized draft vocabulary is a multiple of this many rows (lm_head GEMM tiles on GPUs)


class VocabError(ValueError):
    """Bad vocab input (dataset, sizes) or a mapping file that fails its checks; the message names it."""


class VocabConfig(BaseModel):
    """Draft-vocabulary knobs. Frequencies are always counted over loss-masked (assistant) tokens."""

    model_config = SETTINGS_MODEL

    draft_vocab_size: int = Field(
        32000,
        gt=0,
        description="Size of the draft model's output vocabulary, in tokens: the most frequent assistant-token ids "
        "of the training data (32000 in the public Kimi-K2 EAGLE-3 draft); with size_to_data, the most it holds.",
    )
    size_to_data: bool = Field(
        True,
        description="When the data holds fewer distinct assistant tokens than draft_vocab_size, keep only those "
        f"(rounded up to a multiple of {VOCAB_ALIGN} rows, the last slots then unseen ids, lowest first) instead of "
        "filling every slot with unseen ids the draft never sees as a target: the lm_head, its log-softmax and the "
        "teacher rows shrink with it (1.3x faster training, vLLM acceptance within about 1%: README, 'The draft "
        "vocabulary's size'). false = always draft_vocab_size slots, unseen ids filling the rest, lowest first.",
    )


def count_assistant_tokens(
    dataset_dir: str | Path, target_vocab_size: int, batch_samples: int = _BATCH_SAMPLES
) -> torch.Tensor:
    """Occurrences of each target token id at loss-masked (assistant) positions -> [target_vocab_size] int64.

    The prepared dataset's reader checks every sample first (eagle3.chat.dataset: equal input_ids / loss_mask
    lengths, mask values in {0, 1}, ids inside [0, target_vocab_size): an id outside means the dataset was tokenized
    for another verifier).
    """
    ds = PreparedDataset(dataset_dir, VocabError)
    ds.check(target_vocab_size)
    counts = torch.zeros(target_vocab_size, dtype=torch.int64)
    for _, table in ds.batches(batch_samples):
        ids = torch.from_numpy(pc.list_flatten(table.column("input_ids")).to_numpy().astype(np.int64))  # [tokens]
        mask = torch.from_numpy(pc.list_flatten(table.column("loss_mask")).to_numpy().astype(np.int64))  # [tokens]
        counts += torch.bincount(ids[mask.bool()], minlength=target_vocab_size)
    return counts


def tables_for(kept: torch.Tensor, target_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The vLLM tables of a draft vocabulary given as its target ids ``kept`` [draft_vocab] (ascending):
    d2t [draft_vocab] int64 offsets (target = draft id + d2t) and t2d [target_vocab] bool."""
    kept = torch.as_tensor(kept, dtype=torch.int64)
    d2t = kept - torch.arange(len(kept), dtype=torch.int64)  # [draft_vocab]
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)  # [target_vocab]
    t2d[kept] = True
    _check_mapping(d2t, t2d, Path("<tables_for>"))
    return d2t, t2d


def build_vocab_mapping(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Top ``draft_vocab_size`` ids of ``counts`` [target_vocab] -> (d2t [draft_vocab] int64, t2d [target_vocab] bool,
    report).

    Ties: higher count first, then lower id. When fewer ids were seen than the draft vocabulary holds, the remaining
    slots take unseen ids by the same rule (count 0 -> lowest ids first) and the report says how many.
    """
    counts = counts.to(torch.int64).flatten()  # [target_vocab]
    target_vocab_size = len(counts)
    if draft_vocab_size > target_vocab_size:
        raise VocabError(
            f"draft_vocab_size {draft_vocab_size} is larger than the target vocabulary ({target_vocab_size} tokens)"
        )
    if draft_vocab_size <= 0:
        raise VocabError(f"draft_vocab_size must be positive, got {draft_vocab_size}")
    total = int(counts.sum())
    if total == 0:
        raise VocabError("no loss-masked (assistant) tokens were counted: cannot choose a draft vocabulary")
    # stable sort keeps ascending id order among equal counts -> the tie-break "lower id first"
    order = torch.sort(counts, descending=True, stable=True).indices  # [target_vocab]
    kept = torch.sort(order[:draft_vocab_size]).values  # [draft_vocab] target ids, ascending
    d2t, t2d = tables_for(kept, target_vocab_size)

    distinct = int((counts > 0).sum())
    covered = int(counts[kept].sum())
    top = order[: min(_TOP_TOKENS_IN_REPORT, distinct)]
    report = {
        "draft_vocab_size": draft_vocab_size,
        "target_vocab_size": target_vocab_size,
        "count_source": "loss-masked (assistant) tokens",
        "distinct_tokens_seen": distinct,
        "assistant_token_occurrences": total,
        "covered_occurrences": covered,
        "coverage": covered / total,
        "seen_tokens_dropped": max(0, distinct - draft_vocab_size),
        "unseen_tokens_filled": max(0, draft_vocab_size - distinct),
        "top_tokens": [{"id": int(i), "count": int(counts[i])} for i in top],
    }
    if report["unseen_tokens_filled"]:
        report["note"] = (
            f"only {distinct} distinct assistant tokens were seen; the other {report['unseen_tokens_filled']} draft "
            "slots hold unseen target ids, lowest ids first"
        )
    return d2t, t2d, report


def sized_to_data(distinct_seen: int, draft_vocab_size: int) -> int:
    """The draft vocabulary for ``distinct_seen`` distinct assistant tokens, at most ``draft_vocab_size``: the seen ids
    rounded up to a multiple of ``VOCAB_ALIGN`` (at least one multiple)."""
    aligned = max(1, -(-distinct_seen // VOCAB_ALIGN)) * VOCAB_ALIGN
    return min(draft_vocab_size, aligned)


def save_mapping(out_dir: str | Path, d2t: torch.Tensor, t2d: torch.Tensor, report: dict) -> Path:
    """Write ``mapping.safetensors`` (d2t, t2d) and ``report.json`` atomically; return the mapping path."""
    out_dir = Path(out_dir)
    _check_mapping(d2t, t2d, out_dir / MAPPING_FILE)
    path = out_dir / MAPPING_FILE
    with atomic_path(path) as tmp:
        save_safetensors({"d2t": d2t.contiguous(), "t2d": t2d.contiguous()}, tmp, metadata={"format": "pt"})
    atomic_write_json(out_dir / REPORT_FILE, report)
    return path


def load_mapping(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Read and check (d2t [draft_vocab] int64, t2d [target_vocab] bool) from ``mapping.safetensors`` or its folder."""
    path = Path(path)
    if path.is_dir():
        path = path / MAPPING_FILE
    if not path.is_file():
        raise VocabError(f"vocab mapping not found: {path}")
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise VocabError(f"vocab mapping {path} is not a readable safetensors file: {e}") from None
    missing = {"d2t", "t2d"} - set(tensors)
    if missing:
        raise VocabError(f"vocab mapping {path} lacks tensor(s) {sorted(missing)} (has {sorted(tensors)})")
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    _check_mapping(d2t, t2d, path)
    return d2t, t2d


def _check_mapping(d2t: torch.Tensor, t2d: torch.Tensor, path: Path) -> None:
    if d2t.dtype != torch.int64 or d2t.dim() != 1:
        raise VocabError(f"vocab mapping {path}: d2t must be 1-D int64, got {d2t.dtype} {list(d2t.shape)}")
    if t2d.dtype != torch.bool or t2d.dim() != 1:
        raise VocabError(f"vocab mapping {path}: t2d must be 1-D bool, got {t2d.dtype} {list(t2d.shape)}")
    draft, target = len(d2t), len(t2d)
    if draft == 0 or draft > target:
        raise VocabError(f"vocab mapping {path}: draft vocab {draft} must be in 1..target vocab {target}")
    ids = torch.arange(draft, dtype=torch.int64) + d2t  # [draft_vocab] target ids
    if int(ids.min()) < 0 or int(ids.max()) >= target or not bool((ids[1:] > ids[:-1]).all()):
        raise VocabError(
            f"vocab mapping {path}: arange + d2t must give strictly ascending target ids in [0, {target})"
        )
    if int(t2d.sum()) != draft or not bool(t2d[ids].all()):
        raise VocabError(
            f"vocab mapping {path}: t2d must be True exactly at the {draft} target ids arange + d2t "
            f"(it has {int(t2d.sum())} True entries)"
        )


class VocabMapping(Artifact):
    """The vocab stage's output: the draft vocabulary as vLLM's d2t / t2d tables, and its coverage."""

    stage: ClassVar[str] = "build-vocab"

    mapping_path: str = Field(description="mapping.safetensors: d2t [draft_vocab] int64, t2d [target_vocab] bool.")
    report_path: str = Field(description="report.json: counts, coverage, the most frequent tokens.")
    draft_vocab_size: int = Field(description="Draft vocabulary, tokens.")
    target_vocab_size: int = Field(description="Verifier vocabulary, tokens.")
    distinct_tokens_seen: int = Field(description="Distinct assistant-token ids in the data.")
    assistant_token_occurrences: int = Field(description="Assistant tokens counted (loss mask = 1).")
    coverage: float = Field(description="Share of assistant-token occurrences the draft vocabulary holds.")

    def outputs(self) -> list[str]:
        return [self.mapping_path, self.report_path]

    def problems(self) -> list[str]:
        """Reuse check: mapping.safetensors' sha256 is the fingerprint (draft + target vocab entries: < 2 MB)."""
        return super().problems() or [p for p in [file_problem(self.mapping_path, sha256=self.fingerprint)] if p]


def build_vocab(cfg: VocabConfig, dataset: PreparedData | str | Path, target_vocab_size: int,
                out_dir: str | Path) -> VocabMapping:
    """Count, choose, write (the vocab stage). ``dataset``: the prepare stage's artifact or a prepared dataset
    folder; ``target_vocab_size``: the verifier's vocabulary."""
    dataset_dir = dataset.dataset_path if isinstance(dataset, PreparedData) else str(dataset)
    if cfg.draft_vocab_size > target_vocab_size:  # fail before reading the dataset
        raise VocabError(
            f"draft_vocab_size {cfg.draft_vocab_size} is larger than the target vocabulary ({target_vocab_size} tokens)"
        )
    counts = count_assistant_tokens(dataset_dir, target_vocab_size)
    size = cfg.draft_vocab_size
    if cfg.size_to_data:
        size = sized_to_data(int((counts > 0).sum()), cfg.draft_vocab_size)
    d2t, t2d, report = build_vocab_mapping(counts, size)
    report.update(dataset=str(dataset_dir), configured_draft_vocab_size=cfg.draft_vocab_size,
                  size_to_data=cfg.size_to_data)
    if size < cfg.draft_vocab_size:
        report["note"] = (
            f"sized to the data (size_to_data): {report['distinct_tokens_seen']} distinct assistant tokens seen, so "
            f"{size} draft slots (a multiple of {VOCAB_ALIGN}) instead of draft_vocab_size {cfg.draft_vocab_size}"
            + (f"; the last {report['unseen_tokens_filled']} hold unseen ids" if report["unseen_tokens_filled"] else "")
        )
        log.info("[vocab] %s", report["note"])
    elif report["unseen_tokens_filled"]:  # fewer than VOCAB_ALIGN when sized to the data: nothing to warn about
        (log.info if cfg.size_to_data else log.warning)("[vocab] %s", report["note"])
    mapping = save_mapping(out_dir, d2t, t2d, report)
    log.info(
        "[vocab] draft vocab %d of %d: %d distinct assistant tokens seen, coverage %.4f of %d assistant tokens",
        size, target_vocab_size, report["distinct_tokens_seen"], report["coverage"],
        report["assistant_token_occurrences"],
    )
    result = VocabMapping(
        out_dir=str(out_dir), fingerprint=sha256_file(mapping), mapping_path=str(mapping),
        report_path=str(Path(out_dir) / REPORT_FILE), draft_vocab_size=size,
        target_vocab_size=target_vocab_size, distinct_tokens_seen=report["distinct_tokens_seen"],
        assistant_token_occurrences=report["assistant_token_occurrences"], coverage=report["coverage"])
    result.save()
    return result
