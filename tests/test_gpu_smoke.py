"""GPU smoke tests (marker ``gpu``): the project's CUDA paths that no CPU test runs, each check with its figures.

Sections, in the order they run (module fixtures chain them: the tiny store feeds training, FP8 and the launches):

    environment    versions, the library's imports, GPU name, NCCL version, bf16 8192^3 matmul TFLOP/s
    extract tiny   prepare (bundled stdlib chats) -> extract_hidden_states on the bundled verifier, bf16 on CUDA, one
                   injected OOM at the first forward: the budget halves and the verifier stays loaded (one load);
                   stored states vs an independent forward; the vocab mapping
    extract big    a random Llama (hidden 1024 x 16 layers, vocab 32000: ~0.5 GB in bf16), 160 samples of 256-2048
                   tokens at a 16384-token budget, OOMs injected at forwards 1 and 3 (16384 -> 8192 -> 4096); states
                   vs an independent forward; then a REAL CUDA OOM under torch.cuda.set_per_process_memory_fraction
    train tiny     train_draft on the device (bf16 autocast) on the tiny store; its first steps again in float32 on
                   the CPU (losses within 3%); StepLoader(pin_memory=True) batches are page-locked (H2D GB/s)
    train big      2048-token packed rows x 4 per step, 7 TTT steps, 2 loader threads: step time, tok/s, and the CUDA
                   peak within the training memory plan (eagle3/train/memory.py)
    fp8            the tiny data extracted again into an FP8 store (float8_e4m3fn + a float32 scale per token and
                   state); batches stay quantized until Batch.to dequantizes them on the device (= the CPU's
                   dequantization); training on it: losses within 10% of the bf16 store's
    launch         torch elastic launch (eagle3/train/launch.py), one worker (nccl on CUDA), parallel ddp and fsdp:
                   the draft is wrapped and its losses equal the single-process run's (2e-3 relative on CUDA)

The CUDA preflight and the device lock of the visible GPU are tested in tests/test_gpu_lock.py.

Figures (tok/s, step ms, CUDA peaks, TFLOP/s, GB/s) are printed as ``[gpu] ...`` lines, which ``pytest -s`` shows;
speed is never asserted. On a GPU host: ``python -m pytest -m gpu -s tests/test_gpu_smoke.py`` (bench/gpu_smoke.sh
runs every GPU test with the carried wheels under a time budget). ``EAGLE3_GPU_DRY_RUN=1`` runs the same code on the
CPU (float32, small sizes; the CUDA-only checks skip) so that it cannot rot between GPU runs.

Layer ids are vLLM's convention (id k = residual stream entering decoder layer k = HF ``output_hidden_states[k]``).
"""

from __future__ import annotations

import gc
import importlib
import importlib.metadata as md
import itertools
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers import BUNDLED_DATA, cuda_or_dry_run, make_dataset, save_tiny_llama

from eagle3.extract.stage import HiddenStates, extract_hidden_states
from eagle3.prepare import PrepareConfig, PreparedData, prepare_data
from eagle3.store import HiddenStateStore, sample_files
from eagle3.support import dtypes
from eagle3.support.verifier import VerifierSpec
from eagle3.train.config import TrainConfig
from eagle3.train.data import Batch, BatchPlan, StepLoader, pack_samples
from eagle3.train.stage import DraftCheckpoint, train_draft
from eagle3.vocab import VocabConfig, build_vocab

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, cuda_or_dry_run]
DEVICE = "cuda" if CUDA else "cpu"
DTYPE = "bfloat16" if CUDA else "float32"  # the verifiers' compute dtype; stores hold bf16 either way


@dataclass(frozen=True)
class Sizes:
    tiny_samples: int  # bundled chats prepared
    tiny_seq: int  # their max_seq_len (tokens), also the tiny training rows
    tiny_budget: int  # extraction's padded tokens per batch
    tiny_batch: int  # rows per optimizer step
    big_hidden: int  # the random Llama: hidden size (x 11/4 MLP, 64-wide heads)
    big_layers: int
    big_vocab: int
    big_samples: int
    big_len: tuple[int, int]  # sample lengths, uniform in [min, max] tokens
    big_budget: int
    big_draft_vocab: int
    big_seq: int  # training rows (tokens)
    big_batch: int
    big_ttt: int
    real_oom_samples: int  # samples extracted under the memory cap
    check_samples: int  # longest samples compared with an independent forward
    cpu_ref_steps: int  # steps trained again in float32 on the CPU


