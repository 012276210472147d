"""The hidden-state store: what extraction writes and the trainer reads (layout in docs/DESIGN.md).

```
store/store.json      format, verifier + fingerprint, aux_layer_ids (vLLM convention), hidden_size, n_aux, dtype,
                      num_samples (dataset size), backend, group_size
store/manifest.jsonl  one line per FINISHED sample, appended (flock + fsync) after its file is renamed into place:
                      {"index": i, "file": "rows_0-1999/sample_000000012.safetensors", "tokens": T,
                       "sha256": ..., "bytes": ...}
store/rows_<a>-<b>/sample_<index:09d>.safetensors
   aux_hidden_states   [T, n_aux * H]  store dtype, aux states concatenated in aux_layer_ids order (fc's input)
   final_hidden_state  [T, H]          store dtype, output of the LAST decoder layer BEFORE the final norm
   input_ids           [T] int64
   loss_mask           [T] uint8 (1 = assistant token)
 and, only in a store of a scaled dtype (float8_e4m3fn, ``eagle3.support.dtypes.SCALED_DTYPES``):
   aux_hidden_states_scale   [T, n_aux] float32   one scale per token and per aux state
   final_hidden_state_scale  [T, 1] float32
   state = stored value * scale; scale = the state's absmax / the dtype's max (448), so every token's states keep
   their own range (``quantize_states`` / ``dequantize_states``)
```

A sample file exists under its final name only once complete (temp name + fsync + rename), and a manifest line
exists only for a file that is in place, so a crash at any point leaves at worst a stray temp file (removed by the
next run) or a complete file without a manifest line (its line is rebuilt from the file by the next run:
``entry_from_file``). A torn last manifest line (``kill -9`` inside the write) is ignored by the reader. Every
manifest ``file`` must name a file inside the store (``rows_*/sample_*.safetensors``, no symlink), else StoreError.
Nothing here unpickles: safetensors only.

Integrity: the manifest holds each sample's byte size and sha256. ``check_sizes`` (one ``lstat`` per sample) is the
check a reused store always passes; ``verify_sample`` hashes a sample on its first read by a store object (the
trainer's loader workers), and a sample that fails is moved to ``quarantine/`` so that extraction's resume sees it
missing and extracts it again.

``HiddenStateStore`` memory-maps sample files (``torch.UntypedStorage.from_file``, private mapping), so reading a
sample costs page-cache reads of the rows actually touched, not a copy of the file.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import queue
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from safetensors.torch import save as safetensors_save

from eagle3.support.dtypes import DTYPES, SCALED_DTYPES
from eagle3.support.dtypes import STORE_DTYPES as _STORE_DTYPE_NAMES
from eagle3.support.io import atomic_write_bytes, atomic_write_json, atomic_write_text, sha256_file, sha256_json

FORMAT = "eagle3-hidden-states/1"
STORE_JSON = "store.json"
MANIFEST = "manifest.jsonl"
QUARANTINE = "quarantine"  # samples that failed their hash check, moved aside for inspection (never read again)
DEFAULT_GROUP_SIZE = 2000
TMP_SUFFIX = ".tmp"
KEYS = ("aux_hidden_states", "final_hidden_state", "input_ids", "loss_mask")
TOKEN_TENSORS = (("input_ids", "int64"), ("loss_mask", "uint8"))  # per-token bookkeeping stored beside the states
# one key only: safetensors writes a multi-key metadata map in a per-process order, so the same tensors would give
# different bytes (and sha256) in different processes; the sample's index lives in its file name and manifest line
SAMPLE_METADATA = {"format": "pt"}

_ST_DTYPES = {d.safetensors: d.torch for d in DTYPES.values()}  # safetensors header code -> torch dtype
STORE_DTYPES = {name: DTYPES[name].torch for name in _STORE_DTYPE_NAMES}  # store.json "dtype" -> torch dtype
STATE_KEYS = ("aux_hidden_states", "final_hidden_state")
SCALE_SUFFIX = "_scale"  # "<state key>_scale": the float32 scales of a scaled store's states
SCALE_DTYPE = "float32"
# keys of store.json that must match for a rerun to resume into an existing store
_RESUME_KEYS = ("format", "verifier_fingerprint", "aux_layer_ids", "hidden_size", "n_aux", "dtype", "compute_dtype",
                "num_samples", "group_size")


class StoreError(ValueError):
    """A store folder, its metadata or one of its samples is not usable; the message names the path / sample."""


class CorruptSample(StoreError):
    """A sample's file does not match its manifest line (size, sha256, header); it was moved to quarantine/."""


