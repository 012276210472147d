"""Reading the prepared dataset (the data stage's output): one reader for the capacity plan, extraction and the vocab
mapping, with its checks written once.

The data stage (eagle3.prepare) writes an Arrow dataset (``datasets.Dataset.save_to_disk``): ``input_ids`` int32
lists, ``loss_mask`` int8 lists, ``source_index`` int64. ``PreparedDataset`` opens it (one split, the columns there),
reads each sample's length from the list offsets alone, and ``check`` streams it once: equal input_ids / loss_mask
lengths, no empty sample, mask values in {0, 1}, token ids inside the verifier's vocabulary (an id outside means
the data was tokenized for another verifier). Every problem is one error of the caller's type naming the folder and
the sample.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from eagle3.chat.errors import DataError

_BATCH_SAMPLES = 4096  # samples per Arrow batch while streaming


def load_prepared(dataset_dir: str | Path, columns: tuple[str, ...] = ("input_ids", "loss_mask"),
                  error: type[Exception] = DataError):
    """Open the data stage's output (a ``datasets.Dataset.save_to_disk`` folder) and check it holds one split with
    ``columns``; any problem raises one ``error`` naming the folder."""
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


class PreparedDataset:
    """A prepared dataset opened for reading (``error``: the exception type the caller's stage raises)."""

    def __init__(self, dataset_dir: str | Path, error: type[Exception] = DataError):
        self.path, self.error = Path(dataset_dir), error
        ds = load_prepared(self.path, ("input_ids", "loss_mask"), error).select_columns(["input_ids", "loss_mask"])
        self.ds = ds.flatten_indices() if ds._indices is not None else ds
        if len(self.ds) == 0:
            raise error(f"dataset {self.path} has no samples")
        self._lengths: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.ds)

    def batches(self, batch_samples: int = _BATCH_SAMPLES) -> Iterator[tuple[int, Any]]:
        """(index of the batch's first sample, Arrow table of input_ids + loss_mask) over the whole dataset."""
        first = 0
        for table in self.ds.with_format("arrow").iter(batch_size=batch_samples):
            yield first, table
            first += len(table)

    @property
    def lengths(self) -> np.ndarray:
        """Tokens of every sample -> [num_samples] int64, from the Arrow list offsets only (no token is read)."""
        import pyarrow.compute as pc

        if self._lengths is None:
            parts = [pc.list_value_length(t.column("input_ids")).to_numpy(zero_copy_only=False)
                     for _, t in self.batches(65536)]
            self._lengths = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)
        return self._lengths

    def check(self, vocab_size: int | None = None) -> None:
        """Stream every sample once and raise the caller's error at the first bad one: null or empty rows,
        input_ids / loss_mask of different lengths, mask values other than 0 / 1, token ids outside
        [0, ``vocab_size``)."""
        import pyarrow.compute as pc

        for first, table in self.batches():
            ids_col, mask_col = table.column("input_ids"), table.column("loss_mask")
            if ids_col.null_count or mask_col.null_count:
                raise self.error(f"dataset {self.path}: null input_ids/loss_mask in samples {first}.."
                                 f"{first + len(table) - 1}")
            n_ids = pc.list_value_length(ids_col).to_numpy(zero_copy_only=False)  # [batch]
            n_mask = pc.list_value_length(mask_col).to_numpy(zero_copy_only=False)  # [batch]
            if (n_ids == 0).any():
                raise self.error(f"dataset {self.path}: sample {first + int(np.flatnonzero(n_ids == 0)[0])} has no "
                                 f"input_ids")
            if not np.array_equal(n_ids, n_mask):
                i = int(np.flatnonzero(n_ids != n_mask)[0])
                raise self.error(f"dataset {self.path}: sample {first + i} has {n_ids[i]} input_ids but {n_mask[i]} "
                                 f"loss_mask entries")
            mask = pc.list_flatten(mask_col).to_numpy(zero_copy_only=False)  # [batch tokens]
            if (bad := np.flatnonzero((mask != 0) & (mask != 1))).size:
                raise self.error(f"dataset {self.path}, sample {_sample_at(first, n_ids, int(bad[0]))}: loss_mask "
                                 f"value {int(mask[bad[0]])} (expected 0 or 1)")
            if vocab_size is not None:
                ids = pc.list_flatten(ids_col).to_numpy(zero_copy_only=False)  # [batch tokens]
                if (bad := np.flatnonzero((ids < 0) | (ids >= vocab_size))).size:
                    raise self.error(
                        f"dataset {self.path}, sample {_sample_at(first, n_ids, int(bad[0]))}: token id "
                        f"{int(ids[bad[0]])} outside the verifier's vocabulary [0, {vocab_size}) (tokenized for "
                        f"another verifier?)")

    def assistant_layout(self) -> tuple[np.ndarray, np.ndarray]:
        """(non-assistant tokens [N], assistant turns [N]) of every sample: the prompt side regeneration keeps, and
        the number of loss-mask runs (one per assistant turn) it rewrites."""
        prompt, turns = [], []
        for _, table in self.batches():
            col = table.column("loss_mask")
            for i in range(len(table)):
                m = np.asarray(col[i].values.to_numpy(zero_copy_only=False), dtype=np.int8)  # [T]
                prompt.append(int((m == 0).sum()))
                turns.append(int(((m[1:] == 1) & (m[:-1] == 0)).sum() + (len(m) > 0 and m[0] == 1)))
        return np.asarray(prompt, dtype=np.int64), np.asarray(turns, dtype=np.int64)


def _sample_at(first: int, lengths: np.ndarray, pos: int) -> int:
    """Dataset index of the sample holding flat token position ``pos`` of a batch starting at sample ``first``."""
    return first + int(np.searchsorted(np.cumsum(lengths), pos, side="right"))