# On CUDA the random Llama holds ~0.5 GB of bf16 weights (253M parameters) and the big store ~185K tokens (1.5 GB of
# states), so batches fill the default 16384-token budget; the dry run keeps every test well under a minute on 2 cores
SIZES = {
    "cuda": Sizes(tiny_samples=512, tiny_seq=512, tiny_budget=8192, tiny_batch=4, big_hidden=1024, big_layers=16,
                  big_vocab=32000, big_samples=160, big_len=(256, 2048), big_budget=16384, big_draft_vocab=8192,
                  big_seq=2048, big_batch=4, big_ttt=7, real_oom_samples=48, check_samples=4, cpu_ref_steps=5),
    "cpu": Sizes(tiny_samples=48, tiny_seq=256, tiny_budget=2048, tiny_batch=2, big_hidden=128, big_layers=4,
                 big_vocab=4096, big_samples=16, big_len=(32, 256), big_budget=1024, big_draft_vocab=512,
                 big_seq=256, big_batch=2, big_ttt=3, real_oom_samples=8, check_samples=2, cpu_ref_steps=3),
}
Z = SIZES[DEVICE]
# relative L2 error of stored states vs an independent forward rounded to the store dtype: on the CPU (float32 on
# both sides) only rounding flips remain; on CUDA bf16 kernels differ between padded batches and single samples
STATE_TOLERANCE = 0.03 if CUDA else 1e-3
# distributions whose versions the environment test prints
PACKAGES = ("torch", "transformers", "tokenizers", "safetensors", "pydantic", "pydantic-core", "typing-extensions",
            "datasets", "pyarrow", "fsspec", "huggingface-hub", "dill", "multiprocess", "numpy", "pandas", "psutil",
            "matplotlib", "jinja2", "pyyaml", "nvidia-ml-py", "pytest")


# ------------------------------------------------------------------------------------------------ measuring


def say(text: str) -> None:
    """A figure or a note for ``pytest -m gpu -s`` (never asserted)."""
    print(f"[gpu] {text}", flush=True)


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def start_peak() -> int:
    """Start measuring the CUDA peak; returns the bytes allocated now (0 on the CPU). Every test runs in one
    process, so a peak is measured above what was allocated before, with the allocator's cache emptied."""
    if not CUDA:
        return 0
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def peak_since(base: int) -> int | None:
    """CUDA bytes allocated at the peak since ``start_peak``, above its ``base``; None on the CPU."""
    if not CUDA:
        return None
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def peak_text(peak: int | None) -> str:
    if peak is None:
        return "no CUDA peak on the CPU"
    return f"CUDA peak {gib(peak)} allocated, {gib(torch.cuda.max_memory_reserved())} reserved"


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| in float32 (L2 over all elements)."""
    got, ref = got.float(), ref.float()
    return float((got - ref).norm() / ref.norm().clamp(min=1e-12))


# ------------------------------------------------------------------------------------------------ extraction


@dataclass
class Extracted:
    result: HiddenStates
    wall_s: float
    peak: int | None  # CUDA bytes allocated at the peak (None on the CPU)

    @property
    def store(self) -> Path:
        return Path(self.result.store_path)


def oom_injector(attempts: set[int]):
    """An ``extract_hidden_states`` oom_injector raising torch's OOM error at the given forward attempts (from 0)."""

    def inject(attempt: int, indices: list[int], padded_tokens: int) -> None:
        if attempt in attempts:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate (injected at forward attempt "
                                         f"{attempt}, {len(indices)} samples / {padded_tokens} padded tokens)")

    return inject


def extract(verifier: Path, dataset: str | Path, store: Path, budget: int, oom_at: set[int] = frozenset(),
            **extra) -> Extracted:
    """The transformers backend on DEVICE in DTYPE (store bf16) with OOMs injected at ``oom_at``."""
    cfg = {"verifier": str(verifier), "device": DEVICE, "dtype": DTYPE, "store_dtype": "bfloat16",
           "max_tokens_per_batch": budget, "min_tokens_per_batch": 256, "log_every_samples": 0,
           "log_every_seconds": 0, **extra}
    base = start_peak()
    t = time.monotonic()
    res = extract_hidden_states(cfg, dataset, store, oom_injector=oom_injector(oom_at) if oom_at else None)
    return Extracted(res, time.monotonic() - t, peak_since(base))