def group_dir_name(index: int, group_size: int) -> str:
    """``rows_<a>-<b>``: the folder holding sample ``index`` (groups of ``group_size`` samples)."""
    a = index // group_size * group_size
    return f"rows_{a}-{a + group_size - 1}"


def sample_relpath(index: int, group_size: int) -> str:
    return f"{group_dir_name(index, group_size)}/sample_{index:09d}.safetensors"


def sample_files(store_dir: str | os.PathLike) -> list[Path]:
    """Every finished sample file of a store, in file order (``sample_relpath``'s layout; temp files start with a
    dot and end in ``TMP_SUFFIX``, quarantined ones lie in ``QUARANTINE``: neither is listed)."""
    return sorted(Path(store_dir).glob("rows_*/sample_*.safetensors"))


def _verifier_fingerprint(verifier: str | os.PathLike) -> str:
    from eagle3.support.verifier import verifier_fingerprint  # the one recipe (imported late: pydantic)

    return verifier_fingerprint(verifier)


def store_meta(
    *,
    verifier: str | os.PathLike,
    aux_layer_ids: list[int],
    hidden_size: int,
    dtype: str,
    num_samples: int,
    backend: str = "transformers",
    group_size: int = DEFAULT_GROUP_SIZE,
    fingerprint: str | None = None,
    compute_dtype: str | None = None,
) -> dict[str, Any]:
    """The ``store.json`` dict. ``aux_layer_ids`` in vLLM's convention (id k = residual stream entering layer k);
    ``compute_dtype``: what the verifier computed in (a resume or a shard on a device that would compute in another
    dtype is refused: the store would mix states computed two ways)."""
    if dtype not in STORE_DTYPES:
        raise StoreError(f"store dtype {dtype!r} not supported; use one of {sorted(STORE_DTYPES)}")
    if group_size < 1:
        raise StoreError(f"group_size must be >= 1 sample, got {group_size}")
    return {
        "format": FORMAT,
        "verifier": str(verifier),
        "verifier_fingerprint": fingerprint if fingerprint is not None else _verifier_fingerprint(verifier),
        "aux_layer_ids": [int(k) for k in aux_layer_ids],
        "hidden_size": int(hidden_size),
        "n_aux": len(aux_layer_ids),
        "dtype": dtype,
        "compute_dtype": compute_dtype,
        "num_samples": int(num_samples),
        "backend": backend,
        "group_size": int(group_size),
    }


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
        old = _read_json(path)
        diff = [k for k in _RESUME_KEYS if old.get(k) != meta.get(k)]
        if diff:
            detail = ", ".join(f"{k}: store has {old.get(k)!r}, run wants {meta.get(k)!r}" for k in diff)
            raise StoreError(f"existing store {store_dir} does not match this extraction ({detail}); "
                             f"use another output folder or delete it")
        return old
    store_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, meta)
    return meta


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise StoreError(f"cannot read {path}: {e}") from None


def is_scaled(dtype: str | torch.dtype) -> bool:
    """True for a store dtype whose states are stored with per-token, per-state scales (float8_e4m3fn)."""
    return any(dtype in (name, DTYPES[name].torch) for name in SCALED_DTYPES)


