"""The store's metadata file and manifest: creating and resuming a store, writing a finished sample's bytes and its
manifest line, reading, repairing and rebuilding the manifest (layout: eagle3.store.format).

A sample file exists under its final name only once complete (temp name + fsync + rename), and a manifest line
exists only for a file that is in place, so a crash at any point leaves at worst a stray temp file (removed by the
next run: ``clean_temp_files``) or a complete file without a manifest line (its line is rebuilt from the file by the
next run: ``entry_from_file``). A torn last manifest line (``kill -9`` inside the write) is ignored by the reader.
Every manifest ``file`` must name a file inside the store (``rows_*/sample_*.safetensors``, no symlink), else
StoreError. Several shard writers may share a store: appends and rewrites hold the manifest's flock.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from eagle3.store.format import (
    _RESUME_KEYS,
    DEFAULT_GROUP_SIZE,
    MANIFEST,
    STORE_JSON,
    TMP_SUFFIX,
    StoreError,
    inside_store,
    sample_entry,
    sample_relpath,
    store_meta,
    token_digest,
)
from eagle3.support.io import atomic_write_bytes, atomic_write_json, atomic_write_text, sha256_file


def init_store(
    store_dir: str | os.PathLike,
    *,
    verifier: str | os.PathLike,
    aux_layer_ids: list[int],
    hidden_size: int,
    num_samples: int,
    dtype: str = "bfloat16",
    backend: str = "transformers",
    group_size: int = DEFAULT_GROUP_SIZE,
    fingerprint: str | None = None,
) -> dict[str, Any]:
    """Create a store folder with its ``store.json`` (or check an existing one); returns the metadata in force.

    ``aux_layer_ids`` in vLLM's convention; ``fingerprint`` defaults to eagle3.support.verifier.verifier_fingerprint(verifier).
    """
    meta = store_meta(verifier=verifier, aux_layer_ids=aux_layer_ids, hidden_size=hidden_size, dtype=dtype,
                      num_samples=num_samples, backend=backend, group_size=group_size, fingerprint=fingerprint)
    return ensure_store(store_dir, meta)


def ensure_store(store_dir: str | os.PathLike, meta: dict[str, Any]) -> dict[str, Any]:
    """Write ``store.json`` (atomic) if absent, else check that the existing store matches ``meta`` (resume).

    A store made from a different verifier / layers / dtype / dataset size raises ``StoreError`` naming the keys.
    """
    store_dir = Path(store_dir)
    path = store_dir / STORE_JSON
    if path.is_file():
        old = read_json(path)
        diff = [k for k in _RESUME_KEYS if old.get(k) != meta.get(k)]
        if diff:
            detail = ", ".join(f"{k}: store has {old.get(k)!r}, run wants {meta.get(k)!r}" for k in diff)
            raise StoreError(f"existing store {store_dir} does not match this extraction ({detail}); "
                             f"use another output folder or delete it")
        return old
    store_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, meta)
    return meta


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise StoreError(f"cannot read {path}: {e}") from None


def write_sample_bytes(store_dir: Path, index: int, data: bytes, tokens: int, tokens_sha256: str,
                       group_size: int) -> dict[str, Any]:
    """Write one serialized sample to its final name (temp + fsync + rename); returns its manifest entry."""
    entry = sample_entry(index, tokens, data, tokens_sha256, group_size)
    atomic_write_bytes(store_dir / entry["file"], data)  # temp ".sample_<i>.safetensors.<random>.tmp", then rename
    return entry


@contextlib.contextmanager
def _locked_manifest(store_dir: Path) -> Iterator[int]:
    """An fd on the CURRENT manifest inode with an exclusive flock (reopens if a rewrite replaced the file)."""
    path = store_dir / MANIFEST
    while True:
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        yield fd
    finally:
        os.close(fd)  # releases the flock


def append_manifest(store_dir: str | os.PathLike, entry: dict[str, Any]) -> None:
    """Append one manifest line durably: a single ``write`` under ``flock`` (several shard writers may share a store
    folder), then fsync. Call only after the sample's file is renamed into place."""
    append_manifest_entries(store_dir, [entry])


def append_manifest_entries(store_dir: str | os.PathLike, entries: Iterable[dict[str, Any]]) -> None:
    """``append_manifest`` for many entries at once: one write and one fsync (a rebuilt manifest of 1M lines would
    otherwise cost 1M fsyncs)."""
    line = "".join(json.dumps(e, sort_keys=True) + "\n" for e in entries).encode()
    if not line:
        return
    with _locked_manifest(Path(store_dir)) as fd:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            line = b"\n" + line  # a torn line from a killed writer: keep it on its own line
        os.write(fd, line)
        os.fsync(fd)


