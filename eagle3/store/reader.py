"""Reading a hidden-state store: ``HiddenStateStore``, the only way trainers read hidden states (layout:
eagle3.store.format; manifest: eagle3.store.manifest).

Integrity: the manifest holds each sample's byte size and sha256. ``check_sizes`` (one ``lstat`` per sample) is the
check a reused store always passes; ``verify_sample`` hashes a sample on its first read by a store object (the
trainer's loader threads), and a sample that fails is moved to ``quarantine/`` so that extraction's resume sees it
missing and extracts it again.

Samples are read through ``safetensors.safe_open``. A hand-written memory-mapping reader was kept until a side-by-
side measure showed no need for it: reading a Kimi-K2.5 row (2,048 tokens, 117 MB bf16) and copying its aux states
into a batch took 17.0 ms through safe_open against 16.2 ms through views of a private mmap (1.05x; page cache warm,
2 shared cores at load 2.7; the tensors a store hands out are copied into batches anyway). bench/store_reader.py
measures the read path against the file's plain read.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from eagle3.store.format import (
    DTYPES,
    FORMAT,
    QUARANTINE,
    SCALE_SUFFIX,
    STATE_KEYS,
    STORE_DTYPES,
    STORE_JSON,
    TOKEN_TENSORS,
    CorruptSample,
    StoreError,
    dequantize_states,
    is_scaled,
    sample_tensors,
    store_identity,
)
from eagle3.store.manifest import read_json, read_manifest
from eagle3.support.io import sha256_file


def read_sample(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of one sample file; StoreError naming the file when it cannot be read."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - safe_open is no mapping
    except (SafetensorError, OSError, ValueError) as e:
        raise StoreError(f"{path}: unreadable sample file ({e})") from None


class HiddenStateStore:
    """Read access to a finished (or partly finished) store; the only way trainers read hidden states.

    ``len(store)`` and ``indices()`` count samples with a manifest line (``strict=False`` skips damaged manifest
    lines instead of raising; extraction's resume uses it before repairing the manifest). ``load(i)`` returns
    ``{"aux_hidden_states": [T, n_aux*H], "final_hidden_state": [T, H], "input_ids": [T] int64,
    "loss_mask": [T] uint8}`` memory-mapped from the sample's file, plus ``<state>_scale`` tensors in a scaled
    store (``scaled``; read states through ``dequantize_states`` there).
    """

    def __init__(self, path: str | os.PathLike, strict: bool = True):
        self.path = Path(path)
        meta_path = self.path / STORE_JSON
        if not meta_path.is_file():
            raise StoreError(f"not a hidden-state store: {meta_path} is missing")
        self.meta: dict[str, Any] = read_json(meta_path)
        if self.meta.get("format") != FORMAT:
            raise StoreError(f"{meta_path}: format {self.meta.get('format')!r}, expected {FORMAT!r}")
        self._entries = read_manifest(self.path, strict=strict)
        self._sorted = sorted(self._entries)
        self._verified: set[int] = set()  # samples whose file passed verify_sample (hashed once per store object)
        self._groups_ok: set[Path] = set()  # rows_* folders seen to be real folders (not symlinks)

    @property
    def hidden_size(self) -> int:
        return int(self.meta["hidden_size"])

    @property
    def aux_layer_ids(self) -> list[int]:
        """vLLM convention: id k = residual stream entering decoder layer k."""
        return list(self.meta["aux_layer_ids"])

    @property
    def dtype(self) -> torch.dtype:
        return STORE_DTYPES[self.meta["dtype"]]

    @property
    def scaled(self) -> bool:
        """States stored with per-token scales (float8_e4m3fn): state = stored value * ``<key>_scale``."""
        return is_scaled(self.meta["dtype"])

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, index: int) -> bool:
        return index in self._entries

    def __iter__(self) -> Iterator[int]:
        return iter(self._sorted)

    def indices(self) -> list[int]:
        return list(self._sorted)

    def entry(self, index: int) -> dict[str, Any]:
        try:
            return self._entries[index]
        except KeyError:
            raise StoreError(f"sample {index} is not in store {self.path} (no manifest line)") from None

    def tokens(self, index: int) -> int:
        return int(self.entry(index)["tokens"])

    @property
    def total_tokens(self) -> int:
        return sum(int(e["tokens"]) for e in self._entries.values())

    def file(self, index: int) -> Path:
        return self.path / self.entry(index)["file"]

    def prefetch(self, indices: list[int]) -> None:
        """Ask the kernel to start reading these samples' files into the page cache (posix_fadvise WILLNEED:
        asynchronous, whole-file reads instead of page-fault-sized ones when ``load`` touches them)."""
        for i in indices:
            with contextlib.suppress(OSError, StoreError):  # a missing file is load's error to report
                fd = os.open(self.file(i), os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                finally:
                    os.close(fd)

    def missing_indices(self, start: int = 0, end: int | None = None) -> list[int]:
        """Dataset indices in [start, end) without a finished sample."""
        end = self.meta["num_samples"] if end is None else end
        return [i for i in range(start, end) if i not in self._entries]

    def load(self, index: int) -> dict[str, torch.Tensor]:
        path = self.file(index)
        if (problem := self._file_problem(index, sizes=False)) is not None:
            raise StoreError(f"sample {index}: {problem}")
        tensors = read_sample(path)
        self._check(index, path, tensors)
        return tensors

    def _check(self, index: int, path: Path, t: dict[str, torch.Tensor]) -> None:
        layout = sample_tensors(self.tokens(index), int(self.meta["n_aux"]), self.hidden_size, self.meta["dtype"])
        missing = [k for k, _, _ in layout if k not in t]
        if missing:
            raise StoreError(f"sample {index} ({path}): missing tensors {missing}")
        for k, _, shape in layout:
            if tuple(t[k].shape) != shape:
                raise StoreError(f"sample {index} ({path}): {k} has shape {tuple(t[k].shape)}, expected {shape}")
        for k, dtype, _ in layout:
            if k not in dict(TOKEN_TENSORS) and t[k].dtype != DTYPES[dtype].torch:  # the states and their scales
                raise StoreError(f"sample {index} ({path}): {k} is {t[k].dtype}, expected {dtype}")

    def _file_problem(self, index: int, sizes: bool = True) -> str | None:
        """None when sample ``index``'s listed file is a regular file inside the store (neither it nor its rows_*
        folder a symlink) with the manifest's byte size (``sizes``), else the reason. One lstat per call, plus one
        per rows_* folder per store object."""
        entry = self.entry(index)
        path = self.path / entry["file"]
        try:
            st = os.lstat(path)
            if path.parent not in self._groups_ok:
                if stat.S_ISLNK(os.lstat(path.parent).st_mode):
                    return f"folder {path.parent} is a symlink (a store's files must lie inside the store)"
                self._groups_ok.add(path.parent)
        except FileNotFoundError:
            return f"file {path} is missing"
        if stat.S_ISLNK(st.st_mode):
            return f"file {path} is a symlink (a store's files must lie inside the store)"
        if not stat.S_ISREG(st.st_mode):
            return f"{path} is not a regular file"
        if sizes and "bytes" in entry and st.st_size != int(entry["bytes"]):
            return f"file {path} has {st.st_size} bytes, manifest says {entry['bytes']}"
        return None

    def check_sizes(self) -> list[str]:
        """The check every reuse of the store passes: each listed sample's file is in place (inside the store) with
        its recorded byte size. One lstat per sample (cost: docs/DESIGN.md, "Caching"); [] when all pass."""
        return [f"sample {i}: {p}" for i in self._sorted if (p := self._file_problem(i)) is not None]

    def verify_sample(self, index: int) -> None:
        """Check sample ``index`` against its manifest line (size, sha256, header, shapes) on its first call per
        store object: the trainer's loader threads share one, so every sample is hashed on its first read of a
        run, while the model computes. A sample that fails is moved to ``quarantine/`` (never read again, and
        extraction's resume sees it missing and extracts it anew) and CorruptSample names it and what to do."""
        if index in self._verified:
            return
        reason = self.check_file(index)
        if reason is None:
            self._verified.add(index)
            return
        moved = self.quarantine(index)
        where = f"moved to {moved}" if moved else "left where it is"
        raise CorruptSample(
            f"sample {index} of store {self.path} is damaged: {reason}. It was not trained on ({where}). Rerun the "
            f"pipeline: its extraction stage extracts this sample again (only the missing ones) and training "
            f"resumes; outside the pipeline, rerun extraction into {self.path} first")

    def quarantine(self, index: int) -> Path | None:
        """Move sample ``index``'s file to ``<store>/quarantine/`` (its manifest line stays, so every reader sees
        the file missing until extraction writes it again). None when the file is already gone (another loader
        thread or process moved it) or cannot be moved."""
        src = self.path / self.entry(index)["file"]
        dst = self.path / QUARANTINE / f"{src.name}.{time.strftime('%Y%m%d-%H%M%S')}.{os.getpid()}"
        try:
            dst.parent.mkdir(exist_ok=True)
            os.rename(src, dst)
        except OSError:
            return None
        return dst

    def check_file(self, index: int, hash_check: bool = True) -> str | None:
        """None when sample ``index`` is intact, else the reason (missing, symlink, size/sha256 mismatch, bad
        header, shapes)."""
        path = self.file(index)
        entry = self.entry(index)
        if (problem := self._file_problem(index)) is not None:
            return problem
        if hash_check and sha256_file(path) != entry["sha256"]:
            return f"file {path} does not match its manifest sha256"
        try:
            self._check(index, path, read_sample(path))
        except StoreError as e:
            return str(e)
        return None

    def verify(self, hash_check: bool = True, check_finite: bool = False) -> dict[str, int]:
        """Check every listed sample (file present, sha256, shapes, dtypes; optionally no NaN/Inf).

        Returns {"samples", "tokens", "bytes"}; raises StoreError naming the first bad samples.
        """
        bad: list[str] = []
        nbytes = 0
        for i in self._sorted:
            reason = self.check_file(i, hash_check=hash_check)
            if reason is None and check_finite:
                t = self.load(i)
                for k in STATE_KEYS:
                    x = dequantize_states(t[k], t[k + SCALE_SUFFIX]) if self.scaled else t[k]
                    if not torch.isfinite(x).all():
                        reason = f"{k} has NaN/Inf"
            if reason is not None:
                bad.append(f"sample {i}: {reason}")
            else:
                nbytes += self.file(i).stat().st_size
        if bad:
            more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
            raise StoreError(f"store {self.path}: {len(bad)} bad samples: " + "; ".join(bad[:5]) + more)
        return {"samples": len(self._sorted), "tokens": self.total_tokens, "bytes": nbytes}

    def fingerprint(self) -> str:
        """The store's identity: what was extracted (``eagle3.store.format.store_identity``), not its bytes (each
        file's bytes are checked against its own sha256 where it is read), so a repaired sample keeps it."""
        return store_identity(self.meta, self._entries)

    def __repr__(self) -> str:
        return (f"HiddenStateStore({str(self.path)!r}, samples={len(self)}/{self.meta['num_samples']}, "
                f"hidden={self.hidden_size}, aux_layer_ids={self.aux_layer_ids} (vLLM convention), "
                f"dtype={self.meta['dtype']})")
