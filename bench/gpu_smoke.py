"""The GPU smoke test's sections: the project's CUDA paths that no test on a CPU machine can run, with their figures.

Run by bench/gpu_smoke.sh (its header says how to call it through the device tool and what the output means), one
process per section so a hang or a crash costs one section and each section's CUDA peak is its own:

    python bench/gpu_smoke.py --mode gpu|cpu --work DIR SECTION

Each section prints ``[section] ...`` lines and, last, ``RESULT <section> PASS|FAIL <figures>``; exit status 0 =
PASS, 1 = FAIL. ``--mode cpu`` (the dry run) runs the same code on the CPU at tiny sizes; checks that need CUDA print
``skipped on the CPU dry run: ...`` instead. Sections share files under DIR (the tiny store feeds the training
sections). ``h200-view OUT`` (dry run only) builds an interpreter that sees only what the GPU machine's image holds.

Layer ids are vLLM's convention (id k = residual stream entering decoder layer k = HF ``output_hidden_states[k]``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata as md
import itertools
import json
import logging
import math
import os
import re
import resource
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

TINY_VERIFIER = REPO / "models" / "tiny-chat-verifier"
TINY_DATA = REPO / "data" / "stdlib-chat" / "train.sharegpt.jsonl"
KINDS_MD = Path("/work/.library/device/KINDS.md")  # the device tool's notes: the GPU image's package list

# Sizes per mode. gpu: a random Llama of ~0.5 GB bf16 (hidden 1024, 16 layers, vocab 32000: 253M parameters) and
# ~185K tokens of 256-2048-token samples (1.5 GB of states), so batches fill the default 16384-token budget.
SIZES = {
    "gpu": {"tiny_samples": 512, "tiny_seq": 512, "tiny_budget": 8192, "tiny_batch": 4,
            "big_hidden": 1024, "big_layers": 16, "big_vocab": 32000, "big_samples": 160, "big_len": (256, 2048),
            "big_budget": 16384, "big_draft_vocab": 8192, "big_seq": 2048, "big_batch": 4, "big_ttt": 7,
            "real_oom_samples": 48, "check_samples": 4, "cpu_ref_steps": 5},
    "cpu": {"tiny_samples": 48, "tiny_seq": 256, "tiny_budget": 2048, "tiny_batch": 2,
            "big_hidden": 128, "big_layers": 4, "big_vocab": 4096, "big_samples": 16, "big_len": (32, 256),
            "big_budget": 1024, "big_draft_vocab": 512, "big_seq": 256, "big_batch": 2, "big_ttt": 3,
            "real_oom_samples": 8, "check_samples": 2, "cpu_ref_steps": 3},
}
# packages whose versions the env section prints (distribution names)
PACKAGES = ("torch", "transformers", "tokenizers", "safetensors", "pydantic", "pydantic-core", "typing-extensions",
            "datasets", "pyarrow", "fsspec", "huggingface-hub", "dill", "multiprocess", "numpy", "pandas", "psutil",
            "matplotlib", "jinja2", "pyyaml", "nvidia-ml-py")
# relative L2 error of stored states vs an independent forward rounded to the store dtype: on the CPU (float32 on
# both sides) only rounding flips remain; on the GPU bf16 kernels differ between padded batches and single samples
STATE_TOLERANCE = {"gpu": 0.03, "cpu": 1e-3}


class Section:
    """Checks and figures of one section; ``result`` prints the RESULT line and gives the exit status."""

    def __init__(self, name: str, mode: str, work: Path):
        self.name, self.mode, self.work = name, mode, work
        self.gpu = mode == "gpu"
        self.size = SIZES[mode]
        self.failures: list[str] = []
        self.figures: dict[str, str] = {}

    def say(self, text: str) -> None:
        print(f"[{self.name}] {text}", flush=True)

    def check(self, ok: bool, what: str) -> bool:
        self.say(f"{'ok' if ok else 'FAIL'}: {what}")
        if not ok:
            self.failures.append(what)
        return ok

    def cuda_only(self, what: str) -> None:
        self.say(f"skipped on the CPU dry run: {what}")

    def fig(self, **kv) -> None:
        self.figures.update({k: str(v) for k, v in kv.items()})

    @property
    def device(self) -> str:
        return "cuda" if self.gpu else "cpu"

    @property
    def dtype(self) -> str:
        """Compute dtype of the verifier: bf16 on the GPU; float32 on the CPU (bf16 there is ~20x slower)."""
        return "bfloat16" if self.gpu else "float32"

    def result(self) -> int:
        status = "FAIL" if self.failures else "PASS"
        figs = " ".join(f"{k}={v}" for k, v in self.figures.items())
        extra = f" | failed: {'; '.join(self.failures)}" if self.failures else ""
        print(f"RESULT {self.name} {status} {figs}{extra}", flush=True)
        return 1 if self.failures else 0


# ------------------------------------------------------------------------------------------------ measuring


def reset_peak(sec: Section) -> None:
    import torch

    if sec.gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak(sec: Section) -> dict[str, str]:
    """CUDA peak allocated / reserved since ``reset_peak`` (GiB); on the CPU the process's peak RSS (GiB)."""
    import torch

    if sec.gpu:
        torch.cuda.synchronize()
        return {"peak_alloc_GiB": f"{torch.cuda.max_memory_allocated() / 2**30:.2f}",
                "peak_reserved_GiB": f"{torch.cuda.max_memory_reserved() / 2**30:.2f}"}
    return {"peak_rss_GiB": f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f}"}