def assert_extracted(res: HiddenStates, want_history: list[int], samples: int) -> None:
    assert res.model_loads == 1, f"verifier loaded {res.model_loads} times: an OOM must keep it loaded"
    assert res.token_budget_history == want_history, \
        f"token budget after each OOM {res.token_budget_history}, want {want_history} (halved each time)"
    assert (res.samples_stored, res.samples_unfittable_count) == (samples, 0), \
        f"{res.samples_stored}/{samples} samples stored, {res.samples_unfittable_count} unfittable"
    assert (res.compute_dtype, res.store_dtype) == (DTYPE, "bfloat16")


def assert_states_match_an_independent_forward(verifier: Path, store_dir: Path, n: int) -> float:
    """Compare stored states with an independent forward (a separately loaded model, one sample at a time, no
    padding, ``output_hidden_states``) in DTYPE on DEVICE: aux id k = hidden_states[k] (rounded to the store
    dtype); the stored final state is pre-norm, so norm(final) = hidden_states[-1], up to the store dtype's rounding
    of the norm's input (one unit roundoff more tolerance). Checks the n longest samples, and that the error against
    the NEXT layer's state (an off-by-one layer id) is far above the tolerance. Returns the worst relative error."""
    from transformers import AutoModelForCausalLM

    store = HiddenStateStore(store_dir)
    dtype = dtypes.torch_dtype(DTYPE)
    model = AutoModelForCausalLM.from_pretrained(str(verifier), dtype=dtype).to(DEVICE).eval()
    idx = sorted(store.indices(), key=lambda i: -store.tokens(i))[:n]
    ids, h = store.aux_layer_ids, store.hidden_size
    worst_aux = worst_final = 0.0
    off_by_one = float("inf")
    for i in idx:
        s = store.load(i)
        with torch.inference_mode():
            out = model.model(input_ids=s["input_ids"][None].to(DEVICE), output_hidden_states=True, use_cache=False)
            hs = out.hidden_states  # L+1 x [1, T, H]: [k] enters layer k; [-1] is after the final norm
            got = s["aux_hidden_states"].to(DEVICE)  # [T, n_aux * H]
            ref_aux = torch.cat([hs[k][0] for k in ids], dim=-1).to(store.dtype)  # [T, n_aux * H]
            normed = model.model.norm(s["final_hidden_state"].to(DEVICE, dtype))  # [T, H]
            worst_aux = max(worst_aux, rel_err(got, ref_aux))
            worst_final = max(worst_final, rel_err(normed, hs[-1][0]))
            off_by_one = min(off_by_one, rel_err(got[:, :h], hs[ids[0] + 1][0]))
    del model
    tol = STATE_TOLERANCE
    tol_final = tol + torch.finfo(store.dtype).eps / 2  # + the unit roundoff (bf16: 2^-8)
    what = (f"stored states of the {len(idx)} longest samples ({', '.join(str(store.tokens(i)) for i in idx)} tokens) "
            f"vs an independent {DTYPE} forward: aux rel err {worst_aux:.2e} (tolerance {tol:g}), norm(final) "
            f"{worst_final:.2e} ({tol_final:.2g}); aux {ids[0]} vs layer {ids[0] + 1}'s state {off_by_one:.2e} (must "
            f"exceed {3 * tol:g})")
    say(what)
    assert worst_aux <= tol and worst_final <= tol_final and off_by_one > 3 * tol, what
    return max(worst_aux, worst_final)


def parameter_count(verifier: Path) -> int:
    """Parameters in the checkpoint's safetensors files (their headers)."""
    from safetensors import safe_open

    n = 0
    for f in verifier.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            n += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())  # noqa: SIM118 - safe_open is no dict
    return n


# ------------------------------------------------------------------------------------------------ training


