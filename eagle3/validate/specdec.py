"""Offline reference for the vLLM check: greedy chain speculative decoding with a transformers verifier + our draft.

Pipeline position: train -> checkpoint -> validate (**this module**, beside the vLLM run of eagle3.validate.vllm_check).

It computes the figures vLLM reports (mean acceptance length, per-position acceptance; see
``eagle3.validate.vllm_check.AcceptanceStats``) on the same prompt token ids, without vLLM. When the two agree, training and
serving compute the same draft: same aux layers (vLLM convention, id k = HF ``hidden_states[k]``), same pairing of
tokens, hidden states and positions, same pre-norm hidden fed forward.

One round, mirroring vLLM 0.32 ``SpecDecodeBaseProposer.propose`` + greedy rejection sampling. The verifier has
read x_0 .. x_{n-1} (its aux states a_0 .. a_{n-1}, a_i computed from x_0 .. x_i) and produced x_n::

    draft entries (one causal pass, see eagle3.draft.model):
        position : 0        1        ..  n-1           n        ..  n-2+K
        token    : x_1      x_2      ..  x_n           d_1      ..  d_{K-1}
        hidden   : fc(a_0)  fc(a_1)  ..  fc(a_{n-1})   g_0      ..  g_{K-2}
        the output at position n-1+k gives d_{k+1} (argmax over the draft vocab, mapped with d2t) and its
        PRE-norm output g_k
    verifier pass over x_0 .. x_n, d_1 .. d_K:  t_j = argmax of its logits at position n+j  (j = 0 .. K)
    accept d_1 .. d_a while d_j == t_{j-1}; the round emits d_1 .. d_a and the verifier's token t_a

The same verifier pass also gives the aux states of every emitted token for the next round, so a round costs one
verifier forward and K draft forwards (no KV cache: both recompute the whole sequence; exact, and cheap at the
sizes this runs on). As in vLLM's scheduler, a round's accepted drafts are all counted even when the request then
stops early (a stop token or max_new_tokens inside the round).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3.draft.checkpoint import load_draft
from eagle3.draft.model import Eagle3Draft
from eagle3.support.verifier import VerifierSpec
from eagle3.validate.vllm_check import AcceptanceStats, load_tokenizer, stop_token_ids

log = logging.getLogger("eagle3")


def load_verifier(path: str | os.PathLike, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False):
    """The verifier as a transformers causal LM in eval mode, through extraction's loader (flat checkpoints, and
    Kimi-K2.5's nested layout: text_config, ``language_model.`` weights, per-expert tensors)."""
    from eagle3.extract.hf_backend import load_hf_model

    return load_hf_model(VerifierSpec.from_path(path), dtype, "cpu", trust_remote_code=trust_remote_code)


