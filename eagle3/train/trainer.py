"""Train the EAGLE-3 draft on stored verifier states with the training-time test (TTT).

Pipeline position: store + vocab -> **train** -> checkpoints -> validate.

Lifecycle (``Trainer``): setup (check inputs, split, pack, build draft/teacher/optimizer, resume) -> train (epochs of
optimizer steps; validation, vLLM-ready checkpoint, trainer state and plots after each epoch) -> cleanup.
``train_draft`` runs it in this process, or launches ``torch.distributed.run`` workers (eagle3.train.launch) when
``nproc > 1``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from eagle3.draft import checkpoint as ckpt
from eagle3.draft.config import DraftConfig
from eagle3.draft.model import Eagle3Draft
from eagle3.store import STORE_JSON, HiddenStateStore, StoreError
from eagle3.support.dtypes import resolve_compute_dtype, resolve_device
from eagle3.support.io import atomic_write_text, sha256_file
from eagle3.support.progress import Progress, fmt_duration
from eagle3.support.settings import output_view
from eagle3.support.verifier import VerifierSpec, load_verifier_head, verifier_fingerprint
from eagle3.train.config import TrainConfig, TrainError
from eagle3.train.data import (
    Batch,
    BatchPlan,
    DamagedSample,
    StepLoader,
    collate,
    noise_seed,
    noised_aux,
    pack_samples,
    packing_efficiency,
    split_indices,
    verify_bins,
)
from eagle3.train.dist import Dist
from eagle3.train.memory import check_memory, free_device_memory, plan_training_memory
from eagle3.train.metrics import METRICS, append_metrics, read_metrics, write_plots
from eagle3.train.optim import build_optimizers, muon_ns_dtype, set_lr
from eagle3.train.schedule import lr_at
from eagle3.train.ttt import N_STATS, TrainingTimeTest, summarize
from eagle3.vocab import load_mapping

log = logging.getLogger("eagle3")

LATEST = "latest"  # the resume state's folder

# ----------------------------------------------------------------------------- the trainer


class Trainer:
    """setup -> train -> cleanup; see the module docstring. Rank 0 writes every file."""

    def __init__(self, cfg: TrainConfig, store_dir: str | Path, vocab_path: str | Path, verifier_path: str | Path,
                 out_dir: str | Path, resume: bool = True, dist: Dist | None = None,
                 on_progress: Callable[[int, int, str], None] | None = None):
        self.cfg, self.resume, self.on_progress = cfg, resume, on_progress
        self.store_dir, self.vocab_path = Path(store_dir), Path(vocab_path)
        self.verifier_path, self.out_dir = Path(verifier_path), Path(out_dir)
        self.dist = dist or Dist()
        self.ckpt_dir, self.latest_dir = self.out_dir / "checkpoints", self.out_dir / LATEST
        self.metrics_path = self.out_dir / METRICS
        self._loader: StepLoader | None = None
        self._last_save = time.monotonic()  # when the resume state was last written (save_state_every_minutes)

    # --- setup ------------------------------------------------------------------------------------------------

    def setup(self) -> None:
        cfg, d = self.cfg, self.dist
        if cfg.batch_size % (d.world * cfg.grad_accum_steps):
            raise TrainError(f"batch_size {cfg.batch_size} (packed sequences per optimizer step) is not a multiple "
                             f"of nproc {d.world} x grad_accum_steps {cfg.grad_accum_steps}")
        self.micro = cfg.batch_size // (d.world * cfg.grad_accum_steps)
        self.device = self._device()
        # bf16 autocast on CUDA; on a CPU as cpu_dtype says ("auto": bf16 only where the CPU multiplies it natively)
        cpu_bf16 = resolve_compute_dtype(cfg.cpu_dtype, "bfloat16", "cpu") == "bfloat16"
        self.autocast = torch.bfloat16 if self.device.type == "cuda" or cpu_bf16 else None
        # a float8 store's states: dequantized to the compute dtype by the loader workers on CPU, on the GPU after
        # the copy on CUDA (Batch.to)
        self.dequant_dtype = self.autocast or torch.float32
        self.dequant_in_loader = self.device.type != "cuda"
        spec = VerifierSpec.from_path(self.verifier_path)
        try:
            self.store = HiddenStateStore(self.store_dir)
        except StoreError as e:
            raise TrainError(str(e)) from None
        self._check_inputs(spec)
        if problems := self.store.check_sizes():  # one lstat per sample; content is hashed on first read
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            raise TrainError(f"store {self.store_dir}: {len(problems)} samples are not in place: "
                             f"{'; '.join(problems[:5])}{more}. Rerun extraction into this store (the pipeline "
                             f"does on its next run: only these samples are extracted again), then training")
        d2t, t2d = load_mapping(self.vocab_path)
        if len(d2t) > spec.vocab_size:
            raise TrainError(f"vocab mapping {self.vocab_path}: draft vocab {len(d2t)} is larger than the verifier's "
                             f"vocabulary ({spec.vocab_size} tokens, {self.verifier_path / 'config.json'})")
        if len(t2d) != spec.vocab_size:
            raise TrainError(f"vocab mapping {self.vocab_path}: t2d covers {len(t2d)} target tokens, the verifier "
                             f"{self.verifier_path} has vocab_size {spec.vocab_size}")
        self.draft_cfg = DraftConfig.build(spec, len(d2t), self.store.aux_layer_ids, cfg.draft,
                                           torch_dtype=cfg.checkpoint_dtype)
        self._check_memory()
        self.draft = Eagle3Draft.from_verifier(self.draft_cfg, self.verifier_path, d2t, t2d, seed=cfg.seed,
                                                 init_layer=cfg.init_from_layer)
        head = load_verifier_head(self.verifier_path, torch.arange(len(d2t)) + d2t, with_embedding=False)

        samples = sorted(self.store.indices())[:cfg.max_samples]  # None: all
        lengths = {i: min(self.store.tokens(i), cfg.max_seq_len) for i in samples}
        self.truncated = sum(1 for i in lengths if self.store.tokens(i) > cfg.max_seq_len)
        train_idx, val_idx = split_indices(samples, cfg.val_ratio, cfg.seed)
        self.train_bins = pack_samples({i: lengths[i] for i in train_idx}, cfg.max_seq_len)
        self.val_bins = pack_samples({i: lengths[i] for i in val_idx}, cfg.max_seq_len)
        self.packing = packing_efficiency(self.train_bins, lengths, cfg.max_seq_len)
        self.steps_per_epoch = len(self.train_bins) // cfg.batch_size
        if self.steps_per_epoch == 0:
            raise TrainError(f"store {self.store_dir}: {len(train_idx)} training samples pack into "
                             f"{len(self.train_bins)} rows of {cfg.max_seq_len} tokens, fewer than one batch "
                             f"(batch_size {cfg.batch_size}); lower batch_size or max_seq_len")
        self.total_steps = self.steps_per_epoch * cfg.epochs

        self.draft.to(self.device)
        self.ttt = TrainingTimeTest(self.draft, head.norm_weight, head.lm_head, head.rms_norm_eps, cfg.ttt_steps,
                                    cfg.step_weight_decay, self.autocast, loss=cfg.loss, lk_eta=cfg.lk_eta
                                    ).to(self.device)
        self.model = self._wrap(self.ttt)
        self.optimizers = build_optimizers(self.draft, cfg, self.device)
        if cfg.optimizer == "muon" and self.dist.main:
            ns = muon_ns_dtype(cfg, self.device)
            log.info("[train] Muon's Newton-Schulz steps in %s (muon_ns_dtype %s)", ns, cfg.muon_ns_dtype)
            if ns == "bfloat16" != resolve_compute_dtype("auto", "bfloat16", self.device):  # the rule: float32
                log.warning("[train] muon_ns_dtype bfloat16 on a CPU without native bf16: bf16 matmuls run ~20x "
                            "slower than float32 here; muon_ns_dtype auto or float32 runs them in float32")
        self.epoch, self.step_in_epoch, self.global_step, self.tokens_seen = 0, 0, 0, 0
        # [K, N_STATS] float64: TTT stats of the steps since the last train record (or the epoch start); part of
        # the resume state, so the first record after a resume covers the same steps as in an uninterrupted run
        self.window = torch.zeros(cfg.ttt_steps, N_STATS, dtype=torch.float64)
        self.best: dict[str, Any] = {"epoch": None, "sim_accept_len": -1.0}
        self.history: list[dict[str, Any]] = []
        if self.dist.main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        if self.resume and (self.latest_dir / ckpt.STATE_JSON).is_file():
            self._load_state()
        elif self.dist.main:
            for p in (self.metrics_path, self.ckpt_dir / "best"):
                p.unlink(missing_ok=True)
            for p in [*ckpt.list_epoch_dirs(self.ckpt_dir), self.latest_dir]:
                shutil.rmtree(p, ignore_errors=True)
        self.dist.barrier()
        if self.dist.main:
            log.info("[train] config: %s", cfg.model_dump_json())
            log.info("[train] draft: %s", self.draft_cfg.model_dump_json())
            log.info("[train] %d train samples -> %d rows of %d tokens (packing efficiency %.4f, %d truncated), "
                     "%d val samples -> %d rows; %d steps/epoch x %d epochs, micro-batch %d x %d accum x %d procs, "
                     "device %s", len(train_idx), len(self.train_bins), cfg.max_seq_len, self.packing,
                     self.truncated, len(val_idx), len(self.val_bins), self.steps_per_epoch, cfg.epochs, self.micro,
                     cfg.grad_accum_steps, d.world, self.device)

    def _check_memory(self) -> None:
        """The training memory plan, logged; refuses (or warns) before the draft is allocated when it cannot fit.
        On CPU the host's RAM is shared by all ranks: local rank 0 checks for all of them."""
        state_bytes = self.dequant_dtype.itemsize if self.store.scaled else self.store.dtype.itemsize
        self.memory_plan = plan_training_memory(self.draft_cfg, self.cfg, self.dist.world, self.device.type,
                                                autocast=self.autocast is not None,
                                                batch_dtype_bytes=state_bytes, micro_rows=self.micro)
        if self.dist.main:
            for line in self.memory_plan.summary().splitlines():
                log.info("[train] %s", line)
        if self.device.type == "cpu" and self.dist.local_rank != 0:
            return
        free, measured = free_device_memory(self.device)
        warning = check_memory(self.memory_plan, free, measured, self.cfg.memory_margin_fraction,
                               self.cfg.on_insufficient_memory)
        if warning:
            log.warning("[train] %s (on_insufficient_memory: warn)", warning.splitlines()[0])

    def _device(self) -> torch.device:
        device = resolve_device(self.cfg.device, self.dist.local_rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return device

    def _check_inputs(self, spec: VerifierSpec) -> None:
        meta_file = self.store_dir / STORE_JSON
        if len(self.store) == 0:
            raise TrainError(f"store {self.store_dir} is empty: no finished samples in its manifest")
        if self.store.hidden_size != spec.hidden_size:
            raise TrainError(f"store {meta_file} has hidden_size {self.store.hidden_size} but the verifier "
                             f"{self.verifier_path / 'config.json'} has hidden_size {spec.hidden_size}")
        try:
            spec.resolve_aux_layer_ids(self.store.aux_layer_ids)
        except ValueError as e:
            raise TrainError(f"store {meta_file}: {e}") from None
        want = self.store.meta.get("verifier_fingerprint")
        have = verifier_fingerprint(self.verifier_path)
        if want != have:
            raise TrainError(f"store {meta_file} was extracted from another verifier (fingerprint {str(want)[:12]}) "
                             f"than {self.verifier_path} ({have[:12]}): the teacher would not match the states")

    def _wrap(self, module: nn.Module) -> nn.Module:
        import torch.distributed as dist

        # every launched worker wraps, a world of one too (tests/test_gpu_smoke.py runs DDP / FSDP that way on one GPU);
        # only a plain single process (no process group) trains the bare module
        if not (dist.is_available() and dist.is_initialized()):
            return module
        if self.cfg.parallel == "fsdp":
            from torch.distributed.fsdp import fully_shard

            # the root is the whole TTT module: its forward gathers fc / embedding / norm / lm_head shards, the
            # midlayer gathers its own (draft.step / project_aux are plain methods, not module calls)
            fully_shard(module.draft.midlayer)
            fully_shard(module)
            wrapped = module
        else:
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            wrapped = DistributedDataParallel(module, device_ids=ids,
                                              forward_sync_buffers=False)  # buffers are constants
        if self.dist.main:
            log.info("[train] draft wrapped in %s over %d process(es) (%s)", self.cfg.parallel.upper(),
                     self.dist.world, dist.get_backend())
        return wrapped

    # --- batches ----------------------------------------------------------------------------------------------

    def _steps(self):
        """(epoch, step) of every optimizer step left in the run, in order (the loader's sampler)."""
        for epoch in range(self.epoch, self.cfg.epochs):
            for step in range(self.step_in_epoch if epoch == self.epoch else 0, self.steps_per_epoch):
                yield epoch, step

    # --- train ------------------------------------------------------------------------------------------------

    def train(self) -> dict[str, Any]:
        cfg = self.cfg
        if self.epoch == 0 and self.step_in_epoch == 0 and self.global_step == 0 and cfg.eval_before_training \
                and not any(h.get("event") == "val" for h in self.history):
            self._validate(epoch=0)
        remaining = self.total_steps - self.global_step
        progress = Progress("train", remaining, unit="steps", every_n=0, every_s=0,  # a line at each log step
                            logger=log if self.dist.main else logging.getLogger("eagle3.rank"),
                            on_update=self.on_progress if self.dist.main else None)
        stopped = False
        plan = BatchPlan(self.train_bins, cfg.seed, cfg.batch_size, cfg.grad_accum_steps, self.dist.world,
                         self.dist.rank)
        self._loader = StepLoader(self.store, plan, self._steps(), cfg.max_seq_len, cfg.ttt_steps,
                                  self.draft_cfg.vocab_size, cfg.loader_workers, pin_memory=self.device.type == "cuda",
                                  dequant_dtype=self.dequant_dtype, dequantize=self.dequant_in_loader)
        batches_of = iter(self._loader)
        self._last_save = time.monotonic()
        while self.epoch < cfg.epochs and not stopped:
            if self.step_in_epoch == 0:  # a new epoch; a resumed one keeps its restored window
                self.window.zero_()
            for step in range(self.step_in_epoch, self.steps_per_epoch):
                batches = next(batches_of)
                if isinstance(batches, DamagedSample):  # quarantined by the loader: never trained on
                    raise TrainError(batches.message)
                stats, tokens = self._optimizer_step(batches)
                self.window += stats
                self.step_in_epoch, self.global_step = step + 1, self.global_step + 1
                self.tokens_seen += tokens
                # the log cadence follows the run's global step (not this invocation's count), so a resumed run
                # writes the same metrics.jsonl records as an uninterrupted one
                due = self.global_step % cfg.log_every_steps == 0 or self.global_step >= self.total_steps
                extra = self._log_train(self.window, progress, tokens) if due else ""
                if due:
                    self.window.zero_()
                progress.update(1, tokens=tokens, extra=extra, force=due)
                if cfg.stop_after_steps and self.global_step >= cfg.stop_after_steps:
                    stopped = True
                    break
                by_steps = bool(cfg.save_state_every_steps) and self.global_step % cfg.save_state_every_steps == 0
                by_time = self._save_due_by_time()  # every rank calls it: the decision is collective
                if (by_steps or by_time) and self.step_in_epoch < self.steps_per_epoch:
                    self._save_state()
            if stopped and self.step_in_epoch < self.steps_per_epoch:
                self._save_state()
                break
            self.epoch, self.step_in_epoch = self.epoch + 1, 0
            val = self._validate(self.epoch)
            self._save_epoch(self.epoch, val)
            self._save_state()
            if self.dist.main:
                self._plots()
            stopped = stopped or bool(cfg.stop_after_steps and self.global_step >= cfg.stop_after_steps)
        return self._result(stopped and self.epoch < cfg.epochs)

    def _save_due_by_time(self) -> bool:
        """True once ``save_state_every_minutes`` of training have passed since the last state save; rank 0's clock
        decides for every rank (the save gathers the state collectively)."""
        minutes = self.cfg.save_state_every_minutes
        if not minutes:
            return False
        due = time.monotonic() - self._last_save >= minutes * 60
        if self.dist.world > 1:
            flag = torch.tensor([float(due and self.dist.main)], device=self.device)
            due = bool(self.dist.all_reduce(flag).item())
        return due

    def _optimizer_step(self, batches: list[Batch]) -> tuple[torch.Tensor, int]:
        cfg = self.cfg
        # [K] entries counted per TTT step over the whole global batch (all micro-batches, all processes)
        counted = self.dist.all_reduce(sum(b.counted for b in batches).to(self.device, torch.float64))
        norm = (counted.clamp(min=1) / self.dist.world).float()
        lr = lr_at(self.global_step, self.total_steps, cfg.lr, round(cfg.warmup_ratio * self.total_steps), cfg.schedule,
                   cfg.min_lr_ratio)
        set_lr(self.optimizers, lr)
        stats = torch.zeros(cfg.ttt_steps, N_STATS, dtype=torch.float64, device=self.device)
        tokens = 0
        self.model.train()
        for m, batch in enumerate(batches):
            last = m == len(batches) - 1
            if hasattr(self.model, "set_requires_gradient_sync"):  # FSDP: reduce-scatter on the last micro-batch
                self.model.set_requires_gradient_sync(last)
            sync = self.model.no_sync() if (hasattr(self.model, "no_sync") and not last) \
                else contextlib.nullcontext()  # DDP: all-reduce on the last micro-batch only
            batch = batch.to(self.device)
            if cfg.feature_noise:  # training only: validation reads the stored states as they are
                batch.aux = noised_aux(batch.aux, cfg.feature_noise,
                                       noise_seed(cfg.seed, self.global_step, self.dist.rank, m))
            with sync:
                loss, s = self.model(batch, norm)
                loss.backward()
            stats += s
            tokens += batch.tokens
        torch.nn.utils.clip_grad_norm_([p for p in self.draft.parameters() if p.requires_grad], cfg.max_grad_norm)
        for opt in self.optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        self.dist.all_reduce(stats)
        tok = self.dist.all_reduce(torch.tensor([tokens], dtype=torch.float64, device=self.device))
        self.lr = lr
        return stats.cpu(), int(tok.item())

    def _log_train(self, window: torch.Tensor, progress: Progress, tokens: int) -> str:
        s = summarize(window, self.ttt.weights)
        if self.dist.main:
            elapsed = time.monotonic() - progress.start
            rec = {"event": "train", "epoch": self.epoch + 1, "step": self.step_in_epoch,
                   "global_step": self.global_step, "lr": self.lr, "tokens_seen": self.tokens_seen,
                   "tokens_per_s": (progress.tokens + tokens) / elapsed if elapsed > 0 else None, **s}
            self._append_metrics(rec)
        accs = " ".join(f"{a:.2f}" for a in s["acc_per_step"])
        losses = " ".join(f"{v:.3f}" for v in s["loss_per_step"])
        return (f"epoch {self.epoch + 1}/{self.cfg.epochs} step {self.step_in_epoch}/{self.steps_per_epoch} "
                f"(global {self.global_step}/{self.total_steps}) | loss {s['loss']:.4f} [{losses}] | acc [{accs}] | "
                f"sim accept {s['sim_accept_len']:.2f} | lr {self.lr:.2e}")

    @torch.no_grad()
    def _validate(self, epoch: int) -> dict[str, Any]:
        cfg, d = self.cfg, self.dist
        stats = torch.zeros(cfg.ttt_steps, N_STATS, dtype=torch.float64, device=self.device)
        self.model.eval()
        one = torch.ones(cfg.ttt_steps, device=self.device)
        # every process runs the same number of forwards (FSDP gathers weights collectively); a process without
        # bins left repeats the first bin and drops its stats
        per_round = d.world * self.micro
        for j in range(math.ceil(len(self.val_bins) / per_round)):
            bins = self.val_bins[j * per_round + d.rank * self.micro:j * per_round + (d.rank + 1) * self.micro]
            if (bad := verify_bins(self.store, bins or self.val_bins[:1])) is not None:
                raise TrainError(bad.message)
            batch = collate(self.store, bins or self.val_bins[:1], cfg.max_seq_len, cfg.ttt_steps,
                            self.draft_cfg.vocab_size, self.dequant_dtype, self.dequant_in_loader)
            _, s = self.ttt(batch.to(self.device), one)
            if bins:
                stats += s
        d.all_reduce(stats)
        s = summarize(stats.cpu(), self.ttt.weights)
        rec = {"event": "val", "epoch": epoch, "global_step": self.global_step, "samples": sum(map(len, self.val_bins)),
               **s}
        if d.main:
            self._append_metrics(rec)
            if self.val_bins:
                log.info("[train] validation after epoch %d: loss %.4f | acc [%s] | cond acc [%s] | sim accept %.3f | "
                         "chain accept %.3f", epoch, s["loss"], " ".join(f"{a:.3f}" for a in s["acc_per_step"]),
                         " ".join(f"{a:.3f}" for a in s["cond_acc_per_step"]), s["sim_accept_len"],
                         s["chain_accept_len"])
        return rec

    # --- checkpoints ------------------------------------------------------------------------------------------

    def _full_draft_state(self) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.draft, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def _optim_state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(self.draft, self.optimizers,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def _run_info(self, epoch: int, val: dict[str, Any] | None) -> dict[str, Any]:
        return {"run_config": self.cfg.model_dump(mode="json"), "draft_config": self.draft_cfg.model_dump(mode="json"),
                "verifier": str(self.verifier_path.resolve()), "store": str(self.store_dir.resolve()),
                "vocab": str(self.vocab_path.resolve()), "epoch": epoch, "global_step": self.global_step,
                "tokens_seen": self.tokens_seen, "val_metrics": val, "aux_layer_ids_convention":
                "vLLM: id k = residual stream entering decoder layer k"}

    def _save_epoch(self, epoch: int, val: dict[str, Any]) -> None:
        state = self._full_draft_state()
        if self.dist.main:
            folder = self.ckpt_dir / ckpt.epoch_dir_name(epoch)
            ckpt.save_draft(folder, self.draft_cfg, state, self._run_info(epoch, val), self.cfg.save_embedding)
            score = val["sim_accept_len"] if self.val_bins else float(epoch)  # no val split: the newest is best
            if score > self.best["sim_accept_len"]:
                # the weights' hash as written: _result refuses a best checkpoint that no longer matches it
                self.best = {"epoch": epoch, "sim_accept_len": score,
                             "weights_sha256": sha256_file(folder / ckpt.WEIGHTS)}
                ckpt.set_best(self.ckpt_dir, folder)
            ckpt.prune_epochs(self.ckpt_dir, self.cfg.keep_last_n)
            log.info("[train] saved %s (best: epoch %s, sim accept %.3f)", folder, self.best["epoch"],
                     self.best["sim_accept_len"])
        self.dist.barrier()

    def _save_state(self) -> None:
        t0 = time.monotonic()
        full = self._full_draft_state()
        optim = self._optim_state()
        if self.dist.main:
            trainable = {n for n, p in self.draft.named_parameters() if p.requires_grad}
            state = {
                "model": {k: v for k, v in full.items() if k in trainable},
                "optimizer": optim,
                "progress": {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch,
                             "global_step": self.global_step, "tokens_seen": self.tokens_seen},
                "best": self.best,
                "metrics_window": self.window,
                "config": self.cfg.model_dump(mode="json"),
                "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
            }
            ckpt.save_trainer_state(self.latest_dir, state)
            size = (self.latest_dir / ckpt.STATE_TENSORS).stat().st_size
            log.info("[train] resume state saved at global step %d in %.2f s (%.1f MB, %s)", self.global_step,
                     time.monotonic() - t0, size / 1e6, self.latest_dir)
        self.dist.barrier()
        self._last_save = time.monotonic()

    def _load_state(self) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        state = ckpt.load_trainer_state(self.latest_dir)
        old = state["config"]
        now = self.cfg.model_dump(mode="json")
        try:  # what changes the run: the output settings (runtime and resumable ones may change on resume)
            old_view = output_view(TrainConfig.model_validate(old), keep_resumable=False)
        except ValueError as e:
            raise TrainError(f"cannot resume from {self.latest_dir}: its saved settings do not load ({e})") from None
        new_view = output_view(self.cfg, keep_resumable=False)
        diff = sorted(k for k in new_view if k != "epochs" and old_view.get(k) != new_view[k])
        if diff:
            raise TrainError(f"cannot resume from {self.latest_dir}: settings {diff} differ from the saved run; "
                             f"use another out_dir or resume=False")
        if old.get("epochs") != now["epochs"] and state["progress"]["global_step"] > 0:
            raise TrainError(f"cannot resume from {self.latest_dir}: epochs changed {old.get('epochs')} -> "
                             f"{now['epochs']}, which changes the learning-rate schedule")
        set_model_state_dict(self.draft, state["model"], options=StateDictOptions(full_state_dict=True, strict=False))
        set_optimizer_state_dict(self.draft, self.optimizers, state["optimizer"],
                                 options=StateDictOptions(full_state_dict=True))
        p = state["progress"]
        self.epoch, self.step_in_epoch = int(p["epoch"]), int(p["step_in_epoch"])
        self.global_step, self.tokens_seen = int(p["global_step"]), int(p["tokens_seen"])
        self.best = dict(state["best"])
        if "metrics_window" in state:
            self.window = state["metrics_window"].to(torch.float64).clone()
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        self.history = read_metrics(self.metrics_path)
        # drop metrics logged after the saved state (a crash between the two): the resumed run logs them again
        keep = [r for r in self.history if r.get("global_step", 0) < self.global_step
                or (r.get("global_step") == self.global_step and (r["event"] != "val" or r["epoch"] <= self.epoch))]
        self.history = keep
        if self.dist.main:
            atomic_write_text(self.metrics_path, "".join(json.dumps(r) + "\n" for r in keep))
            log.info("[train] resumed from %s: epoch %d, step %d/%d of the epoch, global step %d", self.latest_dir,
                     self.epoch, self.step_in_epoch, self.steps_per_epoch, self.global_step)

    def _append_metrics(self, rec: dict[str, Any]) -> None:
        self.history.append(rec)
        append_metrics(self.metrics_path, rec)

    def _plots(self) -> None:
        write_plots(self.out_dir, self.history, self.cfg.ttt_steps)

    def _result(self, stopped_early: bool) -> dict[str, Any]:
        """The run's outcome, keyed exactly as eagle3.train.stage.DraftCheckpoint's fields (no renaming)."""
        best = ckpt.best_dir(self.ckpt_dir)
        vals = [r for r in self.history if r["event"] == "val"]
        # rank 0 wrote the checkpoint and holds its recorded hash (the other ranks' `best` is the resume state's)
        weights_sha = None
        if self.dist.main and best:
            weights_sha, problem = ckpt.check_weights(best, self.best.get("weights_sha256"))
            if problem:
                raise TrainError(f"{problem}; or train again from scratch (delete {self.out_dir}, or resume=False)")
        return {
            "out_dir": str(self.out_dir), "checkpoint_dir": str(best) if best else None,
            "weights_sha256": weights_sha,
            "weights_bytes": (best / ckpt.WEIGHTS).stat().st_size if weights_sha else None,
            "config_sha256": sha256_file(best / ckpt.CONFIG) if best else None,
            "aux_layer_ids": list(self.draft_cfg.aux_layer_ids), "draft_vocab_size": self.draft_cfg.draft_vocab_size,
            "best_epoch": self.best["epoch"] if best else None,
            "best_sim_accept_len": self.best["sim_accept_len"] if best else None,
            "epoch_checkpoints": [str(p) for p in ckpt.list_epoch_dirs(self.ckpt_dir)],
            "latest_state": str(self.latest_dir), "metrics_path": str(self.metrics_path),
            "plots": [str(p) for p in sorted(self.out_dir.glob("*.png"))],
            "final_val": vals[-1] if vals else None, "untrained_val": next((r for r in vals if r["epoch"] == 0), None),
            "epochs_done": self.epoch, "global_step": self.global_step, "total_steps": self.total_steps,
            "tokens_seen": self.tokens_seen, "packing_efficiency": self.packing,
            "train_rows": len(self.train_bins), "val_rows": len(self.val_bins), "truncated_samples": self.truncated,
            "stopped_early": stopped_early, "nproc": self.dist.world,
        }

    def cleanup(self) -> None:
        if self._loader is not None:
            self._loader.close()
            self._loader = None


def run_local(cfg: TrainConfig, store_dir: str | Path, vocab_path: str | Path, verifier_path: str | Path,
              out_dir: str | Path, resume: bool = True, dist: Dist | None = None,
              on_progress: Callable[[int, int, str], None] | None = None) -> dict[str, Any]:
    """Run the trainer in this process (one rank of a multi-process job when ``dist`` says so); returns the
    trainer's outcome (``Trainer._result``) with ``wall_s``."""
    torch.manual_seed(cfg.seed)
    trainer = Trainer(cfg, store_dir, vocab_path, verifier_path, out_dir, resume=resume, dist=dist,
                      on_progress=on_progress)
    try:
        trainer.setup()
        start = time.monotonic()
        result = trainer.train()
        result["wall_s"] = round(time.monotonic() - start, 3)
        if trainer.dist.main:
            log.info("[train] done in %s: best %s (sim accept %s)", fmt_duration(result["wall_s"]),
                     result["checkpoint_dir"], result["best_sim_accept_len"])
        return result
    finally:
        trainer.cleanup()