@dataclass
class Trained:
    run: DraftCheckpoint
    wall_s: float
    step_s: float  # median optimizer step after the first (warm-up)
    peak: int | None  # CUDA bytes allocated at the peak (None on the CPU)

    def metrics(self) -> list[dict]:
        return read_metrics(Path(self.run.out_dir))

    def figures(self) -> str:
        tokens_per_step = self.run.tokens_seen / max(self.run.global_step, 1)
        return (f"{self.run.global_step} steps, median step {self.step_s * 1e3:.1f} ms, "
                f"{tokens_per_step / self.step_s:,.0f} tok/s, wall {self.wall_s:.1f} s (validation, checkpoints and "
                f"plots included); {peak_text(self.peak)}")


def train_cfg(big: bool, **over) -> TrainConfig:
    if big:
        base = {"batch_size": Z.big_batch, "max_seq_len": Z.big_seq, "ttt_steps": Z.big_ttt, "loader_workers": 2}
    else:
        base = {"batch_size": Z.tiny_batch, "max_seq_len": Z.tiny_seq, "ttt_steps": 3, "lr": 3e-3,
                "warmup_ratio": 0.1, "loader_workers": 1}
    return TrainConfig(**{"epochs": 1, **base, "log_every_steps": 1, "device": DEVICE, "keep_last_n": 1, **over})


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def timed_train(cfg: TrainConfig, store: Path, vocab: Path, verifier: Path, out: Path) -> Trained:
    """train_draft with a clock on every optimizer step (log_every_steps 1: on_progress once per step)."""
    stamps: list[float] = []
    base = start_peak()
    t = time.monotonic()
    run = train_draft(cfg, store, vocab, out, verifier=verifier, resume=False,
                      on_progress=lambda done, total, line: stamps.append(time.monotonic()))
    wall = time.monotonic() - t
    steps = [b - a for a, b in itertools.pairwise(stamps)]
    return Trained(run, wall, statistics.median(steps[1:] or steps or [float("nan")]), peak_since(base))


def assert_finished(t: Trained) -> None:
    run = t.run
    losses = [r["loss"] for r in t.metrics() if r["event"] == "train"]
    assert run.global_step == run.total_steps > 0, f"{run.global_step}/{run.total_steps} steps"
    assert run.checkpoint_dir and Path(run.checkpoint_dir).is_dir(), f"no checkpoint: {run.checkpoint_dir}"
    assert losses and run.final_val, "no losses recorded"
    assert all(math.isfinite(x) for x in losses) and math.isfinite(run.final_val["loss"]), \
        f"losses not finite: {losses}, val {run.final_val['loss']}"
    say(f"losses: first {losses[0]:.4f}, last {losses[-1]:.4f}, val {run.final_val['loss']:.4f}")


def worst_loss_difference(a: list[dict], b: list[dict]) -> tuple[int, float]:
    """(records paired, worst relative loss difference) of two metrics lists paired by (event, global_step)."""
    pa = {(r["event"], r["global_step"]): r["loss"] for r in a}
    pb = {(r["event"], r["global_step"]): r["loss"] for r in b}
    both = sorted(set(pa) & set(pb))
    worst = max((abs(pb[k] - pa[k]) / max(abs(pa[k]), 1e-6) for k in both), default=float("inf"))
    return len(both), worst


def one_step_batch(store_dir: Path, cfg: TrainConfig, vocab_size: int, **loader) -> Batch:
    """The first micro-batch of the trainer's StepLoader over the whole store (one thread)."""
    store = HiddenStateStore(store_dir)
    bins = pack_samples({i: min(store.tokens(i), cfg.max_seq_len) for i in store.indices()}, cfg.max_seq_len)
    plan = BatchPlan(bins, 0, cfg.batch_size, 1, 1, 0)
    steps = StepLoader(store, plan, [(0, 0)], cfg.max_seq_len, cfg.ttt_steps, vocab_size, workers=1, **loader)
    try:
        return next(iter(steps))[0]
    finally:
        steps.close()


# ------------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gpu-smoke")


@pytest.fixture(scope="module")
def tiny_prep(work, bundled_verifier) -> PreparedData:
    prep = prepare_data(PrepareConfig(sources=[str(BUNDLED_DATA / "train.sharegpt.jsonl")],
                                      tokenizer_path=str(bundled_verifier), max_samples=Z.tiny_samples,
                                      max_seq_len=Z.tiny_seq), work / "tiny" / "prep")
    say(f"prepared {prep.samples} samples, {prep.total_tokens:,} tokens ({prep.assistant_tokens:,} assistant)")
    return prep