def rel_err(got, ref) -> float:
    """||got - ref|| / ||ref|| in float32 (L2 over all elements)."""
    got, ref = got.float(), ref.float()
    return float((got - ref).norm() / ref.norm().clamp(min=1e-12))


def oom_injector(attempts: set[int]):
    """An ``extract_hidden_states`` oom_injector raising torch's OOM error at the given forward attempts (from 0)."""
    import torch

    oom = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError

    def inject(attempt: int, indices: list[int], padded_tokens: int) -> None:
        if attempt in attempts:
            raise oom(f"CUDA out of memory. Tried to allocate (injected by gpu_smoke at forward attempt {attempt}, "
                      f"{len(indices)} samples / {padded_tokens} padded tokens)")

    return inject


def check_states(sec: Section, verifier: Path, store_dir: Path, n: int) -> float:
    """Compare stored states with an independent forward (a separately loaded model, one sample at a time, no
    padding, ``output_hidden_states``) in the same dtype on the same device: aux id k = hidden_states[k] (rounded to
    the store dtype); the stored final state is pre-norm, so norm(final) = hidden_states[-1], up to the store dtype's
    rounding of the norm's input (one unit roundoff more tolerance). Checks the n longest samples; also prints the
    error against the NEXT layer's state (an off-by-one layer id), which must be far above the tolerance. Returns the
    worst relative L2 error."""
    import torch
    from transformers import AutoModelForCausalLM

    from eagle3.store import HiddenStateStore

    store = HiddenStateStore(store_dir)
    dtype = getattr(torch, sec.dtype)
    model = AutoModelForCausalLM.from_pretrained(str(verifier), dtype=dtype).to(sec.device).eval()
    idx = sorted(store.indices(), key=lambda i: -store.tokens(i))[:n]
    ids, h = store.aux_layer_ids, store.hidden_size
    worst_aux = worst_final = 0.0
    off_by_one = float("inf")
    for i in idx:
        s = store.load(i)
        with torch.inference_mode():
            out = model.model(input_ids=s["input_ids"][None].to(sec.device), output_hidden_states=True,
                              use_cache=False)
            hs = out.hidden_states  # L+1 x [1, T, H]: [k] enters layer k; [-1] is after the final norm
            got = s["aux_hidden_states"].to(sec.device)  # [T, n_aux*H]
            ref_aux = torch.cat([hs[k][0] for k in ids], dim=-1).to(store.dtype)  # [T, n_aux*H]
            normed = model.model.norm(s["final_hidden_state"].to(sec.device, dtype))  # [T, H]
            worst_aux = max(worst_aux, rel_err(got, ref_aux))
            worst_final = max(worst_final, rel_err(normed, hs[-1][0]))
            off_by_one = min(off_by_one, rel_err(got[:, :h], hs[ids[0] + 1][0]))
    del model
    tol = STATE_TOLERANCE[sec.mode]
    tol_final = tol + torch.finfo(store.dtype).eps / 2  # + the unit roundoff (bf16: 2^-8)
    sec.check(worst_aux <= tol and worst_final <= tol_final and off_by_one > 3 * tol,
              f"stored states of the {len(idx)} longest samples ({', '.join(str(store.tokens(i)) for i in idx)} "
              f"tokens) match an independent {sec.dtype} forward: aux rel err {worst_aux:.2e} (tolerance {tol:g}), "
              f"norm(final) {worst_final:.2e} ({tol_final:.2g}); aux {ids[0]} vs layer {ids[0] + 1}'s state "
              f"{off_by_one:.2e} (must exceed {3 * tol:g})")
    return max(worst_aux, worst_final)


def extract(sec: Section, verifier: Path, dataset: Path, store: Path, budget: int, oom_at: set[int], **extra):
    """The transformers backend on ``sec.device`` in ``sec.dtype`` with OOMs injected at ``oom_at``; returns
    (artifact, seconds, memory figures)."""
    from eagle3.extract.stage import extract_hidden_states

    cfg = {"verifier": str(verifier), "device": sec.device, "dtype": sec.dtype, "store_dtype": "bfloat16",
           "max_tokens_per_batch": budget, "min_tokens_per_batch": 256, "log_every_samples": 0,
           "log_every_seconds": 0, **extra}
    reset_peak(sec)
    t = time.monotonic()
    res = extract_hidden_states(cfg, dataset, store, oom_injector=oom_injector(oom_at) if oom_at else None)
    return res, time.monotonic() - t, peak(sec)


def check_extraction(sec: Section, res, want_history: list[int] | None, samples: int) -> None:
    sec.check(res.model_loads == 1, f"verifier loaded once (model_loads {res.model_loads}): OOMs kept it loaded")
    if want_history is not None:
        sec.check(res.token_budget_history == want_history,
                  f"token budget after each OOM {res.token_budget_history} (want {want_history}: halved each time)")
    sec.check(res.samples_stored == samples and res.samples_unfittable_count == 0,
              f"{res.samples_stored}/{samples} samples stored, {res.samples_unfittable_count} unfittable")
    sec.check(res.compute_dtype == sec.dtype and res.store_dtype == "bfloat16",
              f"compute dtype {res.compute_dtype}, store dtype {res.store_dtype}")


# ------------------------------------------------------------------------------------------------ sections


