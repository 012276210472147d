"""A vLLM KV connector that writes EAGLE-3 hidden states straight into our store (runs INSIDE vLLM processes).

vLLM's ``extract_hidden_states`` speculative method makes the target return the residual stream at the layer ids
listed in ``eagle_aux_hidden_state_layer_ids`` (vLLM convention: id k = stream entering layer k; id L = output of
the last layer before the final norm) and caches them per token in a cache-only attention layer, i.e. in KV-cache
blocks that belong to the request. The stock ``ExampleHiddenStatesConnector`` then copies a finished request's
blocks to disk, but it needs CUDA (a copy stream, CUDA events, pinned host memory) and fails on CPU.

``Eagle3StoreConnector`` keeps the stock scheduler-side logic (it holds a finished request's blocks until the
worker reports it written) and replaces the worker-side copy: a plain indexed copy of the request's slots to host
memory (device-agnostic: CPU or CUDA), then a thread-pool write of one store sample (``rows_<a>-<b>/sample_*.
safetensors``, temp + fsync + rename, manifest line) with the sample's dataset index and loss mask, which the
driver passes per request in ``kv_transfer_params``. Only tensor-parallel rank 0 writes.

Settings (``kv_connector_extra_config``): ``eagle3_store_dir``, ``eagle3_group_size``, ``eagle3_store_dtype``,
``eagle3_n_aux`` (the last cached state is the final one), ``num_writer_threads``.

Imports only torch, vllm and ``eagle3.store`` (torch + safetensors), as modules run in the vLLM env must.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    ExampleHiddenStatesConnectorMetadata,
    PendingSave,
    extract_from_kv_cache,
)
from vllm.logger import init_logger

from eagle3.extract.selfcheck import ORDER_UNKNOWN, SELFCHECK_DIR
from eagle3.store import STORE_DTYPES, append_manifest, serialize_sample, token_digest, write_sample_bytes
from eagle3.support.io import save_safetensors

logger = init_logger(__name__)

INDEX_KEY = "eagle3_index"  # kv_transfer_params keys set by the driver per request
LOSS_MASK_KEY = "eagle3_loss_mask"
SELFCHECK_KEY = "eagle3_selfcheck"  # "alone": keep a raw copy only; "batch": the store sample + a raw copy


# a self-check copy's metadata: the requests in the forward step that computed it, and that step's tokens of the
# requests scheduled before it
STEP_LAYOUT = ("step_requests", "tokens_ahead")


def selfcheck_file(store_dir: str | Path, kind: str, index: int) -> Path:
    """The raw copy ([T, n_aux + 1, H], compute dtype) of the self-check's sample, extracted ``kind`` ("alone" or
    "batch"): eagle3/extract/selfcheck.py compares the two."""
    return Path(store_dir) / SELFCHECK_DIR / f"{kind}-{index:09d}.safetensors"


@dataclass
class StorePendingSave(PendingSave):
    index: int = -1  # dataset index of the sample
    loss_mask: list[int] = field(default_factory=list)  # [T], 1 = assistant token
    selfcheck: str = ""  # "", "alone" or "batch" (SELFCHECK_KEY)
    step_requests: int = 0  # self-check copies: requests in the forward step that first scheduled this one
    tokens_ahead: int = 0  # self-check copies: that step's tokens of the requests before this one (or ORDER_UNKNOWN)


class Eagle3StoreConnector(ExampleHiddenStatesConnector):
    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self._store_dir = Path(extra["eagle3_store_dir"])
        self._group_size = int(extra["eagle3_group_size"])
        self._store_dtype = STORE_DTYPES[extra["eagle3_store_dtype"]]
        self._n_aux = int(extra["eagle3_n_aux"])
        self.use_lock = False  # no per-file .lock companions: the manifest line marks a finished sample
        self._copied: set[str] = set()  # worker: requests whose states are already in host memory
        self._step_layout: dict[str, tuple[int, int]] = {}  # scheduler: self-check request -> STEP_LAYOUT values

    # ------------------------------------------------------------------ scheduler side

    def build_connector_meta(self, scheduler_output):
        """The stock metadata; for a self-check request also the layout of the forward step that first scheduled it:
        how many requests the step held and how many of its tokens came before the request's (the check compares
        nothing about batch dependence when the engine computed its "batch" copy alone, or first in its step).

        The new requests' scheduling order is the flattened step's order only when the step holds nothing else: the
        model runner drops every request not scheduled again from its persistent batch and fills the freed slots
        lowest first, in this order. A step that also continues requests scheduled earlier (chunked prefills,
        decodes) keeps those in their slots, and some attention backends reorder decodes before prefills: there the
        place is recorded as unknown (selfcheck.ORDER_UNKNOWN), which the check reads as inconclusive."""
        continued = bool(scheduler_output.scheduled_cached_reqs.req_ids)
        ahead = 0
        for new_req in scheduler_output.scheduled_new_reqs:  # in scheduling order
            extra = new_req.sampling_params.extra_args if new_req.sampling_params else None
            if ((extra or {}).get("kv_transfer_params") or {}).get(SELFCHECK_KEY):
                self._step_layout[new_req.req_id] = (len(scheduler_output.num_scheduled_tokens),
                                                     ORDER_UNKNOWN if continued else ahead)
            ahead += int(scheduler_output.num_scheduled_tokens.get(new_req.req_id, 0))
        return super().build_connector_meta(scheduler_output)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params or {}
        self._request_filenames.pop(request.request_id, None)
        step_requests, tokens_ahead = self._step_layout.pop(request.request_id, (0, 0))
        if INDEX_KEY not in params or request.prompt_token_ids is None:
            return False, None
        self._pending_saves[request.request_id] = StorePendingSave(
            req_id=request.request_id,
            filename="",
            token_ids=torch.tensor(list(request.prompt_token_ids), dtype=torch.long),  # [T]
            block_ids=list(block_ids),
            index=int(params[INDEX_KEY]),
            loss_mask=list(params[LOSS_MASK_KEY]),
            selfcheck=str(params.get(SELFCHECK_KEY, "")),
            step_requests=step_requests,
            tokens_ahead=tokens_ahead,
        )
        return True, {INDEX_KEY: int(params[INDEX_KEY])}

    # ------------------------------------------------------------------ worker side

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None and isinstance(pending, StorePendingSave)
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)  # [n_blocks]
        offsets = torch.arange(self._block_size, dtype=torch.long)  # [block_size]
        slots = (block_ids[:, None] * self._block_size + offsets[None, :]).flatten()  # [n_blocks * block_size]
        n = int(pending.token_ids.shape[0])
        # [T, n_aux + 1, H]: advanced indexing copies, so the blocks can be freed as soon as this returns
        states = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), n).to("cpu")
        future = self._executor.submit(self._write, pending, states)
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
        self._copied.add(pending.req_id)

    def _write(self, pending: StorePendingSave, states: torch.Tensor) -> None:
        n, k, h = states.shape
        if k != self._n_aux + 1:
            raise RuntimeError(f"sample {pending.index}: {k} cached states per token, expected n_aux + 1 = "
                               f"{self._n_aux + 1}")
        if pending.selfcheck:  # the raw states, in the compute dtype, for the self-check's comparison
            path = selfcheck_file(self._store_dir, pending.selfcheck, pending.index)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp")
            save_safetensors({"states": states.contiguous()}, tmp, {
                STEP_LAYOUT[0]: str(pending.step_requests), STEP_LAYOUT[1]: str(pending.tokens_ahead)})
            tmp.replace(path)
            if pending.selfcheck == "alone":
                return
        aux = states[:, : self._n_aux].reshape(n, self._n_aux * h)  # [T, n_aux * H], ascending layer ids
        final = states[:, self._n_aux]  # [T, H], last layer output before the final norm
        loss_mask = torch.tensor(pending.loss_mask, dtype=torch.uint8)  # [T]
        data = serialize_sample(aux, final, pending.token_ids, loss_mask, self._store_dtype, pending.index)
        entry = write_sample_bytes(self._store_dir, pending.index, data, n, token_digest(pending.token_ids, loss_mask),
                                   self._group_size)
        append_manifest(self._store_dir, entry)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, ExampleHiddenStatesConnectorMetadata):
                for pending in meta.pending_saves:
                    self._submit_async_write(pending)
        self._accumulated_finished_req_ids.update(finished_req_ids)
        done: set[str] = set()
        for req_id in list(self._accumulated_finished_req_ids):
            if not self._is_tp_rank_zero:  # only rank 0 copies and reports (get_finished_count() == 1)
                self._accumulated_finished_req_ids.discard(req_id)
            elif req_id in self._copied:  # the host copy is synchronous: the blocks may be freed now
                self._accumulated_finished_req_ids.discard(req_id)
                self._copied.discard(req_id)
                done.add(req_id)
        return done or None, None

    def wait_for_writes(self) -> None:
        """Block until every submitted sample is on disk (called before the engine shuts down)."""
        for f in list(self._req_futures.values()):
            f.result()