@pytest.fixture(scope="module")
def tiny(work, bundled_verifier, tiny_prep) -> Extracted:
    """The bundled verifier's states of the tiny data, one OOM injected at the first forward."""
    return extract(bundled_verifier, tiny_prep.dataset_path, work / "tiny" / "store", Z.tiny_budget, {0})


@pytest.fixture(scope="module")
def tiny_vocab(work, bundled_verifier, tiny_prep) -> Path:
    vocab = build_vocab(VocabConfig(draft_vocab_size=2048), tiny_prep, VerifierSpec.from_path(bundled_verifier).vocab_size,
                        work / "tiny" / "vocab")
    say(f"tiny vocab mapping: {vocab.draft_vocab_size} draft tokens, coverage {vocab.coverage:.3f}")
    return Path(vocab.mapping_path)


@pytest.fixture(scope="module")
def tiny_run(work, bundled_verifier, tiny, tiny_vocab) -> Trained:
    """The draft trained on DEVICE on the tiny store: the run the CPU reference, FP8 and the launches compare with."""
    return timed_train(train_cfg(big=False), tiny.store, tiny_vocab, bundled_verifier, work / "tiny" / f"train-{DEVICE}")


@pytest.fixture(scope="module")
def big_verifier(work) -> Path:
    h = Z.big_hidden
    t = time.monotonic()
    verifier = save_tiny_llama(work / "big" / "verifier", hidden_size=h, intermediate_size=h * 11 // 4,
                               num_hidden_layers=Z.big_layers, num_attention_heads=h // 64,
                               num_key_value_heads=h // 128, vocab_size=Z.big_vocab)
    say(f"random Llama hidden {h} x {Z.big_layers} layers, vocab {Z.big_vocab}: {parameter_count(verifier) / 1e6:.0f}M "
        f"parameters, built in {time.monotonic() - t:.1f} s")
    return verifier


@pytest.fixture(scope="module")
def big_data(work) -> Path:
    rng = random.Random(0)
    lengths = [rng.randint(*Z.big_len) for _ in range(Z.big_samples)]
    return make_dataset(work / "big" / "ds", lengths, Z.big_vocab)


@pytest.fixture(scope="module")
def big(work, big_verifier, big_data) -> Extracted:
    """The random Llama's states of the big data, OOMs injected at forwards 1 and 3."""
    return extract(big_verifier, big_data, work / "big" / "store", Z.big_budget, {1, 3})


@pytest.fixture(scope="module")
def big_vocab(work, big_data) -> Path:
    return Path(build_vocab(VocabConfig(draft_vocab_size=Z.big_draft_vocab), big_data, Z.big_vocab,
                            work / "big" / "vocab").mapping_path)


@pytest.fixture(scope="module")
def fp8(work, bundled_verifier, tiny_prep) -> Extracted:
    """The tiny data extracted again into an FP8 store (one float32 scale per token and state)."""
    return extract(bundled_verifier, tiny_prep.dataset_path, work / "tiny" / "store-fp8", Z.tiny_budget,
                   store_dtype="float8_e4m3fn")


# ------------------------------------------------------------------------------------------------ environment


def test_environment_versions_imports_and_cuda_figures():
    say(f"python {platform.python_version()} ({sys.executable}); {platform.platform()}; {os.cpu_count()} CPUs")
    carried = os.environ.get("PYTHONPATH", "").split(os.pathsep)[0]  # bench/gpu_smoke.sh puts the wheels first
    versions = []
    for name in PACKAGES:
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            versions.append(f"{name} -")
            continue
        mark = " (carried)" if carried and str(dist.locate_file("")).startswith(carried) else ""
        versions.append(f"{name} {dist.version}{mark}")
    say("; ".join(versions))
    modules = ["eagle3.prepare", "eagle3.extract.stage", "eagle3.vocab", "eagle3.train.stage", "eagle3.train.launch",
               "eagle3.train.memory", "eagle3.support.gpu", "eagle3.support.plot", "eagle3.capacity", "datasets",
               "transformers"]
    bad = []
    for m in modules:
        try:
            importlib.import_module(m)
        except Exception as e:  # noqa: BLE001 - report every import that fails
            bad.append(f"{m}: {type(e).__name__}: {e}")
    assert not bad, f"library modules that do not import: {bad}"
    if not CUDA:
        say("dry run on the CPU: no CUDA device figures")
        return
    p = torch.cuda.get_device_properties(0)
    nccl = torch.cuda.nccl.version()
    say(f"{p.name}, capability {p.major}.{p.minor}, {gib(p.total_memory)}, {p.multi_processor_count} SMs, CUDA "
        f"{torch.version.cuda}, {torch.cuda.device_count()} device(s); NCCL "
        f"{'.'.join(map(str, nccl)) if isinstance(nccl, tuple) else nccl}")
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.used,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20, check=False)
        say(f"nvidia-smi: {smi.stdout.strip() or smi.stderr.strip()}")
    except (OSError, subprocess.SubprocessError) as e:
        say(f"nvidia-smi: {e}")
    assert torch.cuda.is_bf16_supported()
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    torch.cuda.synchronize()
    say(f"bf16 {n}^3 matmul: {10 * 2 * n**3 / (start.elapsed_time(end) / 1e3) / 1e12:.0f} TFLOP/s (mean of 10 "
        f"after 3 warm-ups, random data)")
    del a, b
    torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------ extraction