def s_env(sec: Section) -> None:
    import platform

    import torch

    sec.say(f"python {platform.python_version()} ({sys.executable}); {platform.platform()}; "
            f"{os.cpu_count()} CPUs")
    site = os.environ.get("PYTHONPATH", "").split(os.pathsep)[0]
    versions = []
    for name in PACKAGES:
        try:
            dist = md.distribution(name)
            carried = site and str(dist.locate_file("")).startswith(site)
            versions.append(f"{name} {dist.version}{' (carried)' if carried else ''}")
        except md.PackageNotFoundError:
            versions.append(f"{name} -")
    sec.say("; ".join(versions))
    mods = ["eagle3.prepare", "eagle3.extract.stage", "eagle3.vocab", "eagle3.train.stage", "eagle3.train.launch",
            "eagle3.support.gpu", "eagle3.support.plot", "eagle3.capacity", "datasets", "transformers"]
    bad = []
    for m in mods:
        try:
            importlib.import_module(m)
        except Exception as e:  # noqa: BLE001 - report every import that fails
            bad.append(f"{m}: {type(e).__name__}: {e}")
    sec.check(not bad, f"library modules import ({len(mods)})" + (f": {bad}" if bad else ""))
    try:
        importlib.import_module("eagle3.train.memory")
        sec.say("eagle3.train.memory present")
    except ImportError:
        sec.say("eagle3.train.memory absent: memory plan not available")
    sec.fig(python=platform.python_version(), torch=torch.__version__)
    if not sec.gpu:
        sec.cuda_only("CUDA device, bf16 matmul rate, NCCL version")
        return
    ok = sec.check(torch.cuda.is_available(), f"CUDA available ({torch.cuda.device_count()} device(s), "
                   f"CUDA {torch.version.cuda})")
    if not ok:
        return
    p = torch.cuda.get_device_properties(0)
    nccl = torch.cuda.nccl.version()
    sec.say(f"{p.name}, capability {p.major}.{p.minor}, {p.total_memory / 2**30:.1f} GiB, "
            f"{p.multi_processor_count} SMs; NCCL {'.'.join(map(str, nccl)) if isinstance(nccl, tuple) else nccl}")
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.used,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20, check=False)
        sec.say(f"nvidia-smi: {smi.stdout.strip() or smi.stderr.strip()}")
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
    tflops = 10 * 2 * n**3 / (start.elapsed_time(end) / 1e3) / 1e12
    sec.check(torch.cuda.is_bf16_supported(), "bf16 supported")
    sec.fig(gpu=p.name.replace(" ", "_"), bf16_matmul_TFLOPs=f"{tflops:.0f}")