def sample_tensors(tokens: int, n_aux: int, hidden_size: int, dtype: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype name, shape) of every tensor in the file of a ``tokens``-token sample of a store of ``dtype``:
    the file layout, which ``serialize_sample`` writes and the capacity plan sizes."""
    out = [("aux_hidden_states", dtype, (tokens, n_aux * hidden_size)),
           ("final_hidden_state", dtype, (tokens, hidden_size))]
    if is_scaled(dtype):
        out += [("aux_hidden_states" + SCALE_SUFFIX, SCALE_DTYPE, (tokens, n_aux)),
                ("final_hidden_state" + SCALE_SUFFIX, SCALE_DTYPE, (tokens, 1))]
    return out + [(name, dt, (tokens,)) for name, dt in TOKEN_TENSORS]


def quantize_states(x: torch.Tensor, n_states: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, n_states * H] (any float dtype, any device) -> (q [T, n_states * H] ``dtype``, scale [T, n_states]
    float32) on CPU, with x ~= q * scale per state.

    One scale per token and per state (absmax / the dtype's max): a state's outlier channels (hundreds of times its
    typical magnitude in deep layers) set only that token's scale. An all-zero state gets scale 1 (stored exactly).
    Error of q * scale against x (computed in float32): at most 2**-4 |x| (3 mantissa bits, round to nearest), or
    2**-10 * scale for values in float8_e4m3fn's subnormal range (|x| < 2**-6 * scale).
    """
    t = int(x.shape[0])
    xf = x.detach().to("cpu", torch.float32).reshape(t, n_states, -1)  # [T, n, H]
    top = torch.finfo(dtype).max
    scale = xf.abs().amax(dim=-1) / top  # [T, n]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # NaN/Inf stay: verify(check_finite) sees them
    q = (xf / scale[..., None]).clamp_(-top, top).to(dtype)  # clamp: float32 rounding may land just above max
    return q.reshape(t, -1), scale