def test_tiny_extraction_halves_its_budget_on_an_oom_keeping_the_verifier_loaded(tiny_prep, tiny, tiny_vocab):
    res = tiny.result
    say(f"extract tiny: {res.tokens_written:,} tokens, {res.tokens_per_second:,.0f} tok/s, extraction "
        f"{res.extract_seconds:.2f} s, load {res.model_load_seconds:.2f} s, wall {tiny.wall_s:.1f} s; "
        f"{peak_text(tiny.peak)}")
    assert_extracted(res, [Z.tiny_budget, Z.tiny_budget // 2], tiny_prep.samples)
    assert tiny_vocab.is_file()


def test_tiny_stored_states_match_an_independent_forward(bundled_verifier, tiny):
    assert_states_match_an_independent_forward(bundled_verifier, tiny.store, Z.check_samples)


def test_big_extraction_halves_twice_and_stores_the_states_of_an_independent_forward(big_verifier, big, big_vocab):
    res = big.result
    say(f"extract big: {res.tokens_written:,} tokens, {res.tokens_per_second:,.0f} tok/s, store "
        f"{res.bytes_on_disk / 1e9:.2f} GB at {res.bytes_on_disk / max(res.extract_seconds, 1e-9) / 1e9:.2f} GB/s, "
        f"extraction {res.extract_seconds:.1f} s, load {res.model_load_seconds:.1f} s; {peak_text(big.peak)}")
    assert_extracted(res, [Z.big_budget, Z.big_budget // 2, Z.big_budget // 4], Z.big_samples)
    assert_states_match_an_independent_forward(big_verifier, big.store, Z.check_samples)
    assert big_vocab.is_file()


def test_a_real_cuda_oom_under_a_memory_cap_halves_the_budget_with_the_verifier_kept_loaded(
        work, big_verifier, big_data, big):
    if not CUDA:
        pytest.skip("a real CUDA OOM needs CUDA (torch.cuda.set_per_process_memory_fraction)")
    # cap this process at the weights + 60% of what the full-budget batches needed above (big.peak), so the largest
    # batches fail inside the forward and a halved budget fits; the cap bounds the allocator's reserved bytes
    total = torch.cuda.get_device_properties(0).total_memory
    weights = parameter_count(big_verifier) * dtypes.dtype(DTYPE).bytes
    start_peak()  # empties the cache: what earlier tests left cached would count against the cap
    cap = torch.cuda.memory_reserved() + weights + 0.6 * max(big.peak - weights, 0)
    say(f"real OOM: memory capped at {gib(cap)} (weights {gib(weights)}, peak at budget {Z.big_budget}: "
        f"{gib(big.peak)})")
    torch.cuda.set_per_process_memory_fraction(cap / total)
    try:
        real = extract(big_verifier, big_data, work / "big" / "store-real-oom", Z.big_budget,
                       shard_end=Z.real_oom_samples).result
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    say(f"under the cap: budget history {real.token_budget_history}, {real.samples_stored} samples stored")
    assert real.model_loads == 1, f"verifier loaded {real.model_loads} times: a real OOM must keep it loaded"
    assert (real.samples_stored, real.samples_unfittable_count) == (Z.real_oom_samples, 0)
    assert len(real.token_budget_history) > 1, "no real OOM under the cap (the allocator fit the batches)"
    assert all(b == a // 2 for a, b in itertools.pairwise(real.token_budget_history))


# ------------------------------------------------------------------------------------------------ training


def test_training_on_the_device_tracks_a_cpu_float32_run(work, bundled_verifier, tiny, tiny_vocab, tiny_run):
    say(f"train tiny on {DEVICE}: {tiny_run.figures()}")
    assert_finished(tiny_run)
    n = Z.cpu_ref_steps
    cfg = train_cfg(big=False, device="cpu", stop_after_steps=n)
    ref = timed_train(cfg, tiny.store, tiny_vocab, bundled_verifier, work / "tiny" / "train-cpu-ref")
    a = [r for r in tiny_run.metrics() if r["global_step"] <= n]
    b = ref.metrics()
    paired, worst = worst_loss_difference(b, a)
    tol = 0.03 if CUDA else 1e-6  # bf16 autocast vs float32; on the dry run both are float32 on the CPU
    what = (f"{DEVICE}{' bf16 autocast' if CUDA else ''} vs cpu float32: {paired} of {len(b)} records (val at step 0 + "
            f"{n} steps), worst relative loss difference {worst:.2e} (tolerance {tol:g})")
    say(what)
    assert paired == len(b) and worst <= tol, what


@pytest.mark.parametrize("which", ["tiny", "big"])
def test_loader_batches_are_page_locked_for_cuda(request, bundled_verifier, which):
    if not CUDA:
        pytest.skip("pinned-memory loader batches need CUDA")
    store = request.getfixturevalue(which).store
    vocab_size = Z.big_vocab if which == "big" else VerifierSpec.from_path(bundled_verifier).vocab_size
    batch = one_step_batch(store, train_cfg(big=which == "big"), vocab_size, pin_memory=True)
    tensors = (batch.input_ids, batch.aux, batch.final, batch.loss_mask, batch.seq_ids, batch.position_ids)
    assert all(t.is_pinned() for t in tensors), "StepLoader(pin_memory=True) batches are not page-locked"

    def h2d(t: torch.Tensor) -> float:
        t.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        s = time.perf_counter()
        for _ in range(5):
            t.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        return 5 * t.numel() * t.element_size() / (time.perf_counter() - s) / 1e9

    pageable = torch.empty(batch.aux.shape, dtype=batch.aux.dtype).copy_(batch.aux)  # ordinary host memory
    say(f"H2D copy of one {which} micro-batch's aux states ({batch.aux.numel() * batch.aux.element_size() / 1e6:.0f} "
        f"MB): pinned {h2d(batch.aux):.1f} GB/s, pageable {h2d(pageable):.1f} GB/s")


def test_big_training_figures_and_the_cuda_peak_within_the_memory_plan(work, big_verifier, big, big_vocab):
    from eagle3.draft.checkpoint import read_config
    from eagle3.train.memory import plan_training_memory

    cfg = train_cfg(big=True)
    t = timed_train(cfg, big.store, big_vocab, big_verifier, work / "big" / "train")
    say(f"train big on {DEVICE}: {t.run.train_rows} rows of {cfg.max_seq_len} tokens (packing "
        f"{t.run.packing_efficiency:.3f}), {cfg.ttt_steps} TTT steps; {t.figures()}")
    assert_finished(t)
    store = HiddenStateStore(big.store)
    plan = plan_training_memory(read_config(t.run.checkpoint_dir), cfg, world=1, device=DEVICE,
                                batch_dtype_bytes=store.dtype.itemsize)
    assert plan.peak_bytes > 0
    if not CUDA:  # the CPU's peak RSS also holds the runtime and the prefetch the plan leaves out: not compared
        return
    for line in plan.summary().splitlines():
        say(f"memory plan: {line}")
    ratio = plan.peak_bytes / t.peak
    say(f"memory plan peak {gib(plan.peak_bytes)} vs CUDA peak allocated {gib(t.peak)}: plan/measured {ratio:.2f} "
        f"(target 0.8-1.2)")
    assert t.peak <= 1.2 * plan.peak_bytes, "the CUDA peak exceeds the training memory plan by more than 20%"


# ------------------------------------------------------------------------------------------------ FP8 store


def test_fp8_store_holds_every_sample_in_about_half_the_bytes(tiny_prep, tiny, fp8):
    bf16_bytes = sum(f.stat().st_size for f in sample_files(tiny.store))
    fp8_bytes = sum(f.stat().st_size for f in sample_files(fp8.store))
    say(f"FP8 store: {fp8.result.samples_stored} samples, {fp8_bytes:,} bytes vs bf16 {bf16_bytes:,} (ratio "
        f"{fp8_bytes / bf16_bytes:.3f}), extraction {fp8.wall_s:.1f} s")
    assert fp8.result.store_dtype == "float8_e4m3fn"
    assert fp8.result.samples_stored == tiny_prep.samples and fp8_bytes < bf16_bytes


def test_fp8_batches_dequantize_on_the_device_like_on_the_cpu(bundled_verifier, fp8):
    cfg = train_cfg(big=False)
    batch = one_step_batch(fp8.store, cfg, VerifierSpec.from_path(bundled_verifier).vocab_size, pin_memory=CUDA,
                           dequant_dtype=torch.bfloat16, dequantize=False)
    on_device = batch.to(torch.device(DEVICE))
    cpu = batch.to(torch.device("cpu"))  # the same dequantization on the CPU
    diff = (on_device.aux.cpu().float() - cpu.aux.float()).abs().max().item()
    say(f"FP8 batch: {batch.aux.dtype} until Batch.to({DEVICE}) -> {on_device.aux.dtype}; max |device - cpu| "
        f"{diff:.2e}")
    assert batch.aux.dtype == torch.float8_e4m3fn, "the batch arrived dequantized"
    assert on_device.aux.dtype == torch.bfloat16 and on_device.aux.device.type == DEVICE
    assert diff <= 2**-7 * cpu.aux.float().abs().max().item()


def test_training_on_the_fp8_store_tracks_the_bf16_store(work, bundled_verifier, tiny_vocab, tiny_run, fp8):
    t = timed_train(train_cfg(big=False), fp8.store, tiny_vocab, bundled_verifier, work / "tiny" / f"train-fp8-{DEVICE}")
    say(f"train on the FP8 store: {t.figures()}")
    assert_finished(t)
    paired, worst = worst_loss_difference(tiny_run.metrics(), t.metrics())
    what = (f"FP8-store losses vs the bf16 store's: {paired} records, worst relative difference {worst:.2e} "
            f"(tolerance 0.1)")
    say(what)
    assert paired == len(tiny_run.metrics()) and worst <= 0.10, what


# ------------------------------------------------------------------------------------------------ launches


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_launched_worker_wraps_the_draft_and_equals_the_single_process_run(work, bundled_verifier, tiny, tiny_vocab,
                                                                          tiny_run, parallel):
    from eagle3.train.launch import launch

    cfg = train_cfg(big=False, nproc=1, parallel=parallel)
    out = work / "tiny" / f"train-{parallel}"
    t = time.monotonic()
    res = launch(cfg, tiny.store, tiny_vocab, bundled_verifier, out, resume=False)
    wall = time.monotonic() - t
    log_text = (out / "train-rank0.log").read_text()
    backend = "nccl" if CUDA else "gloo"
    say(f"launch {parallel} x1 ({backend}): {res['global_step']}/{res['total_steps']} steps, wall {wall:.1f} s "
        f"(training {res['wall_s']:.1f} s)")
    assert res["nproc"] == 1 and "[train]" in log_text
    assert f"draft wrapped in {parallel.upper()} over 1 process(es) ({backend})" in log_text
    a, b = tiny_run.metrics(), read_metrics(out)
    # one worker computes what the plain process does; CUDA's backward kernels (atomics) are not bit-deterministic
    # and may move the losses a little over the steps, the CPU's are
    tol = 2e-3 if CUDA else 1e-6
    _, worst = worst_loss_difference(a, b)
    what = (f"{parallel} x1 vs the single-process {DEVICE} run: {len(b)} metrics records, worst relative loss "
            f"difference {worst:.2e} (tolerance {tol:g})")
    say(what)
    assert [(x["event"], x["global_step"]) for x in a] == [(y["event"], y["global_step"]) for y in b], what
    assert worst <= tol, what