@torch.no_grad()
def verifier_pass(verifier, ids: list[int], aux_layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (greedy next-token ids [T], aux states [T, n_aux * H]) for the token ids ``ids`` [T].

    aux_layer_ids in vLLM's convention: id k = residual stream entering layer k = HF hidden_states[k]; concatenated
    in ascending layer order, as vLLM collects them.
    """
    out = verifier(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    hs = out.hidden_states  # L + 1 tensors of [1, T, H]; index 0 = embedding output
    aux = torch.cat([hs[k][0] for k in sorted(aux_layer_ids)], dim=-1)  # [T, n_aux * H]
    return out.logits[0].argmax(-1), aux.float()


@torch.no_grad()
def propose(draft: Eagle3Draft, context_ids: list[int], context_aux: torch.Tensor, k: int) -> list[int]:
    """K greedy draft tokens (target-vocab ids) after ``context_ids`` = x_0 .. x_n.

    context_aux: [n, n_aux * H] verifier aux states of x_0 .. x_{n-1}.
    """
    n = len(context_ids) - 1
    assert context_aux.shape[0] == n, (context_aux.shape, n)
    tokens = torch.tensor(context_ids[1:])  # [n]: x_1 .. x_n (shifted left by one)
    hidden = draft.project_aux(context_aux)  # [n, H]: fc(a_0) .. fc(a_{n-1})
    drafts: list[int] = []
    for step in range(k):
        t = tokens.shape[0]
        fed, logits = draft(tokens[None], hidden[None], torch.arange(t)[None])  # [1, t, H], [1, t, D]
        d = int(draft.draft_to_target(logits[0, -1].argmax()))
        drafts.append(d)
        if step + 1 < k:  # the next entry: token d at the next position, hidden = this step's output fed forward
            tokens = torch.cat([tokens, torch.tensor([d])])  # (pre-norm, or normed with norm_output)
            hidden = torch.cat([hidden, fed[0, -1:]], dim=0)  # [t + 1, H]
    return drafts


@torch.no_grad()
def speculative_generate(verifier, draft: Eagle3Draft, prompt: list[int], num_speculative_tokens: int,
                         max_new_tokens: int, stop_ids: set[int] | list[int],
                         stats: AcceptanceStats | None = None) -> tuple[list[int], AcceptanceStats]:
    """Greedy chain speculative decoding of one prompt (token ids). Returns (generated ids, counters).

    The generated ids equal plain greedy decoding of the verifier (the loop is lossless by construction).
    """
    k = num_speculative_tokens
    stats = stats or AcceptanceStats(k)
    stop_ids = set(stop_ids)
    aux_ids = list(draft.config.aux_layer_ids)
    greedy, aux = verifier_pass(verifier, prompt, aux_ids)
    seq = list(prompt) + [int(greedy[-1])]  # x_0 .. x_n
    out = seq[len(prompt):]
    while len(out) < max_new_tokens and out[-1] not in stop_ids:
        n = len(seq) - 1
        drafts = propose(draft, seq, aux[:n], k)
        greedy, aux = verifier_pass(verifier, seq + drafts, aux_ids)
        targets = greedy[n:].tolist()  # [K + 1]: t_0 .. t_K
        accepted = 0
        while accepted < k and drafts[accepted] == targets[accepted]:
            accepted += 1
        stats.observe(k, accepted)
        new = drafts[:accepted] + [targets[accepted]]
        seq += new
        out += new
        if stop_ids.intersection(new):  # a stop token anywhere in the round ends the request (vLLM's stop check)
            break
    for i, tok in enumerate(out):  # cut after the first stop token, then at the budget (vLLM's output rules)
        if tok in stop_ids:
            out = out[: i + 1]
            break
    return out[:max_new_tokens], stats


@dataclass
class OfflineResult:
    acceptance: AcceptanceStats
    token_ids: list[list[int]]  # generated ids per prompt
    seconds: float


def offline_acceptance(verifier_path: str | os.PathLike, draft_dir: str | os.PathLike, prompts: list[list[int]],
                       num_speculative_tokens: int, max_new_tokens: int, trust_remote_code: bool = False,
                       threads: int | None = 1) -> OfflineResult:
    """The vLLM check's figures computed offline, on the same prompts (the token ids vLLM reads: rendered once by
    the validation stage's chat encoder, eagle3.validate.stage.prompt_ids).

    ``threads``: torch CPU threads while it runs (restored after). One thread is the fastest for the tiny models
    this runs on (measured 4 ms vs 34 ms per verifier pass with 2 threads on 2 busy cores); None = leave as is.
    """
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _offline_acceptance(verifier_path, draft_dir, prompts, num_speculative_tokens, max_new_tokens,
                                   trust_remote_code)
    finally:
        torch.set_num_threads(previous)


def _offline_acceptance(verifier_path, draft_dir, prompts: list[list[int]], num_speculative_tokens: int,
                        max_new_tokens: int, trust_remote_code: bool) -> OfflineResult:
    t0 = time.monotonic()
    tokenizer = load_tokenizer(verifier_path, trust_remote_code)  # the stop ids
    stops = set(stop_token_ids(verifier_path, tokenizer))
    verifier = load_verifier(verifier_path, trust_remote_code=trust_remote_code)
    draft = load_draft(Path(draft_dir), verifier_path=verifier_path).eval()
    stats = AcceptanceStats(num_speculative_tokens)
    outputs = []
    for prompt in prompts:
        ids, _ = speculative_generate(verifier, draft, prompt, num_speculative_tokens, max_new_tokens, stops, stats)
        outputs.append(ids)
    seconds = time.monotonic() - t0
    log.info("[validate] offline reference: mean acceptance length %.3f, per position %s, %d drafts, %.1f s",
             stats.mean_acceptance_length, [round(r, 3) for r in stats.per_position_acceptance], stats.num_drafts,
             seconds)
    return OfflineResult(stats, outputs, seconds)