def dequantize_states(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q: [T, n * H] scaled store dtype, scale: [T, n] float32 -> states [T, n * H] in ``out`` (written in place,
    any float dtype; e.g. a slice of a padded batch) or a new ``dtype`` tensor.

    The scale is cast to the output dtype first: a bf16 x float32 in-place multiply takes a ~15x slower CPU path.
    In bf16 the result carries bf16 rounding on top of the quantization error (about 2**-8 relative).
    """
    t, width = q.shape
    n = int(scale.shape[1])
    if out is None:
        out = torch.empty(t, width, dtype=dtype, device=q.device)
    out.copy_(q)
    out.unflatten(1, (n, width // n)).mul_(scale.to(out.dtype)[:, :, None])
    return out


def serialize_sample(
    aux: torch.Tensor, final: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor, dtype: torch.dtype,
    index: int,
) -> bytes:
    """safetensors bytes of one sample (shapes checked; states cast to the store ``dtype``, or quantized with
    their scales for a scaled dtype: ``sample_tensors`` lists the file's tensors).

    aux: [T, n_aux * H], final: [T, H], input_ids: [T], loss_mask: [T]
    """
    t = int(input_ids.shape[0])
    scaled = is_scaled(dtype)
    if aux.dim() != 2 or final.dim() != 2 or aux.shape[0] != t or final.shape[0] != t or loss_mask.shape != (t,) \
            or (scaled and (final.shape[1] == 0 or aux.shape[1] % final.shape[1])):
        raise StoreError(
            f"sample {index}: inconsistent shapes aux {tuple(aux.shape)}, final {tuple(final.shape)}, "
            f"input_ids {tuple(input_ids.shape)}, loss_mask {tuple(loss_mask.shape)} (want [T, n_aux*H], [T, H], [T], [T])"
        )
    tensors: dict[str, torch.Tensor] = {}
    for key, x in zip(STATE_KEYS, (aux, final)):
        if scaled:
            tensors[key], tensors[key + SCALE_SUFFIX] = quantize_states(x, int(x.shape[1]) // int(final.shape[1]),
                                                                       dtype)
        else:
            tensors[key] = x.detach().to("cpu", dtype).contiguous()
    tensors["input_ids"] = input_ids.detach().to("cpu", torch.int64).contiguous()
    tensors["loss_mask"] = loss_mask.detach().to("cpu", torch.uint8).contiguous()
    return safetensors_save(tensors, metadata=SAMPLE_METADATA)


def write_sample_bytes(store_dir: Path, index: int, data: bytes, tokens: int, group_size: int) -> dict[str, Any]:
    """Write one serialized sample to its final name (temp + fsync + rename); returns its manifest entry."""
    rel = sample_relpath(index, group_size)
    atomic_write_bytes(store_dir / rel, data)  # temp ".sample_<i>.safetensors.<random>.tmp", then rename
    return {"index": int(index), "file": rel, "tokens": int(tokens), "sha256": hashlib.sha256(data).hexdigest(),
            "bytes": len(data)}


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


def write_sample(
    store_dir: str | os.PathLike,
    index: int,
    aux: torch.Tensor,
    final: torch.Tensor,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
) -> dict[str, Any]:
    """Write one sample into an initialised store and append its manifest line (for tests and small tools).

    aux: [T, n_aux * H] (aux states concatenated in aux_layer_ids order), final: [T, H] (BEFORE the final norm),
    input_ids: [T], loss_mask: [T] (1 = assistant token). States are cast to the store dtype.
    """
    store_dir = Path(store_dir)
    meta = _read_json(store_dir / STORE_JSON)
    h, n_aux = meta["hidden_size"], meta["n_aux"]
    if aux.shape[-1] != n_aux * h or final.shape[-1] != h:
        raise StoreError(f"sample {index}: aux last dim {aux.shape[-1]} / final last dim {final.shape[-1]} do not "
                         f"match store {store_dir} (n_aux * hidden = {n_aux * h}, hidden = {h})")
    if not 0 <= index < meta["num_samples"]:
        raise StoreError(f"sample index {index} outside the store's 0..{meta['num_samples'] - 1}")
    data = serialize_sample(aux, final, input_ids, loss_mask, STORE_DTYPES[meta["dtype"]], index)
    entry = write_sample_bytes(store_dir, index, data, int(input_ids.shape[0]), meta["group_size"])
    append_manifest(store_dir, entry)
    return entry


def inside_store(rel: object) -> bool:
    """True when a manifest ``file`` names a sample file inside the store: the relative path
    ``rows_<a>-<b>/sample_<index>.safetensors`` (never absolute, never ``..``; symlinks are refused when read)."""
    if not isinstance(rel, str) or "\\" in rel:
        return False
    p = PurePosixPath(rel)
    return (not p.is_absolute() and len(p.parts) == 2 and p.parts[0].startswith("rows_")
            and p.name.startswith("sample_") and p.suffix == ".safetensors" and ".." not in p.parts)


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


class AsyncStoreWriter:
    """Writes samples on a background thread so disk I/O overlaps the next forward pass.

    ``submit(batch)`` queues one batch of samples; at most ``max_queued_batches`` wait (host memory stays bounded:
    the forward loop blocks when the writer falls behind). Per sample the thread casts to the store dtype,
    serializes (safetensors), hashes, writes temp + fsync + rename, appends the manifest line, then calls
    ``on_written(entry)``. An error in the thread is re-raised by the next ``submit`` or by ``close``.
    """

    def __init__(self, store_dir: str | os.PathLike, meta: dict[str, Any], max_queued_batches: int = 2,
                 on_written: Callable[[dict[str, Any]], None] | None = None):
        self.store_dir = Path(store_dir)
        self.dtype = STORE_DTYPES[meta["dtype"]]
        self.group_size = int(meta["group_size"])
        self.on_written = on_written
        self.queue: queue.Queue = queue.Queue(maxsize=max_queued_batches)
        self.error: BaseException | None = None
        self.written = 0
        self.bytes = 0
        self._thread = threading.Thread(target=self._run, name="eagle3-store-writer", daemon=True)
        self._thread.start()

    def submit(self, samples: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        """samples: (index, aux [T, n_aux*H], final [T, H], input_ids [T], loss_mask [T]) on CPU."""
        self._raise()
        while True:
            try:
                self.queue.put(samples, timeout=0.5)
                return
            except queue.Full:
                self._raise()

    def _raise(self) -> None:
        if self.error is not None:
            raise StoreError(f"writing to {self.store_dir} failed: {self.error}") from self.error

    def _run(self) -> None:
        while True:
            batch = self.queue.get()
            if batch is None:
                return
            if self.error is not None:
                continue  # drain after a failure so submit() never blocks forever
            try:
                for index, aux, final, input_ids, loss_mask in batch:
                    data = serialize_sample(aux, final, input_ids, loss_mask, self.dtype, index)
                    entry = write_sample_bytes(self.store_dir, index, data, int(input_ids.shape[0]), self.group_size)
                    append_manifest(self.store_dir, entry)
                    self.written += 1
                    self.bytes += entry["bytes"]
                    if self.on_written is not None:
                        self.on_written(entry)
            except BaseException as e:  # noqa: BLE001 - handed to the producer thread
                self.error = e

    def close(self) -> None:
        """Wait until everything queued is on disk; re-raise a writer error."""
        if self._thread.is_alive():
            self.queue.put(None)
            self._thread.join()
        self._raise()


def read_header(path: str | os.PathLike) -> tuple[dict[str, Any], int]:
    """(safetensors header dict, byte offset of the data section). Raises StoreError for a damaged file."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise StoreError(f"{path}: truncated safetensors file")
            (n,) = struct.unpack("<Q", head)
            if n > 100_000_000:
                raise StoreError(f"{path}: implausible safetensors header length {n}")
            header = json.loads(f.read(n))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise StoreError(f"{path}: unreadable safetensors header ({e})") from None
    return header, 8 + n


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
    header, _ = read_header(path)
    ids = header.get("input_ids")
    if not isinstance(ids, dict) or len(ids.get("shape") or []) != 1:
        raise StoreError(f"{path}: no 1-D input_ids tensor in its header")
    return {"index": int(index), "file": sample_relpath(index, group_size), "tokens": int(ids["shape"][0]),
            "sha256": sha256_file(path), "bytes": path.stat().st_size}


def mmap_safetensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file as views of one private memory map (no copy; pages load on access)."""
    path = Path(path)
    header, start = read_header(path)
    size = path.stat().st_size
    storage = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=size)
    out: dict[str, torch.Tensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _ST_DTYPES.get(info["dtype"])
        if dtype is None:
            raise StoreError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        begin, end = (start + o for o in info["data_offsets"])
        shape = list(info["shape"])
        itemsize = torch.empty((), dtype=dtype).element_size()
        numel = 1
        for s in shape:
            numel *= s
        if end > size or end - begin != numel * itemsize:
            raise StoreError(f"{path}: tensor {name} lies outside the file or has the wrong byte length")
        if begin % itemsize == 0:
            t = torch.empty(0, dtype=dtype).set_(storage, begin // itemsize, shape)
        else:  # misaligned (not produced by safetensors' own writer): copy this one tensor
            t = torch.frombuffer(bytearray(storage[begin:end]), dtype=dtype).reshape(shape)
        out[name] = t
    return out


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
        self.meta: dict[str, Any] = _read_json(meta_path)
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
        tensors = mmap_safetensors(path)
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
            self._check(index, path, mmap_safetensors(path))
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
        """Content identity of the store: its metadata (without the verifier's path) and every listed sample's
        sha256. Sample bytes are deterministic, so the same states give the same fingerprint in any process."""
        meta = {k: v for k, v in self.meta.items() if k != "verifier"}
        return sha256_json({"meta": meta, "samples": [[i, self._entries[i]["sha256"]] for i in self._sorted]})

    def __repr__(self) -> str:
        return (f"HiddenStateStore({str(self.path)!r}, samples={len(self)}/{self.meta['num_samples']}, "
                f"hidden={self.hidden_size}, aux_layer_ids={self.aux_layer_ids} (vLLM convention), "
                f"dtype={self.meta['dtype']})")
