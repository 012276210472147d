"""The hidden-state store (extract -> train): its format (``format``), metadata file and manifest (``manifest``) and
reader (``reader``). Extraction writes it (its background writer: eagle3.extract.writer), the capacity plan sizes it
from the format alone, the trainer reads it through ``HiddenStateStore``. Layout: docs/DESIGN.md, "Hidden-state
store". Imports torch and safetensors only (the vLLM environment's connector writes samples through it)."""

from eagle3.store.format import (
    FORMAT,
    MANIFEST,
    QUARANTINE,
    SAMPLE_METADATA,
    SCALE_SUFFIX,
    STATE_KEYS,
    STORE_DTYPES,
    STORE_JSON,
    TOKEN_TENSORS,
    CorruptSample,
    StoreError,
    dequantize_states,
    is_scaled,
    quantize_states,
    sample_files,
    sample_relpath,
    sample_tensors,
    serialize_sample,
    store_identity,
    store_meta,
    token_digest,
)
from eagle3.store.manifest import (
    append_manifest,
    append_manifest_entries,
    clean_temp_files,
    ensure_store,
    entry_from_file,
    final_file,
    init_store,
    read_manifest,
    repair_manifest,
    write_sample_bytes,
)
from eagle3.store.reader import HiddenStateStore, read_sample

__all__ = [
    "FORMAT", "MANIFEST", "QUARANTINE", "SAMPLE_METADATA", "SCALE_SUFFIX", "STATE_KEYS", "STORE_DTYPES", "STORE_JSON",
    "TOKEN_TENSORS", "CorruptSample", "HiddenStateStore", "StoreError", "append_manifest", "append_manifest_entries",
    "clean_temp_files", "dequantize_states", "ensure_store", "entry_from_file", "final_file", "init_store",
    "is_scaled", "quantize_states", "read_manifest", "read_sample", "repair_manifest", "sample_files",
    "sample_relpath", "sample_tensors", "serialize_sample", "store_identity", "store_meta", "token_digest",
    "write_sample_bytes",
]