def _parse_manifest(raw: bytes, path: Path, strict: bool) -> tuple[dict[int, dict[str, Any]], int, int]:
    """(index -> latest entry, number of lines, number of damaged lines). A line whose ``file`` does not lie inside
    the store is damage wherever it is (strict: StoreError naming the line)."""
    lines = raw.split(b"\n")
    out: dict[int, dict[str, Any]] = {}
    n_lines = bad = 0
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        n_lines += 1
        try:
            entry = json.loads(line)
            idx = int(entry["index"])
            entry["file"], entry["tokens"], entry["sha256"]
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            bad += 1
            if strict and n != len(lines):  # a torn LAST line (no newline yet) is a crash leftover, not damage
                raise StoreError(f"{path} line {n} is not a manifest entry: {line[:200]!r} "
                                 f"(rerun extraction into this store to repair it)") from None
            continue
        if not inside_store(entry["file"]):
            bad += 1
            if strict:
                raise StoreError(f"{path} line {n}: file {entry['file']!r} of sample {idx} does not lie inside the "
                                 f"store (want a relative rows_<a>-<b>/sample_<index>.safetensors, no '..'); rerun "
                                 f"extraction into this store to repair the manifest")
            continue
        out[idx] = entry
    return out, n_lines, bad


def read_manifest(store_dir: str | os.PathLike, strict: bool = True) -> dict[int, dict[str, Any]]:
    """index -> latest manifest entry. A torn LAST line (crash inside an append) is ignored; with ``strict`` any
    other damaged line raises ``StoreError`` naming the line, else it is skipped."""
    path = Path(store_dir) / MANIFEST
    if not path.is_file():
        return {}
    return _parse_manifest(path.read_bytes(), path, strict)[0]


def repair_manifest(store_dir: str | os.PathLike, drop: set[int] = frozenset()) -> bool:
    """Rewrite the manifest with one line per index (sorted), without damaged lines and without ``drop``.

    Runs under the manifest's flock (re-read there, so lines appended meanwhile by other shard writers survive)
    and replaces the file atomically. Returns True when something changed.
    """
    store_dir = Path(store_dir)
    path = store_dir / MANIFEST
    if not path.is_file():
        return False
    with _locked_manifest(store_dir):
        entries, n_lines, bad = _parse_manifest(path.read_bytes(), path, strict=False)
        kept = {i: e for i, e in entries.items() if i not in drop}
        if not bad and n_lines == len(kept):
            return False
        text = "".join(json.dumps(kept[i], sort_keys=True) + "\n" for i in sorted(kept))
        atomic_write_text(path, text)
        return True


def clean_temp_files(store_dir: str | os.PathLike, start: int = 0, end: int | None = None) -> int:
    """Remove temp sample files (crash leftovers) of indices in [start, end); other shards' temps are left alone."""
    removed = 0
    for tmp in Path(store_dir).glob(f"rows_*/.sample_*{TMP_SUFFIX}"):
        try:
            idx = int(tmp.name.split("_", 1)[1].split(".", 1)[0])
        except ValueError:
            continue
        if idx >= start and (end is None or idx < end):
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
                removed += 1
    return removed


def final_file(store_dir: str | os.PathLike, index: int, group_size: int) -> Path | None:
    """Sample ``index``'s file under its final name when it is there as a regular file (not a symlink), else None."""
    path = Path(store_dir) / sample_relpath(index, group_size)
    try:
        return path if stat.S_ISREG(os.lstat(path).st_mode) else None
    except FileNotFoundError:
        return None


def entry_from_file(store_dir: str | os.PathLike, index: int, group_size: int) -> dict[str, Any]:
    """Sample ``index``'s manifest entry rebuilt from its file under the final name (the manifest lost the line:
    deleted, torn, or a crash between the rename and the append). Files reach their final name only complete
    (temp + fsync + rename), so the bytes are the sample: its sha256 and size are read off the file, its tokens off
    the header's input_ids. Shapes and dtypes are checked once listed (``HiddenStateStore.check_file``); raises
    StoreError when the file is missing, a symlink, or has no readable header."""
    path = final_file(store_dir, index, group_size)
    if path is None:
        raise StoreError(f"sample {index}: no regular file {Path(store_dir) / sample_relpath(index, group_size)}")
    try:
        with safe_open(str(path), framework="pt") as f:
            ids, mask = f.get_tensor("input_ids"), f.get_tensor("loss_mask")
    except (SafetensorError, OSError, KeyError, ValueError) as e:
        raise StoreError(f"{path}: unreadable sample file ({e})") from None
    if ids.dim() != 1 or mask.shape != ids.shape:
        raise StoreError(f"{path}: input_ids {tuple(ids.shape)} / loss_mask {tuple(mask.shape)} are not 1-D of one "
                         f"length")
    return {"index": int(index), "file": sample_relpath(index, group_size), "tokens": int(ids.shape[0]),
            "tokens_sha256": token_digest(ids, mask), "sha256": sha256_file(path), "bytes": path.stat().st_size}


