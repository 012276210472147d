"""The offline reference (eagle3.validate.specdec) and the helpers it shares with the vLLM check (eagle3.validate.vllm_check):
prompts from chat files, chat-templated token ids, acceptance counters, and the greedy chain loop, whose output
must equal plain greedy decoding and whose counters must match an independent simulation."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers import vocab_tables

from eagle3.chat.encoder import ChatSettings
from eagle3.chat.sources import PromptError, read_prompt_messages
from eagle3.draft.config import DraftConfig
from eagle3.draft.model import Eagle3Draft
from eagle3.support.verifier import VerifierSpec
from eagle3.validate.specdec import load_verifier, speculative_generate, verifier_pass
from eagle3.validate.vllm_check import AcceptanceStats, first_difference, load_tokenizer, stop_token_ids

REPO = Path(__file__).resolve().parent.parent
EVAL = REPO / "data" / "stdlib-chat" / "eval.openai.jsonl"
TOKENIZER = REPO / "models" / "tiny-chat-verifier"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_prompts_are_first_user_turns_with_their_system_message(tmp_path):
    f = _jsonl(tmp_path / "c.jsonl", [
        {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"},
                      {"role": "assistant", "content": "A1"}, {"role": "user", "content": "U2"}]},
        {"conversations": [{"from": "human", "value": "H"}, {"from": "gpt", "value": "G"}]},
        {"messages": [{"role": "user", "content": "last"}]},
    ])
    assert read_prompt_messages(f, 2) == [
        [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"}],
        [{"role": "user", "content": "H"}],
    ]


def test_prompt_file_errors_name_the_problem(tmp_path):
    with pytest.raises(PromptError, match="not found"):
        read_prompt_messages(tmp_path / "missing.jsonl", 1)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "x"}]}) + "\n{oops\n")
    with pytest.raises(PromptError, match=r"bad.jsonl:2: not valid JSON"):
        read_prompt_messages(bad, 2)
    with pytest.raises(PromptError, match="holds 1 conversations, 5 prompts"):
        read_prompt_messages(_jsonl(tmp_path / "short.jsonl", [{"messages": [{"role": "user", "content": "x"}]}]), 5)
    with pytest.raises(PromptError, match=r":1: no user turn"):
        read_prompt_messages(_jsonl(tmp_path / "a.jsonl", [{"messages": [{"role": "assistant", "content": "x"}]}]), 1)
    with pytest.raises(PromptError, match="neither 'messages'"):
        read_prompt_messages(_jsonl(tmp_path / "n.jsonl", [{"text": "x"}]), 1)


def test_prompt_ids_are_the_chat_template_with_generation_prompt():
    tok = load_tokenizer(TOKENIZER)
    msgs = read_prompt_messages(EVAL, 3)
    ids = ChatSettings(tokenizer_path=str(TOKENIZER)).encoder().prompt_ids(msgs)
    assert len(ids) == 3
    for m, i in zip(msgs, ids):
        text = tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
        assert tok.decode(i) == text
        assert text.endswith("<|assistant|>\n") and m[-1]["content"] in text


def test_stop_ids_include_generation_config_and_tokenizer_eos(tmp_path):
    tok = load_tokenizer(TOKENIZER)
    folder = tmp_path / "v"
    folder.mkdir()
    assert stop_token_ids(folder, tok) == [tok.eos_token_id]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, tok.eos_token_id]}))
    assert stop_token_ids(folder, tok) == sorted({1, tok.eos_token_id})


def test_acceptance_stats_match_vllm_definitions():
    s = AcceptanceStats(3)
    for accepted in (3, 0, 1, 2):
        s.observe(3, accepted)
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (4, 12, 6)
    assert s.accepted_per_pos == [3, 2, 1]
    assert s.mean_acceptance_length == 1 + 6 / 4
    assert s.per_position_acceptance == [0.75, 0.5, 0.25]
    assert s.draft_acceptance_rate == 0.5
    assert AcceptanceStats.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    assert math.isnan(AcceptanceStats(2).mean_acceptance_length)


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_aux_states_follow_vllm_convention(tiny_llama_verifier):
    """id k = residual stream entering layer k = HF hidden_states[k]: id 0 is the embedding output."""
    verifier = load_verifier(tiny_llama_verifier)
    ids = [5, 17, 300, 2]
    greedy, aux = verifier_pass(verifier, ids, [0, 2])  # [T], [T, 2 * H]
    h = verifier.config.hidden_size
    assert aux.shape == (4, 2 * h)
    torch.testing.assert_close(aux[:, :h], verifier.model.embed_tokens(torch.tensor(ids)))
    out = verifier(input_ids=torch.tensor([ids]), output_hidden_states=True)
    torch.testing.assert_close(aux[:, h:], out.hidden_states[2][0])
    assert greedy.tolist() == out.logits[0].argmax(-1).tolist()


def _greedy(verifier, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(verifier(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def _constant_draft(verifier_path: Path, token: int, draft_vocab: int = 64) -> Eagle3Draft:
    """A real draft whose logits are all zero (final norm weight 0), so it always proposes draft id 0, which d2t
    maps onto ``token``: the smallest id of its vocabulary."""
    spec = VerifierSpec.from_path(verifier_path)
    cfg = DraftConfig.build(spec, draft_vocab, [1, 2, 3], torch_dtype="float32")
    d2t, t2d = vocab_tables(spec.vocab_size, draft_vocab, kept=torch.arange(token, token + draft_vocab))  # kept[0]=token
    draft = Eagle3Draft.from_verifier(cfg, verifier_path, d2t, t2d).eval()
    with torch.no_grad():
        draft.norm.weight.zero_()
    return draft


def _simulate(greedy: list[int], token: int, k: int, max_new: int, stops: set[int]) -> AcceptanceStats:
    """Independent bookkeeping: a draft that always guesses ``token`` against the known greedy continuation.
    A request ends when a stop token is emitted anywhere in a round, or at max_new tokens."""
    stats = AcceptanceStats(k)
    m = 0  # index of the newest generated token
    while m + 1 < max_new and greedy[m] not in stops:
        a = 0
        while a < k and greedy[m + 1 + a] == token:
            a += 1
        stats.observe(k, a)
        emitted = greedy[m + 1 : m + a + 2]
        m += a + 1
        if stops.intersection(emitted):
            break
    return stats


@pytest.mark.parametrize("k", [1, 3])
def test_chain_loop_is_lossless_and_counts_like_vllm(tiny_llama_verifier, k):
    verifier = load_verifier(tiny_llama_verifier)
    prompt = [0, 7, 99, 1234, 42]
    max_new = 24
    greedy = _greedy(verifier, prompt, max_new + k + 1)
    token = Counter(greedy[:max_new]).most_common(1)[0][0]  # the token a constant guess hits most often
    draft = _constant_draft(tiny_llama_verifier, token)
    out, stats = speculative_generate(verifier, draft, prompt, k, max_new, stop_ids=set())
    assert out == greedy[:max_new]
    assert stats == _simulate(greedy, token, k, max_new, set())
    assert stats.num_accepted_tokens > 0  # the check is not vacuous: some guesses were accepted


@pytest.mark.parametrize("where", ["verifier-token", "accepted-draft"])
def test_chain_loop_stops_at_a_stop_token(tiny_llama_verifier, where):
    """The stop token ends the request wherever it lands in a round, also as an ACCEPTED draft token followed by
    more tokens of the same round (those still count as accepted, as in vLLM's scheduler)."""
    verifier = load_verifier(tiny_llama_verifier)
    prompt = [0, 7, 99, 1234, 42]
    greedy = _greedy(verifier, prompt, 40)
    token = Counter(greedy[:20]).most_common(1)[0][0]
    stop = greedy[5] if where == "verifier-token" else token
    cut = greedy.index(stop) + 1
    draft = _constant_draft(tiny_llama_verifier, token)
    out, stats = speculative_generate(verifier, draft, prompt, 3, 30, stop_ids={stop})
    assert out == greedy[:cut]
    assert stats == _simulate(greedy, token, 3, 30, {stop})
    if where == "accepted-draft":
        assert stats.num_accepted_tokens > 0
