"""The float8_e4m3fn hidden-state store: quantization error bound, file layout and checks, the trainer's dequantizing
collate, training on it, and the vLLM backend writing it (real vLLM CPU build)."""

from __future__ import annotations

import pytest
import torch
from helpers import TINY, make_dataset, make_store
from safetensors.torch import load, save

from eagle3.capacity import store_file_bytes
from eagle3.extract.stage import extract_hidden_states
from eagle3.extract.writer import write_sample
from eagle3.store import (
    HiddenStateStore,
    StoreError,
    dequantize_states,
    init_store,
    quantize_states,
    sample_files,
    sample_relpath,
    serialize_sample,
)
from eagle3.train.config import TrainConfig
from eagle3.train.data import collate
from eagle3.train.stage import train_draft

F8 = torch.float8_e4m3fn


def _states(t: int, n: int, h: int, seed: int = 0) -> torch.Tensor:
    """[t, n * h] float32 like a verifier's residual stream: per-token magnitudes spread over 1e-4 .. 1e3, and one
    outlier channel per state at 300x (deep layers have them)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, n, h, generator=g) * torch.logspace(-4, 3, t)[:, None, None]
    x[:, :, 5] *= 300
    return x.reshape(t, n * h)


def _bound(x: torch.Tensor, scale: torch.Tensor, n: int, rel: float = 2**-4) -> torch.Tensor:
    """Elementwise error bound of q * scale: ``rel`` |x| for normal float8 values, 2**-10 * scale (half the float8
    subnormal spacing 2**-9) below 2**-6 * scale; plus float32 rounding of the divide and multiply."""
    s = scale.repeat_interleave(x.shape[1] // n, dim=1)  # [T, n*H]
    return (rel * x.abs() + 2**-10 * s) * (1 + 2**-20)


def test_round_trip_error_is_within_the_float8_bound_per_token_and_state():
    x = _states(64, 3, 128)
    x[7] = 0.0  # an all-zero token: scale 1, stored exactly
    q, scale = quantize_states(x, 3, F8)
    assert q.dtype == F8 and q.shape == x.shape and scale.dtype == torch.float32 and scale.shape == (64, 3)
    assert torch.equal(scale[7], torch.ones(3))
    top = x.reshape(64, 3, 128).abs().amax(-1)  # [T, n]: every state's absmax maps to exactly 448
    assert torch.equal(torch.where(top > 0, top / 448, 1.0), scale)
    back = dequantize_states(q, scale)
    err = (back - x).abs()
    assert torch.all(err <= _bound(x, scale, 3)), float((err / _bound(x, scale, 3)).max())
    assert float((err / x.abs().clamp(min=1e-30))[x.abs() > 1e-3 * scale.repeat_interleave(128, 1)].max()) > 2**-6
    # relative to each token's size the error is the same at 1e-4 and at 1e3: per-token scales keep the range
    rel = (err.norm(dim=1) / x.norm(dim=1).clamp(min=1e-30))[x.norm(dim=1) > 0]
    assert float(rel.max()) < 0.05
    # in bf16 (the CUDA compute dtype) the result is also rounded to bf16
    b16 = dequantize_states(q, scale, dtype=torch.bfloat16)
    assert b16.dtype == torch.bfloat16
    assert torch.all((b16.float() - x).abs() <= _bound(x, scale, 3, rel=2**-4 + 2**-7))
    # written into a slice of a bigger (padded batch) tensor
    batch = torch.zeros(2, 80, 3 * 128)
    dequantize_states(q, scale, out=batch[1, 10:74])
    assert torch.equal(batch[1, 10:74], back) and not batch[1, :10].any() and not batch[0].any()


def test_non_finite_states_stay_non_finite_and_verify_names_them(tmp_path):
    init_store(tmp_path / "s", verifier="v", aux_layer_ids=[1, 2], hidden_size=16, num_samples=2,
               dtype="float8_e4m3fn", fingerprint="test")
    aux, fin = _states(5, 2, 16), _states(5, 1, 16, seed=1)
    aux[3, 4] = float("inf")
    write_sample(tmp_path / "s", 0, aux, fin, torch.arange(5), torch.ones(5, dtype=torch.uint8))
    with pytest.raises(StoreError, match="sample 0: aux_hidden_states has NaN/Inf"):
        HiddenStateStore(tmp_path / "s").verify(check_finite=True)


def test_float8_store_file_layout_size_and_checks(tmp_path):
    init_store(tmp_path / "s", verifier="v", aux_layer_ids=[1, 2, 3], hidden_size=32, num_samples=3,
               dtype="float8_e4m3fn", fingerprint="test")
    aux, fin = _states(40, 3, 32), _states(40, 1, 32, seed=1)
    ids, mask = torch.arange(40), (torch.arange(40) % 2).to(torch.uint8)
    write_sample(tmp_path / "s", 1, aux, fin, ids, mask)
    store = HiddenStateStore(tmp_path / "s")
    assert store.scaled and store.dtype == F8
    t = store.load(1)
    assert {k: (v.dtype, tuple(v.shape)) for k, v in t.items()} == {
        "aux_hidden_states": (F8, (40, 96)), "final_hidden_state": (F8, (40, 32)),
        "aux_hidden_states_scale": (torch.float32, (40, 3)), "final_hidden_state_scale": (torch.float32, (40, 1)),
        "input_ids": (torch.int64, (40,)), "loss_mask": (torch.uint8, (40,))}
    assert torch.all((dequantize_states(t["final_hidden_state"], t["final_hidden_state_scale"]) - fin).abs()
                     <= _bound(fin, t["final_hidden_state_scale"], 1))
    size = store.file(1).stat().st_size
    assert sum(store_file_bytes(40, 3, 32, "float8_e4m3fn")) == size == store.verify()["bytes"]
    # a file that lost its scales (or holds the wrong scale dtype) is refused by name
    tensors = load(store.file(1).read_bytes())
    for broken, message in (({k: v for k, v in tensors.items() if k != "aux_hidden_states_scale"},
                             r"missing tensors \['aux_hidden_states_scale'\]"),
                            ({**tensors, "final_hidden_state_scale": tensors["final_hidden_state_scale"].half()},
                             "final_hidden_state_scale is torch.float16, expected float32")):
        path = tmp_path / "s" / sample_relpath(2, 2000)
        path.write_bytes(save(broken))
        with pytest.raises(StoreError, match=message):
            store._check(1, path, load(path.read_bytes()))


def test_scaled_serialize_rejects_an_aux_width_that_is_not_whole_states():
    with pytest.raises(StoreError, match=r"sample 4: inconsistent shapes aux \(3, 20\), final \(3, 8\)"):
        serialize_sample(torch.zeros(3, 20), torch.zeros(3, 8), torch.zeros(3), torch.zeros(3), F8, 4)


def test_collate_dequantizes_into_the_compute_dtype(tmp_path):
    lengths = [30, 17, 45]
    raw = {i: (_states(n, 2, 16, seed=i), _states(n, 1, 16, seed=10 + i)) for i, n in enumerate(lengths)}
    stores = {}
    for dt in ("float32", "float8_e4m3fn"):
        init_store(tmp_path / dt, verifier="v", aux_layer_ids=[1, 2], hidden_size=16, num_samples=3, dtype=dt,
                   fingerprint="test")
        for i, (aux, fin) in raw.items():
            write_sample(tmp_path / dt, i, aux, fin, torch.arange(lengths[i]), torch.ones(lengths[i], dtype=torch.uint8))
        stores[dt] = HiddenStateStore(tmp_path / dt)
    bins = [[0, 1], [2]]
    ref = collate(stores["float32"], bins, 64, 3, 100)
    got = collate(stores["float8_e4m3fn"], bins, 64, 3, 100)
    assert got.aux.dtype == torch.float32 and got.aux.shape == ref.aux.shape == (2, 47, 32)
    for name in ("input_ids", "loss_mask", "seq_ids", "position_ids", "counted"):
        assert torch.equal(getattr(got, name), getattr(ref, name))
    assert not got.aux[1, 45:].any() and not got.final[1, 45:].any()  # padding stays zero
    for r, row in enumerate(bins):
        start = 0
        for i in row:
            n = lengths[i]
            t = stores["float8_e4m3fn"].load(i)
            for key, field, k in (("aux_hidden_states", "aux", 2), ("final_hidden_state", "final", 1)):
                want = getattr(ref, field)[r, start:start + n]
                have = getattr(got, field)[r, start:start + n]
                assert torch.all((have - want).abs() <= _bound(want, t[key + "_scale"], k))
            start += n
    b16 = collate(stores["float8_e4m3fn"], bins, 64, 3, 100, dequant_dtype=torch.bfloat16)
    assert b16.aux.dtype == b16.final.dtype == torch.bfloat16
    assert collate(stores["float32"], bins, 64, 3, 100, dequant_dtype=torch.bfloat16).aux.dtype == torch.float32
    # CUDA training: the states stay float8 with their scales until Batch.to dequantizes them on the device
    late = collate(stores["float8_e4m3fn"], bins, 64, 3, 100, dequant_dtype=torch.bfloat16, dequantize=False)
    assert late.aux.dtype == late.final.dtype == F8 and late.aux_scale.shape == (2, 47, 2)
    assert late.final_scale.shape == (2, 47, 1) and late.dequant_dtype == torch.bfloat16
    moved = late.to(torch.device("cpu"))
    assert moved.aux_scale is None and moved.final_scale is None
    assert torch.equal(moved.aux, b16.aux) and torch.equal(moved.final, b16.final)


@pytest.mark.slow
def test_training_on_a_float8_store_matches_the_float32_store(tiny_llama_verifier, tmp_path):
    """The same samples extracted as float32 and as float8 (extraction stage, transformers backend): half the
    bytes at bf16's layout, and the same training curve up to the quantization noise."""
    g = torch.Generator().manual_seed(1)
    ids, masks = [], []
    for _ in range(24):
        n = int(torch.randint(30, 100, (1,), generator=g))
        ids.append(torch.randint(0, 300, (n,), generator=g).tolist())
        masks.append([0] * (n // 3) + [1] * (n - n // 3))
    runs, nbytes = {}, {}
    for dt in ("float32", "float8_e4m3fn"):
        store, mapping = make_store(tmp_path / dt, tiny_llama_verifier, ids, masks, [1, 2, 3], 256, 8192,
                                    store_dtype=dt)
        runs[dt] = train_draft(TrainConfig(**TINY, epochs=1, val_ratio=0.2), store, mapping, tmp_path / dt / "train",
                               verifier=tiny_llama_verifier)
        nbytes[dt] = sum(f.stat().st_size for f in sample_files(store))
    a, b = runs["float32"], runs["float8_e4m3fn"]
    assert nbytes["float8_e4m3fn"] == sum(sum(store_file_bytes(len(r), 3, 64, "float8_e4m3fn")) for r in ids)
    assert nbytes["float32"] == sum(sum(store_file_bytes(len(r), 3, 64, "float32")) for r in ids)
    # per token 4 x 64 values: 1 byte each + 4 float32 scales + 9 bytes of ids/mask, against 4 bytes + 9
    assert nbytes["float8_e4m3fn"] / nbytes["float32"] < (256 + 16 + 9) / (1024 + 9) + 0.01
    assert a.global_step == b.global_step > 0 and a.tokens_seen == b.tokens_seen > 0
    for key in ("untrained_val", "final_val"):
        x, y = getattr(a, key), getattr(b, key)
        assert y["counted_per_step"] == x["counted_per_step"]
        assert abs(y["loss"] - x["loss"]) <= 0.01 * x["loss"], (key, x["loss"], y["loss"])  # measured: 1e-3


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_backend_writes_the_float8_store(bundled_verifier, tmp_path):
    lengths = [40, 9, 70]
    ds = make_dataset(tmp_path / "ds", lengths, 8192, seed=3)
    cfg = {"verifier": str(bundled_verifier), "dtype": "float32", "max_tokens_per_batch": 128,
           "max_samples_per_batch": 4, "min_tokens_per_batch": 16, "log_every_seconds": 0, "log_every_samples": 0}
    extract_hidden_states({**cfg, "store_dtype": "float32"}, ds, tmp_path / "ref")
    extract_hidden_states({**cfg, "store_dtype": "float8_e4m3fn", "backend": "vllm"}, ds, tmp_path / "f8")
    ref, f8 = HiddenStateStore(tmp_path / "ref"), HiddenStateStore(tmp_path / "f8")
    assert f8.scaled and f8.meta["backend"] == "vllm" and f8.verify(check_finite=True)["tokens"] == sum(lengths)
    n_aux = f8.meta["n_aux"]
    for i, n in enumerate(lengths):
        x, y = ref.load(i), f8.load(i)
        assert f8.file(i).stat().st_size == sum(store_file_bytes(n, n_aux, f8.hidden_size, "float8_e4m3fn"))
        for key, k in (("aux_hidden_states", n_aux), ("final_hidden_state", 1)):
            want, scale = x[key], y[key + "_scale"]
            err = (dequantize_states(y[key], scale) - want).abs()
            assert torch.all(err <= _bound(want, scale, k) + 1e-4 * (1 + want.abs())), (i, key)