def s_preflight_locks(sec: Section) -> None:
    import torch

    from eagle3.support.gpu import (
        GpuBusyError,
        cuda_device_ids,
        cuda_preflight,
        file_lock_guard,
        gpu_processes,
        lock_names,
    )

    ids = cuda_device_ids(sec.device)
    names = lock_names(ids)
    sec.say(f"device ids {ids}, lock names {names} (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    if sec.gpu:
        first_visible = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip()
        sec.check(ids == [0] and names == [f"gpu-{first_visible}"],
                  "one GPU, lock named after its CUDA_VISIBLE_DEVICES id")
        report = cuda_preflight(ids, 0.8)
        free, total = report[0]
        sec.check(free >= 0.8 * total, f"preflight passes on the idle GPU: {free / 2**30:.1f} of "
                  f"{total / 2**30:.1f} GiB free")
        hog = torch.empty(int(0.3 * total), dtype=torch.uint8, device="cuda")  # 30% of the card held by us
        try:
            cuda_preflight(ids, 0.8)
            sec.check(False, "preflight refuses a GPU with 30% of its memory in use")
        except GpuBusyError as e:
            first = str(e).splitlines()
            sec.check("cuda:0 has" in first[0], f"preflight refuses a GPU with 30% in use: {first[0][:160]}")
            sec.say(f"processes holding GPUs (pynvml / nvidia-smi): {' | '.join(first[1:3]) or '-'}")
        del hog
        torch.cuda.empty_cache()
        sec.fig(free_GiB=f"{free / 2**30:.1f}", total_GiB=f"{total / 2**30:.1f}")
    else:
        sec.cuda_only(f"cuda_preflight (a no-op without CUDA: {cuda_preflight(None, 0.8)}); {gpu_processes()[:80]}")
    # the lock: held here, a second process must be refused naming this PID, and get it once released
    probe = ("import sys; from eagle3.support.gpu import device_lock, GpuBusyError\n"
             "try:\n    with device_lock(sys.argv[1:], wait_seconds=0): print('acquired')\n"
             "except GpuBusyError as e: print('busy:', e)")
    with file_lock_guard()(ids):
        out = subprocess.run([sys.executable, "-c", probe, *names], capture_output=True, text=True, timeout=120,
                             check=False)
        text = out.stdout.strip() or out.stderr.strip()[-300:]
        sec.check(text.startswith("busy:") and f"PID {os.getpid()}" in text,
                  f"a second process is refused while the lock is held: {text[:200]}")
    out = subprocess.run([sys.executable, "-c", probe, *names], capture_output=True, text=True, timeout=120,
                         check=False)
    sec.check(out.stdout.strip() == "acquired", f"and acquires it once released: {out.stdout.strip()[:80]}")
    sec.fig(locks=",".join(names))


def s_extract_tiny(sec: Section) -> None:
    """The bundled verifier (bf16 checkpoint) on prepared stdlib chats; one injected OOM at the first forward."""
    from eagle3.prepare import PrepareConfig, prepare_data
    from eagle3.vocab import VocabConfig, build_vocab

    z, root = sec.size, sec.work / "tiny"
    prep = prepare_data(PrepareConfig(sources=[str(TINY_DATA)], tokenizer_path=str(TINY_VERIFIER),
                                      max_samples=z["tiny_samples"], max_seq_len=z["tiny_seq"]), root / "prep")
    sec.say(f"prepared {prep.samples} samples, {prep.total_tokens:,} tokens ({prep.assistant_tokens:,} assistant)")
    res, secs, mem = extract(sec, TINY_VERIFIER, Path(prep.dataset_path), root / "store", z["tiny_budget"], {0})
    check_extraction(sec, res, [z["tiny_budget"], z["tiny_budget"] // 2], prep.samples)
    err = check_states(sec, TINY_VERIFIER, root / "store", z["check_samples"])
    vocab = build_vocab(VocabConfig(draft_vocab_size=2048), prep, 8192, root / "vocab")
    sec.check(Path(vocab.mapping_path).is_file(), f"vocab mapping 2048 of 8192, coverage {vocab.coverage:.3f}")
    sec.fig(tok_s=f"{res.tokens_per_second:,.0f}", tokens=res.tokens_written, extract_s=f"{res.extract_seconds:.2f}",
            load_s=f"{res.model_load_seconds:.2f}", wall_s=f"{secs:.1f}", **mem, state_err=f"{err:.1e}")


def s_extract_big(sec: Section) -> None:
    """A random Llama of ~0.5 GB bf16 built on the GPU, real batches; injected OOMs at forwards 1 and 3, then (GPU)
    a real CUDA OOM under a per-process memory cap."""
    import torch
    from _extract_common import quiet, save_dataset, save_llama

    from eagle3.vocab import VocabConfig, build_vocab

    quiet()
    z, root = sec.size, sec.work / "big"
    t = time.monotonic()
    verifier = save_llama(root / "verifier", hidden=z["big_hidden"], layers=z["big_layers"], vocab=z["big_vocab"],
                          device=sec.device, dtype=getattr(torch, sec.dtype))
    weights = sum(f.stat().st_size for f in verifier.glob("*.safetensors"))
    ds = save_dataset(root / "ds", z["big_samples"], *z["big_len"], vocab=z["big_vocab"])
    sec.say(f"random Llama hidden {z['big_hidden']} x {z['big_layers']} layers, vocab {z['big_vocab']}: "
            f"{weights / 1e6:.0f} MB of {sec.dtype} weights; {z['big_samples']} samples of {z['big_len']} tokens; "
            f"built in {time.monotonic() - t:.1f} s")
    budget = z["big_budget"]
    res, _, mem = extract(sec, verifier, ds, root / "store", budget, {1, 3})
    check_extraction(sec, res, [budget, budget // 2, budget // 4], z["big_samples"])
    err = check_states(sec, verifier, root / "store", z["check_samples"])
    gbs = res.bytes_on_disk / res.extract_seconds / 1e9 if res.extract_seconds else 0.0
    sec.fig(tok_s=f"{res.tokens_per_second:,.0f}", tokens=res.tokens_written, store_GB=f"{res.bytes_on_disk / 1e9:.2f}",
            store_GB_s=f"{gbs:.2f}", extract_s=f"{res.extract_seconds:.1f}", load_s=f"{res.model_load_seconds:.1f}",
            **mem, state_err=f"{err:.1e}")
    vocab = build_vocab(VocabConfig(draft_vocab_size=z["big_draft_vocab"]), ds, z["big_vocab"], root / "vocab")
    sec.check(Path(vocab.mapping_path).is_file(), f"vocab mapping {z['big_draft_vocab']} of {z['big_vocab']}")
    if not sec.gpu:
        sec.cuda_only("a real CUDA OOM under torch.cuda.set_per_process_memory_fraction")
        return
    # a real OOM: cap this process at the weights + 60% of what the budget-B batches needed above, so the largest
    # batches fail inside the forward and the halved budget fits
    total = torch.cuda.get_device_properties(0).total_memory
    need = float(mem["peak_alloc_GiB"]) * 2**30
    cap = weights + 0.6 * max(need - weights, 0)
    torch.cuda.empty_cache()  # what the first run and the check left cached counts against the cap
    torch.cuda.set_per_process_memory_fraction(cap / total)
    sec.say(f"real OOM: memory capped at {cap / 2**30:.2f} GiB (peak at budget {budget}: {need / 2**30:.2f} GiB)")
    real, _, _ = extract(sec, verifier, ds, root / "store-real-oom", budget, set(),
                             shard_end=z["real_oom_samples"])
    torch.cuda.set_per_process_memory_fraction(1.0)
    halvings = len(real.token_budget_history) - 1
    sec.check(real.model_loads == 1 and real.samples_stored == z["real_oom_samples"]
              and real.samples_unfittable_count == 0,
              f"under the cap: {real.samples_stored}/{z['real_oom_samples']} samples stored, model loaded "
              f"{real.model_loads}x, budget history {real.token_budget_history}")
    if halvings == 0:
        sec.say("note: no real OOM happened under the cap (the allocator fit the batches): nothing halved")
    sec.fig(real_oom_halvings=halvings)


def _train_cfg(sec: Section, big: bool, **over):
    from eagle3.train.config import TrainConfig

    z = sec.size
    if big:
        base = {"epochs": 1, "batch_size": z["big_batch"], "max_seq_len": z["big_seq"], "ttt_steps": z["big_ttt"],
                "loader_workers": 2}
    else:
        base = {"epochs": 1, "batch_size": z["tiny_batch"], "max_seq_len": z["tiny_seq"], "ttt_steps": 3,
                "lr": 3e-3, "warmup_ratio": 0.1, "loader_workers": 1}
    return TrainConfig(**{**base, "log_every_steps": 1, "device": sec.device, "keep_last_n": 1, **over})


def _metrics(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _needs(sec: Section, *paths: Path) -> bool:
    missing = [str(p) for p in paths if not p.exists()]
    return sec.check(not missing, "inputs from an earlier section present"
                     + (f": missing {missing}" if missing else ""))


def _timed_train(sec: Section, cfg, store: Path, vocab: Path, verifier: Path, out: Path):
    """train_draft with a clock on every optimizer step (log_every_steps 1 -> on_progress per step)."""
    from eagle3.train.stage import train_draft

    stamps: list[float] = []
    reset_peak(sec)
    t = time.monotonic()
    res = train_draft(cfg, store, vocab, out, verifier=verifier, resume=False,
                      on_progress=lambda done, total, line: stamps.append(time.monotonic()))
    wall = time.monotonic() - t
    steps = [b - a for a, b in itertools.pairwise(stamps)]
    step_s = statistics.median(steps[1:] or steps or [float("nan")])  # the first steps include warm-up
    return res, wall, step_s, peak(sec)


def _check_run(sec: Section, res, label: str) -> None:
    m = _metrics(Path(res.out_dir))
    losses = [r["loss"] for r in m if r["event"] == "train"]
    sec.check(res.global_step == res.total_steps > 0 and res.checkpoint_dir and Path(res.checkpoint_dir).is_dir(),
              f"{label}: {res.global_step}/{res.total_steps} steps, checkpoint {Path(res.checkpoint_dir or '-').name}")
    sec.check(all(math.isfinite(x) for x in losses) and res.final_val and math.isfinite(res.final_val["loss"]),
              f"{label}: losses finite (first {losses[0]:.4f}, last {losses[-1]:.4f}, val {res.final_val['loss']:.4f})"
              if losses and res.final_val else f"{label}: no losses recorded")


def _pinned_check(sec: Section, store_dir: Path, cfg, vocab_size: int) -> None:
    """The trainer's StepLoader with pin_memory (as on CUDA): the batches arrive page-locked; H2D GB/s of one
    batch's aux states pinned vs pageable."""
    import torch

    from eagle3.store import HiddenStateStore
    from eagle3.train.data import BatchPlan, StepLoader, pack_samples

    if not sec.gpu:
        sec.cuda_only("pinned-memory loader batches (pin_memory needs CUDA)")
        return
    store = HiddenStateStore(store_dir)
    bins = pack_samples({i: min(store.tokens(i), cfg.max_seq_len) for i in store.indices()}, cfg.max_seq_len)
    plan = BatchPlan(bins, 0, cfg.batch_size, 1, 1, 0)
    loader = StepLoader(store, plan, [(0, 0), (0, 1)], cfg.max_seq_len, cfg.ttt_steps, vocab_size, workers=1,
                        pin_memory=True)
    try:
        batch = next(iter(loader))[0]
    finally:
        loader.close()
    tensors = (batch.input_ids, batch.aux, batch.final, batch.loss_mask, batch.seq_ids, batch.position_ids)
    sec.check(all(t.is_pinned() for t in tensors), "StepLoader(pin_memory=True) batches are page-locked")

    def h2d(t) -> float:
        t.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        s = time.perf_counter()
        for _ in range(5):
            t.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        return 5 * t.numel() * t.element_size() / (time.perf_counter() - s) / 1e9

    pageable = torch.empty(batch.aux.shape, dtype=batch.aux.dtype).copy_(batch.aux)  # ordinary host memory
    pinned, pageable = h2d(batch.aux), h2d(pageable)
    sec.say(f"H2D copy of one micro-batch's aux states ({batch.aux.numel() * 2 / 1e6:.0f} MB): pinned "
            f"{pinned:.1f} GB/s, pageable {pageable:.1f} GB/s")
    sec.fig(h2d_pinned_GB_s=f"{pinned:.1f}", h2d_pageable_GB_s=f"{pageable:.1f}")


def s_train_tiny(sec: Section) -> None:
    """train_draft on one device (bf16 autocast on CUDA) on the bundled verifier's store; the first steps again in
    float32 on the CPU: the same seeded init, batches and schedule give the same losses up to bf16 rounding."""
    root = sec.work / "tiny"
    if not _needs(sec, root / "store" / "manifest.jsonl", root / "vocab" / "mapping.safetensors"):
        return
    cfg = _train_cfg(sec, big=False)
    res, wall, step_s, mem = _timed_train(sec, cfg, root / "store", root / "vocab" / "mapping.safetensors",
                                          TINY_VERIFIER, root / f"train-{sec.device}")
    _check_run(sec, res, f"{sec.device} run")
    n = sec.size["cpu_ref_steps"]
    ref, *_ = _timed_train(sec, cfg.model_copy(update={"device": "cpu", "stop_after_steps": n}), root / "store",
                           root / "vocab" / "mapping.safetensors", TINY_VERIFIER, root / "train-cpu-ref")
    a = [r for r in _metrics(Path(res.out_dir)) if r["global_step"] <= n]
    b = _metrics(Path(ref.out_dir))
    pairs = [(x["loss"], y["loss"]) for x, y in zip(a, b)
             if (x["event"], x["global_step"]) == (y["event"], y["global_step"])]
    worst = max(abs(x - y) / max(abs(y), 1e-6) for x, y in pairs) if pairs else float("inf")
    tol = 0.03 if sec.gpu else 1e-6
    sec.check(len(pairs) == len(b) and worst <= tol,
              f"{sec.device}{' bf16 autocast' if sec.gpu else ''} vs cpu float32: {len(pairs)} records (val at "
              f"step 0 + {n} steps), worst relative loss difference {worst:.2e} (tolerance {tol:g})"
              + ("" if sec.gpu else " (dry run: both on the CPU)"))
    _pinned_check(sec, root / "store", cfg, 8192)
    tokens_per_step = res.tokens_seen / max(res.global_step, 1)
    sec.fig(steps=res.global_step, step_ms=f"{step_s * 1e3:.1f}", tok_s=f"{tokens_per_step / step_s:,.0f}",
            wall_s=f"{wall:.1f}", **mem, vs_cpu_rel=f"{worst:.1e}")


def s_train_big(sec: Section) -> None:
    """train_draft against the random Llama's store: 2048-token packed rows, 7 TTT steps, DataLoader workers; step
    time, tokens/s, CUDA peak vs the training memory plan."""
    root = sec.work / "big"
    if not _needs(sec, root / "store" / "manifest.jsonl", root / "vocab" / "mapping.safetensors"):
        return
    cfg = _train_cfg(sec, big=True)
    vocab = root / "vocab" / "mapping.safetensors"
    res, wall, step_s, mem = _timed_train(sec, cfg, root / "store", vocab, root / "verifier", root / "train")
    _check_run(sec, res, f"{sec.device} run")
    tokens_per_step = res.tokens_seen / max(res.global_step, 1)
    sec.say(f"{res.train_rows} rows of {cfg.max_seq_len} tokens (packing {res.packing_efficiency:.3f}), "
            f"{tokens_per_step:,.0f} tokens/step, median step {step_s * 1e3:.1f} ms, wall {wall:.1f} s "
            f"(validation, checkpoints and plots included)")
    _pinned_check(sec, root / "store", cfg, SIZES[sec.mode]["big_vocab"])
    key = "peak_alloc_GiB" if sec.gpu else "peak_rss_GiB"
    _memory_plan(sec, cfg, root / "store", vocab, root / "verifier", float(mem[key]) * 2**30)
    sec.fig(steps=res.global_step, step_ms=f"{step_s * 1e3:.1f}", tok_s=f"{tokens_per_step / step_s:,.0f}",
            wall_s=f"{wall:.1f}", **mem)


def _launch(sec: Section, parallel: str) -> None:
    """The multi-process path (torch elastic launch, one worker, nccl on CUDA / gloo on CPU) with DDP or FSDP; its
    losses vs the single-process run of train_tiny (same seed, same global batch)."""
    from eagle3.train.launch import launch

    root = sec.work / "tiny"
    if not _needs(sec, root / "store" / "manifest.jsonl", root / "vocab" / "mapping.safetensors"):
        return
    cfg = _train_cfg(sec, big=False, nproc=1, parallel=parallel)
    out = root / f"train-{parallel}"
    t = time.monotonic()
    res = launch(cfg, root / "store", root / "vocab" / "mapping.safetensors", TINY_VERIFIER, out, resume=False)
    wall = time.monotonic() - t
    log_text = (out / "train-rank0.log").read_text()
    backend = "nccl" if sec.gpu else "gloo"
    sec.check(res["nproc"] == 1 and "[train]" in log_text, f"worker ran (nproc {res['nproc']}), rank-0 log "
              f"{len(log_text.splitlines())} lines, {res['global_step']}/{res['total_steps']} steps in {wall:.1f} s")
    want = f"draft wrapped in {parallel.upper()} over 1 process(es) ({backend})"
    sec.check(want in log_text, f"rank 0 log says: {want}")
    single = root / f"train-{sec.device}" / "metrics.jsonl"
    if single.is_file():
        a = [json.loads(x) for x in single.read_text().splitlines()]
        b = _metrics(out)
        same = [(x["event"], x["global_step"]) for x in a] == [(y["event"], y["global_step"]) for y in b]
        worst = max((abs(x["loss"] - y["loss"]) / max(abs(x["loss"]), 1e-6) for x, y in zip(a, b)),
                    default=float("inf"))
        # one worker computes what the plain process does; CUDA's nondeterministic backward kernels (atomics) may
        # move the losses a little over the steps, the CPU's are bit-identical
        tol = 2e-3 if sec.gpu else 1e-6
        sec.check(same and worst <= tol, f"{parallel} x1 vs the single-process {sec.device} run: {len(b)} metrics "
                  f"records, worst relative loss difference {worst:.2e} (tolerance {tol:g})")
        sec.fig(vs_single=f"{worst:.1e}")
    else:
        sec.check(False, f"no single-process metrics at {single} (train_tiny failed?) to compare with")
    sec.fig(wall_s=f"{wall:.1f}", steps=res["global_step"], train_wall_s=f"{res['wall_s']:.1f}")


def s_launch_ddp(sec: Section) -> None:
    _launch(sec, "ddp")


def s_launch_fsdp(sec: Section) -> None:
    _launch(sec, "fsdp")


def s_fp8(sec: Section) -> None:
    """The FP8 store on the device: the tiny prepared data extracted again with store_dtype float8_e4m3fn (one
    scale per token and state); the trainer's CUDA input path keeps batches quantized (float8 + scales, pinned) and
    ``Batch.to`` dequantizes them on the GPU, equal to the CPU dequantization; then train_draft on the FP8 store
    (same settings as train_tiny): its losses stay near the bf16 store's (FP8 rounding: ~2% per state)."""
    import torch

    from eagle3.store import HiddenStateStore, sample_files
    from eagle3.train.data import BatchPlan, StepLoader, pack_samples

    z, root = sec.size, sec.work / "tiny"
    if not _needs(sec, root / "prep", root / "vocab" / "mapping.safetensors", root / f"train-{sec.device}"):
        return
    from eagle3.prepare import PreparedData

    prep = PreparedData.load(root / "prep")
    res, secs, _ = extract(sec, TINY_VERIFIER, Path(prep.dataset_path), root / "store-fp8", z["tiny_budget"], set(),
                           store_dtype="float8_e4m3fn")
    bf16_bytes = sum(f.stat().st_size for f in sample_files(root / "store"))
    fp8_bytes = sum(f.stat().st_size for f in sample_files(root / "store-fp8"))
    sec.check(res.store_dtype == "float8_e4m3fn" and res.samples_stored == prep.samples and fp8_bytes < bf16_bytes,
              f"FP8 store: {res.samples_stored} samples, {fp8_bytes:,} bytes vs bf16 {bf16_bytes:,} "
              f"(ratio {fp8_bytes / bf16_bytes:.3f})")
    cfg = _train_cfg(sec, big=False)
    store = HiddenStateStore(root / "store-fp8")
    bins = pack_samples({i: min(store.tokens(i), cfg.max_seq_len) for i in store.indices()}, cfg.max_seq_len)
    plan = BatchPlan(bins, 0, cfg.batch_size, 1, 1, 0)
    loader = StepLoader(store, plan, [(0, 0)], cfg.max_seq_len, cfg.ttt_steps, 8192, workers=1,
                        pin_memory=sec.gpu, dequant_dtype=torch.bfloat16, dequantize=False)
    try:
        batch = next(iter(loader))[0]
    finally:
        loader.close()
    on_device = batch.to(torch.device(sec.device))
    cpu = batch.to(torch.device("cpu"))  # the same dequantization on the CPU
    same = (on_device.aux.cpu().float() - cpu.aux.float()).abs().max().item()
    sec.check(batch.aux.dtype == torch.float8_e4m3fn and on_device.aux.dtype == torch.bfloat16 and
              on_device.aux.device.type == sec.device and same <= 2 ** -7 * cpu.aux.float().abs().max().item(),
              f"batches arrive quantized ({batch.aux.dtype}); Batch.to({sec.device}) dequantizes to "
              f"{on_device.aux.dtype} on the device, max |device - cpu| {same:.2e}")
    res_fp8, wall, step_s, tmem = _timed_train(sec, cfg, root / "store-fp8", root / "vocab" / "mapping.safetensors",
                                               TINY_VERIFIER, root / f"train-fp8-{sec.device}")
    _check_run(sec, res_fp8, f"{sec.device} run on the FP8 store")
    a = {(r["event"], r["global_step"]): r["loss"] for r in _metrics(root / f"train-{sec.device}")}
    b = {(r["event"], r["global_step"]): r["loss"] for r in _metrics(Path(res_fp8.out_dir))}
    both = sorted(set(a) & set(b))
    worst = max(abs(b[k] - a[k]) / max(abs(a[k]), 1e-6) for k in both) if both else float("inf")
    sec.check(len(both) == len(a) and worst <= 0.10,
              f"FP8-store losses vs the bf16 store's (train_tiny): {len(both)} records, worst relative difference "
              f"{worst:.2e} (tolerance 0.1)")
    sec.fig(ratio=f"{fp8_bytes / bf16_bytes:.3f}", extract_s=f"{secs:.1f}", step_ms=f"{step_s * 1e3:.1f}",
            train_s=f"{wall:.1f}", vs_bf16_rel=f"{worst:.1e}", **tmem)


SECTIONS = {"env": s_env, "preflight_locks": s_preflight_locks, "extract_tiny": s_extract_tiny,
            "extract_big": s_extract_big, "train_tiny": s_train_tiny, "train_big": s_train_big,
            "fp8": s_fp8, "launch_ddp": s_launch_ddp, "launch_fsdp": s_launch_fsdp}


# ------------------------------------------------------------------------------------------------ memory plan


def _memory_plan(sec: Section, cfg, store_dir: Path, vocab: Path, verifier: Path, measured: float) -> None:
    """The training memory plan (eagle3/train/memory.py ``plan_training_memory``, on the fp8 branch when this was
    written: absent = "memory plan not available") for the run just measured vs its measured peak: CUDA
    max_memory_allocated (target: plan within 20%); on the CPU the process's peak RSS, which also holds the Python
    runtime and the loader's prefetch the plan leaves out (printed, not judged)."""
    try:
        from eagle3.train.memory import plan_training_memory
    except ImportError:
        sec.say("memory plan not available (eagle3/train/memory.py is not in this checkout)")
        sec.fig(plan="n/a")
        return
    from eagle3.draft.config import DraftConfig
    from eagle3.store import HiddenStateStore
    from eagle3.support.verifier import VerifierSpec
    from eagle3.vocab import load_mapping

    store = HiddenStateStore(store_dir)
    d2t, _ = load_mapping(vocab)
    draft = DraftConfig.build(VerifierSpec.from_path(verifier), len(d2t), store.aux_layer_ids, cfg.draft)
    # as Trainer.setup plans it: batches hold the store's values, except a scaled (FP8) store's, which arrive in the
    # compute dtype (the plan's default)
    scaled = getattr(store, "scaled", False)
    plan = plan_training_memory(draft, cfg, world=1, device=sec.device,
                                batch_dtype_bytes=None if scaled else store.dtype.itemsize)
    for line in plan.summary().splitlines():
        sec.say(f"memory plan: {line}")
    ratio = plan.peak_bytes / measured
    what = "CUDA peak allocated" if sec.gpu else "peak RSS (runtime included: not judged)"
    verdict = ("ok" if 0.8 <= ratio <= 1.2 else "MISSED") if sec.gpu else "n/a on the CPU"
    sec.say(f"memory plan peak {plan.peak_bytes / 2**30:.2f} GiB vs measured {what} {measured / 2**30:.2f} GiB: "
            f"plan/measured {ratio:.2f} (target 0.8-1.2: {verdict})")
    sec.fig(plan_GiB=f"{plan.peak_bytes / 2**30:.2f}", plan_vs_peak=f"{ratio:.2f}")


# ------------------------------------------------------------------------------------------------ dry-run view


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def h200_view(out: Path) -> None:
    """Dry run only: a venv (no packages of its own) whose site-packages reach, through symlinks, only those
    distributions of this interpreter's environment that the GPU machine's image holds (the package list of the
    device tool's KINDS.md). The carried wheels and the checkout come on top through PYTHONPATH, as there. Prints
    the venv's python."""
    import sysconfig

    text = KINDS_MD.read_text() if KINDS_MD.is_file() else ""
    m = re.search(r"^nvidia-h200: their image.*?Packages: (.*?)\.\s*$", text, re.MULTILINE)
    if not m:
        print(f"h200-view: no package list in {KINDS_MD}; using this environment unfiltered", file=sys.stderr)
        print(sys.executable)
        return
    from packaging.requirements import Requirement

    allowed = {_norm(p) for p in m.group(1).split(", ")}
    src = Path(sysconfig.get_paths()["purelib"])
    dists = {_norm(d.metadata["Name"]): d for d in md.distributions(path=[str(src)])}
    # the versions here differ from the image's (huggingface-hub 2.x here needs httpx2, 1.x there httpx): what an
    # allowed distribution requires here counts as part of it
    todo, added = list(allowed & dists.keys()), set()
    while todo:
        for spec in dists[todo.pop()].requires or []:
            req = Requirement(spec)
            dep = _norm(req.name)
            if dep in dists and dep not in allowed and (req.marker is None or req.marker.evaluate({"extra": ""})):
                allowed.add(dep)
                added.add(dep)
                todo.append(dep)
    print(f"h200-view: allowed as requirements of the image's packages (their versions here): "
          f"{', '.join(sorted(added)) or '-'}", file=sys.stderr)
    # named site-packages: dill pickles a module by reference only when its path says it is installed (a path
    # with 'site-packages' in it, or under sys.prefix), and datasets' fingerprints pickle pyarrow's module
    view = out / "site-packages"
    view.mkdir(parents=True, exist_ok=True)
    kept, hidden = [], []
    for dist in dists.values():
        name = _norm(dist.metadata["Name"])
        (kept if name in allowed else hidden).append(name)
        if name not in allowed:
            continue
        tops = {Path(f).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            link = view / top
            if (src / top).exists() and not link.exists():
                link.symlink_to(src / top)
    venv = out / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True)
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    purelib = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True,
                             check=True).stdout.strip()
    Path(purelib, "h200_view.pth").write_text(f"{view}\n")
    print(f"h200-view: {len(kept)} distributions of {src} visible, {len(hidden)} hidden (not on the GPU image): "
          f"{', '.join(sorted(hidden))}", file=sys.stderr)
    print(venv / "bin" / "python")


# ------------------------------------------------------------------------------------------------ main


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "h200-view":
        h200_view(Path(sys.argv[2]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("gpu", "cpu"), required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("section", choices=sorted(SECTIONS))
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    # the library's INFO lines (OOM halvings, progress) go to stderr, which gpu_smoke.sh keeps in the full log
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    with contextlib.suppress(ImportError):
        from _extract_common import quiet

        quiet()
    sec = Section(args.section, args.mode, args.work)
    try:
        SECTIONS[args.section](sec)
    except Exception as e:  # noqa: BLE001 - the section fails with its error; the next section still runs
        traceback.print_exc()
        sec.check(False, f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
    return sec.result()


if __name__ == "__main__":
    sys.exit(main())
