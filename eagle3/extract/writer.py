"""Writing samples into a hidden-state store (extraction's side; the format is eagle3.store): the background writer
that overlaps disk I/O with the next forward pass, and ``write_sample`` for tests and small tools."""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from eagle3.store.format import STORE_DTYPES, STORE_JSON, StoreError, serialize_sample, token_digest
from eagle3.store.manifest import append_manifest, read_json, write_sample_bytes


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
                    entry = write_sample_bytes(self.store_dir, index, data, int(input_ids.shape[0]),
                                               token_digest(input_ids, loss_mask), self.group_size)
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
    meta = read_json(store_dir / STORE_JSON)
    h, n_aux = meta["hidden_size"], meta["n_aux"]
    if aux.shape[-1] != n_aux * h or final.shape[-1] != h:
        raise StoreError(f"sample {index}: aux last dim {aux.shape[-1]} / final last dim {final.shape[-1]} do not "
                         f"match store {store_dir} (n_aux * hidden = {n_aux * h}, hidden = {h})")
    if not 0 <= index < meta["num_samples"]:
        raise StoreError(f"sample index {index} outside the store's 0..{meta['num_samples'] - 1}")
    data = serialize_sample(aux, final, input_ids, loss_mask, STORE_DTYPES[meta["dtype"]], index)
    entry = write_sample_bytes(store_dir, index, data, int(input_ids.shape[0]), token_digest(input_ids, loss_mask),
                               meta["group_size"])
    append_manifest(store_dir, entry)
    return entry


