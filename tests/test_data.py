"""Data stage: chat rendering with real templates, the assistant loss mask, sources, bad rows, the task manifest.

Real tokenizers only: the bundled verifier's (``{% generation %}`` template), and two fixtures under tests/data/
(tests/data/make_tokenizers.py): a ChatML template with generation blocks and a default system prompt, and
Llama-3's header template (no generation block, ``| trim``s contents).
"""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError
from transformers import AutoTokenizer

from eagle3.chat.encoder import ChatEncoder
from eagle3.chat.errors import DataError
from eagle3.prepare import PrepareConfig, prepare_data
from eagle3.support.io import fingerprint_paths

REPO = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"
BUNDLED_TOKENIZER = REPO / "models" / "tiny-chat-verifier"
BUNDLED_TRAIN = REPO / "data" / "stdlib-chat" / "train"

# tokenizer folder, its end-of-turn token, whether its template trims contents
TOKENIZERS = {
    "bundled": (BUNDLED_TOKENIZER, "<|end|>", False),
    "chatml-generation": (DATA / "tok-chatml-generation", "<|im_end|>", False),
    "llama3": (DATA / "tok-llama3", "<|eot_id|>", True),
}

CONVERSATIONS = [
    [{"role": "user", "content": "What does os.path.join do?"},
     {"role": "assistant", "content": "Join two or more pathname components, inserting '/' as needed."}],
    [{"role": "system", "content": "You are a concise assistant for Python developers."},
     {"role": "user", "content": "Explain heapq.heappush."},
     {"role": "assistant", "content": "Push item onto heap, maintaining the heap invariant."},
     {"role": "user", "content": "And heappop?"},
     {"role": "assistant", "content": "Pop the smallest item off the heap, maintaining the heap invariant."},
     {"role": "user", "content": "Thanks. Anything else?"},
     {"role": "assistant", "content": "heapq.merge merges sorted inputs into one sorted iterator."}],
    # a reply that starts with a newline (it merges with the "\n" after the role header when tokenised whole),
    # surrounding spaces (Llama-3 trims them), and multi-byte characters that byte-level BPE splits inside a char
    [{"role": "user", "content": "Show me a snippet, s'il vous plaît."},
     {"role": "assistant", "content": "\n    print('héllo wörld ✓ 日本語 🐍')\n  "}],
    [{"role": "system", "content": "Answer with the official documentation."},
     {"role": "user", "content": "What is functools.cache?"},
     {"role": "assistant", "content": "Simple lightweight unbounded cache.  Sometimes called \"memoize\"."},
     {"role": "user", "content": "One more question with no answer yet."}],
]


def to_sharegpt(messages: list[dict]) -> dict:
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    return {"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in messages]}


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def load(result) -> datasets.Dataset:
    return datasets.load_from_disk(result.dataset_path)


def mask_runs(ids: list[int], mask: list[int]) -> list[list[int]]:
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    return runs + ([cur] if cur else [])


def decode(tok, ids) -> str:
    return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


# ---------------------------------------------------------------------------------------------------- the mask


@pytest.mark.parametrize("name,mask_method", [
    ("bundled", "auto"), ("bundled", "prefix"),
    ("chatml-generation", "auto"), ("chatml-generation", "prefix"),
    ("llama3", "auto"),
])
def test_masked_tokens_decode_to_exactly_the_assistant_texts(tmp_path, name, mask_method):
    path, eot, trims = TOKENIZERS[name]
    src = write_jsonl(tmp_path / "chats.jsonl", [{"messages": m} for m in CONVERSATIONS])
    result = prepare_data({"sources": [str(src)], "tokenizer_path": str(path), "mask_method": mask_method},
                             tmp_path / "out")
    assert result.stats["mask_method"] == ("generation" if name != "llama3" and mask_method == "auto" else "prefix")
    tok = AutoTokenizer.from_pretrained(path)
    ds = load(result)
    assert len(ds) == len(CONVERSATIONS)
    for sample, messages in zip(ds, CONVERSATIONS):
        ids, mask = sample["input_ids"], sample["loss_mask"]
        assert len(ids) == len(mask) and set(mask) <= {0, 1}
        # every assistant turn is one run of 1s: its text (trimmed where the template trims) + end-of-turn token
        expected = [(m["content"].strip() if trims else m["content"]) + eot
                    for m in messages if m["role"] == "assistant"]
        assert [decode(tok, run) for run in mask_runs(ids, mask)] == expected
        # and the tokens are the verifier's rendering of the whole conversation, nothing added or lost
        assert decode(tok, ids) == tok.apply_chat_template(messages, tokenize=False)


def test_generation_blocks_and_prefix_rendering_agree(tmp_path):
    src = write_jsonl(tmp_path / "chats.jsonl", [{"messages": m} for m in CONVERSATIONS])
    for name in ("bundled", "chatml-generation"):
        out = {}
        for method in ("generation", "prefix"):
            cfg = {"sources": [str(src)], "tokenizer_path": str(TOKENIZERS[name][0]), "mask_method": method}
            out[method] = load(prepare_data(cfg, tmp_path / f"{name}-{method}")).to_dict()
        assert out["generation"] == out["prefix"], name


def test_generation_method_refused_for_a_template_without_generation_blocks(tmp_path):
    src = write_jsonl(tmp_path / "chats.jsonl", [{"messages": CONVERSATIONS[0]}])
    with pytest.raises(DataError, match="generation"):
        prepare_data({"sources": [str(src)], "tokenizer_path": str(DATA / "tok-llama3"),
                         "mask_method": "generation"}, tmp_path / "out")


def test_bundled_data_sharegpt_and_openai_identical_and_equal_to_apply_chat_template(tmp_path):
    results = {}
    for fmt in ("sharegpt", "openai"):
        cfg = {"sources": [f"{BUNDLED_TRAIN}.{fmt}.jsonl"], "tokenizer_path": str(BUNDLED_TOKENIZER),
               "format": fmt, "max_samples": 300}
        results[fmt] = prepare_data(cfg, tmp_path / fmt)
    a, b = load(results["sharegpt"]), load(results["openai"])
    assert a.to_dict() == b.to_dict()
    assert results["sharegpt"].stats["skipped"] == {}
    assert results["sharegpt"].stats["samples_read"] == 300
    tok = AutoTokenizer.from_pretrained(BUNDLED_TOKENIZER)
    rows = [json.loads(line) for line in Path(f"{BUNDLED_TRAIN}.openai.jsonl").read_text().splitlines()[:300]]
    assert any(sum(m["role"] == "assistant" for m in r["messages"]) > 1 for r in rows)  # multi-turn is covered
    assert any(r["messages"][0]["role"] == "system" for r in rows)  # system prompts are covered
    # cutting at the mask boundaries changes no token on this template: same ids as HF's own tokenised rendering
    for sample, row in zip(b, rows):
        expected = tok.apply_chat_template(row["messages"], tokenize=True, return_dict=True,
                                           return_assistant_tokens_mask=True)
        assert sample["input_ids"] == expected["input_ids"]
        assert sample["loss_mask"] == expected["assistant_masks"]


def test_sharegpt_aliases_and_top_level_system(tmp_path):
    messages = CONVERSATIONS[1]
    sharegpt = to_sharegpt(messages[1:])
    sharegpt["system"] = messages[0]["content"]
    aliased = {"conversations": [{"from": {"system": "system", "user": "user", "assistant": "assistant"}[m["role"]],
                                  "value": m["content"]} for m in messages]}
    src = write_jsonl(tmp_path / "mixed.jsonl", [{"messages": messages}, sharegpt, aliased])
    ds = load(prepare_data({"sources": [str(src)], "tokenizer_path": str(BUNDLED_TOKENIZER)}, tmp_path / "out"))
    assert ds[0]["input_ids"] == ds[1]["input_ids"] == ds[2]["input_ids"]
    assert ds[0]["loss_mask"] == ds[1]["loss_mask"] == ds[2]["loss_mask"]
    assert ds["source_index"] == [0, 1, 2]


# ---------------------------------------------------------------------------------------------------- sources


def test_every_source_kind_gives_the_same_samples(tmp_path, monkeypatch):
    import fsspec

    rows = [{"messages": m} for m in CONVERSATIONS]
    base = tmp_path / "base.jsonl"
    write_jsonl(base, rows)
    (tmp_path / "list.json").write_text(json.dumps(rows), encoding="utf-8")
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
    folder = tmp_path / "folder"
    (folder / "sub").mkdir(parents=True)
    write_jsonl(folder / "a.jsonl", rows[:2])
    pq.write_table(pa.Table.from_pylist(rows[2:]), folder / "sub" / "b.parquet")
    (folder / "notes.txt").write_text("not data")  # ignored: not a data file
    (folder / ".hidden.jsonl").write_text("garbage\n")  # ignored: hidden
    with fsspec.open("memory://eagle3-test/chats.jsonl", "wb") as f:
        f.write(base.read_bytes())
    hf_folder = tmp_path / "hf-dataset"
    hf_folder.mkdir()
    write_jsonl(hf_folder / "train.jsonl", rows)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))

    sources = {
        "jsonl": str(base),
        "json": str(tmp_path / "list.json"),
        "parquet": str(tmp_path / "rows.parquet"),
        "folder": str(folder),
        "memory": "memory://eagle3-test/chats.jsonl",
        "file-url": f"file://{base}",
        "hf-local": f"hf:{hf_folder}:train",
    }
    outs = {}
    for kind, source in sources.items():
        result = prepare_data({"sources": [source], "tokenizer_path": str(DATA / "tok-chatml-generation")},
                                 tmp_path / f"out-{kind}")
        outs[kind] = load(result).to_dict()
        assert result.stats["samples_read"] == len(rows), kind
    for kind, out in outs.items():
        assert out == outs["jsonl"], kind
    folder_stats = json.loads((tmp_path / "out-folder" / "stats.json").read_text())
    assert [(p["file"].rsplit("/", 2)[-2:], p["first_index"], p["rows"]) for p in folder_stats["sources"]] == [
        (["folder", "a.jsonl"], 0, 2), (["sub", "b.parquet"], 2, 2)]

    # several sources: read in order, indices continue across them
    two = prepare_data({"sources": [str(base), "memory://eagle3-test/chats.jsonl"],
                           "tokenizer_path": str(DATA / "tok-chatml-generation")}, tmp_path / "out-two")
    assert load(two)["source_index"] == list(range(2 * len(rows)))


@pytest.mark.parametrize("source", ["{tmp}/missing.jsonl", "memory://eagle3-test/missing.jsonl", "{tmp}/empty-dir"])
def test_missing_source_is_one_error_naming_it(tmp_path, source):
    (tmp_path / "empty-dir").mkdir()
    source = source.format(tmp=tmp_path)
    good = write_jsonl(tmp_path / "good.jsonl", [{"messages": CONVERSATIONS[0]}])
    with pytest.raises(DataError, match=source.replace("/", ".")):
        prepare_data({"sources": [str(good), source], "tokenizer_path": str(BUNDLED_TOKENIZER)}, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_max_samples_and_seeded_shuffle_are_deterministic(tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"Question number {i}?"},
                          {"role": "assistant", "content": f"Answer number {i}."}]} for i in range(40)]
    rows[3] = {"messages": [{"role": "user", "content": "no answer"}]}  # a bad row inside the first samples
    src = str(write_jsonl(tmp_path / "rows.jsonl", rows))

    def run(name, **kw):
        result = prepare_data({"sources": [src], "tokenizer_path": str(BUNDLED_TOKENIZER), **kw}, tmp_path / name)
        return load(result)["source_index"], result.stats

    order, stats = run("plain", max_samples=10)
    assert order == [0, 1, 2, 4, 5, 6, 7, 8, 9, 10]  # source order; max_samples counts KEPT samples
    assert stats["samples_read"] == 11 and stats["skipped"]["no_assistant_turn"] == {"count": 1, "first_indices": [3]}
    a, _ = run("a", max_samples=10, shuffle_seed=7)
    b, _ = run("b", max_samples=10, shuffle_seed=7)
    c, _ = run("c", max_samples=10, shuffle_seed=8)
    assert a == b and a != c and len(set(a)) == 10 and a != sorted(a)
    full, stats = run("full", shuffle_seed=7)
    assert full[:10] == a and sorted(full) == [i for i in range(40) if i != 3]
    assert stats["samples_read"] == 40


def test_progress_lines_start_at_once_and_count_what_the_stage_really_processes(tmp_path, caplog):
    """Issue 20: a shuffled, capped run's only progress line read "rows 60/2,115 (2.8%) ... ETA" although the cap
    ended the stage at 60. The stage says what it reads as it starts, its first progress line comes with the first
    batch, and the total is the cap (kept samples; a skipped row does not advance it)."""
    import logging

    rows = [{"messages": [{"role": "user", "content": f"Question number {i}?"},
                          {"role": "assistant", "content": f"Answer number {i}."}]} for i in range(300)]
    rows[3] = {"messages": [{"role": "user", "content": "no answer"}]}
    src = str(write_jsonl(tmp_path / "rows.jsonl", rows))
    for name, kw, first_total in [("capped", {"max_samples": 20, "shuffle_seed": 0}, "samples 20/20"),
                                  ("streamed", {"max_samples": 20}, "samples 20/20"),
                                  ("all", {"shuffle_seed": 0}, "rows 300/300")]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="eagle3"):  # the stage's own logger and Progress's
            prepare_data({"sources": [src], "tokenizer_path": str(BUNDLED_TOKENIZER), **kw}, tmp_path / name)
        lines = [r.getMessage() for r in caplog.records if r.name.startswith("eagle3")]
        assert lines[0].startswith(f"[data] reading {src} with the tokenizer of"), lines
        progress = [line for line in lines if line.startswith(("[data] rows", "[data] samples"))]
        assert progress and all(first_total.split("/")[1] + " (" in p for p in progress), progress
        assert progress[-1].startswith(f"[data] {first_total} (100.0%)"), progress
        unit, total = first_total.split(" ")[0], first_total.split("/")[1]
        assert progress[0].startswith(f"[data] {unit} 1/{total} ") and "ETA" not in progress[0], progress
        assert sum(f"{unit} {total}/{total} (100.0%)" in p for p in progress) == 1, progress  # said once
        assert lines[-1].startswith("[data] kept "), lines


def test_overlong_skip_and_truncate_are_counted(tmp_path):
    short = CONVERSATIONS[0]
    long_reply = [{"role": "user", "content": "Tell me everything."},
                  {"role": "assistant", "content": "All of the standard library, in order. " * 40}]
    long_question = [{"role": "user", "content": "Here is my whole program. " * 60},
                     {"role": "assistant", "content": "It looks fine."}]
    rows = [{"messages": m} for m in (short, long_reply, long_question, short)]
    src = str(write_jsonl(tmp_path / "rows.jsonl", rows))
    cfg = {"sources": [src], "tokenizer_path": str(DATA / "tok-llama3"), "max_seq_len": 100}

    skipped = prepare_data(cfg, tmp_path / "skip")
    assert skipped.stats["skipped"] == {"overlong": {"count": 2, "first_indices": [1, 2]}}
    assert skipped.stats["truncated"] == 0 and load(skipped)["source_index"] == [0, 3]

    truncated = prepare_data({**cfg, "overlong": "truncate"}, tmp_path / "truncate")
    ds = load(truncated)
    # the long reply is cut to 100 tokens; the long question loses its whole reply, so it is dropped
    assert truncated.stats["truncated"] == 1
    assert truncated.stats["skipped"] == {"no_assistant_tokens": {"count": 1, "first_indices": [2]}}
    assert ds["source_index"] == [0, 1, 3] and len(ds[1]["input_ids"]) == 100
    full = load(prepare_data({**cfg, "max_seq_len": 4096}, tmp_path / "full"))[1]
    assert ds[1]["input_ids"] == full["input_ids"][:100] and ds[1]["loss_mask"] == full["loss_mask"][:100]
    assert 0 < sum(ds[1]["loss_mask"]) < sum(full["loss_mask"])


# ---------------------------------------------------------------------------------------------------- bad rows

# A ChatML template with the quirks real templates have: it refuses a system message after the first turn
# (template_error), shows earlier replies that start with "DRAFT" redacted, like templates that drop reasoning from
# history (not_prefix_stable), and upper-cases replies that start with "SHOUT" (content_not_rendered).
QUIRKY_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and not loop.first %}{{ raise_exception('system message must come first') }}{% endif %}"
    "{%- if m.role == 'assistant' and m.content.startswith('SHOUT') %}"
    "{{- '<|im_start|>assistant\\n' + m.content | upper + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' and m.content.startswith('DRAFT') and not loop.last %}"
    "{{- '<|im_start|>assistant\\n(redacted)<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_bad_rows_are_skipped_and_reported_by_reason(tmp_path):
    good = {"messages": CONVERSATIONS[0]}
    user = {"role": "user", "content": "Hi"}
    lines = [
        json.dumps(good).encode(),                                                           # 0 ok
        b'{"messages": [',                                                                   # 1 invalid_json
        b'{"messages": [{"role": "user", "content": "caf\xe9"}, {"role": "assistant", "content": "x"}]}',  # 2 utf8
        json.dumps({"text": "no conversation here"}).encode(),                               # 3 missing_field
        json.dumps({"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]}).encode(),  # 4 missing
        json.dumps({"messages": [user, {"role": "tool", "content": "x"}]}).encode(),         # 5 unknown_role
        json.dumps({"messages": [user, {"role": "assistant", "content": "  \n"}]}).encode(),  # 6 empty_content
        json.dumps({"messages": [user, {"role": "assistant", "content": [{"type": "text", "text": "x"}]}]}).encode(),
        json.dumps({"messages": [user, {"role": "assistant", "content": None}]}).encode(),  # 8 non_string_content
        json.dumps({"messages": [{"role": "system", "content": "S"}, user]}).encode(),        # 9 no_assistant_turn
        json.dumps({"messages": [user, {"role": "assistant", "content": "A"}, {"role": "system", "content": "S"},
                                 user, {"role": "assistant", "content": "B"}]}).encode(),    # 10 template_error
        json.dumps({"messages": [user, {"role": "assistant", "content": "DRAFT one"}, user,
                                 {"role": "assistant", "content": "final"}]}).encode(),     # 11 not_prefix_stable
        json.dumps({"messages": [user, {"role": "assistant", "content": "SHOUT this"}]}).encode(),  # 12 not rendered
        json.dumps({"messages": [user, {"role": "assistant", "content": "word " * 300}]}).encode(),  # 13 overlong
        b'[1, 2]',                                                                           # 14 invalid_json
        b'{"messages": [{"role": "user", "content": "\\ud800"}, {"role": "assistant", "content": "x"}]}',  # 15 utf8
        json.dumps({"messages": "not a list"}).encode(),                                    # 16 missing_field
        json.dumps(good).encode(),                                                           # 17 ok
    ]
    src = tmp_path / "bad.jsonl"
    src.write_bytes(b"\n".join(lines) + b"\n")
    # a .json document with an undecodable byte in one row: only that row is lost
    (tmp_path / "doc.json").write_bytes(b'[' + json.dumps(good).encode() + b', {"messages": [{"role": "user", '
                                        b'"content": "\xff"}, {"role": "assistant", "content": "x"}]}]')
    result = prepare_data({"sources": [str(src), str(tmp_path / "doc.json")], "chat_template": QUIRKY_TEMPLATE,
                              "tokenizer_path": str(DATA / "tok-chatml-generation"), "max_seq_len": 256},
                             tmp_path / "out")
    assert result.stats["skipped"] == {
        "invalid_json": {"count": 2, "first_indices": [1, 14]},
        "invalid_utf8": {"count": 3, "first_indices": [2, 15, 19]},
        "missing_field": {"count": 3, "first_indices": [3, 4, 16]},
        "unknown_role": {"count": 1, "first_indices": [5]},
        "empty_content": {"count": 1, "first_indices": [6]},
        "non_string_content": {"count": 2, "first_indices": [7, 8]},
        "no_assistant_turn": {"count": 1, "first_indices": [9]},
        "template_error": {"count": 1, "first_indices": [10]},
        "not_prefix_stable": {"count": 1, "first_indices": [11]},
        "content_not_rendered": {"count": 1, "first_indices": [12]},
        "overlong": {"count": 1, "first_indices": [13]},
    }
    assert load(result)["source_index"] == [0, 17, 18]
    assert result.stats["samples_read"] == 20 and result.stats["samples_skipped"] == 17
    # the override replaced the tokenizer's own template, and stats say which template rendered the data
    import hashlib
    assert result.stats["chat_template_sha256"] == hashlib.sha256(QUIRKY_TEMPLATE.encode()).hexdigest()


def test_first_indices_are_capped_and_forced_format_is_checked(tmp_path):
    rows = [to_sharegpt(CONVERSATIONS[0])] * 8 + [{"messages": CONVERSATIONS[0]}]
    src = str(write_jsonl(tmp_path / "rows.jsonl", rows))
    result = prepare_data({"sources": [src], "tokenizer_path": str(BUNDLED_TOKENIZER), "format": "openai"},
                             tmp_path / "out")
    assert result.stats["skipped"] == {"missing_field": {"count": 8, "first_indices": [0, 1, 2, 3, 4]}}
    assert result.samples == 1


def test_no_usable_row_is_one_data_error_naming_the_sources(tmp_path):
    src = str(write_jsonl(tmp_path / "bad.jsonl", [{"messages": [{"role": "user", "content": "only a question"}]}]))
    with pytest.raises(DataError, match=r"no usable row.*bad\.jsonl.*no_assistant_turn: 1 \(rows \[0\]\)"):
        prepare_data({"sources": [src], "tokenizer_path": str(BUNDLED_TOKENIZER)}, tmp_path / "out")
    assert not (tmp_path / "out" / "dataset").exists() and not (tmp_path / "out" / "stats.json").exists()


def test_tokenizer_without_chat_template_is_a_data_error_naming_the_path(tmp_path):
    tok = AutoTokenizer.from_pretrained(DATA / "tok-llama3")
    tok.chat_template = None
    bare = tmp_path / "no-template"
    tok.save_pretrained(bare)
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    src = str(write_jsonl(tmp_path / "rows.jsonl", [{"messages": CONVERSATIONS[0]}]))
    with pytest.raises(DataError, match=f"{bare}.*no chat template"):
        prepare_data({"sources": [src], "tokenizer_path": str(bare)}, tmp_path / "out")
    # the override fixes it: a template file beside the data works, a path that is not there is named
    template_file = tmp_path / "llama3.jinja"
    template_file.write_text((DATA / "tok-llama3" / "chat_template.jinja").read_text())
    ok = prepare_data({"sources": [src], "tokenizer_path": str(bare), "chat_template": str(template_file)},
                         tmp_path / "out-ok")
    assert ok.samples == 1
    with pytest.raises(DataError, match="nope.jinja.*no such file"):
        prepare_data({"sources": [src], "tokenizer_path": str(bare), "chat_template": "nope.jinja"},
                        tmp_path / "out")
    with pytest.raises(DataError, match="missing-tokenizer"):
        prepare_data({"sources": [src], "tokenizer_path": str(tmp_path / "missing-tokenizer")}, tmp_path / "out")


def test_tokenizer_that_prefixes_every_call_is_refused(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")  # SentencePiece's "add dummy prefix"
    raw.decoder = decoders.Metaspace(prepend_scheme="always")
    raw.train_from_iterator(["Hello world and new line spaces"] * 10,
                            trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>"], show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>")
    with pytest.raises(DataError, match="does not concatenate"):
        ChatEncoder(tok, "{{ messages }}", name="sentencepiece-like")


# ---------------------------------------------------------------------------------------------------- outputs


def test_outputs_stats_and_dataset_columns(tmp_path):
    src = str(write_jsonl(tmp_path / "rows.jsonl", [{"messages": m} for m in CONVERSATIONS]))
    cfg = PrepareConfig(sources=[src], tokenizer_path=str(BUNDLED_TOKENIZER), max_seq_len=512)
    result = prepare_data(cfg, tmp_path / "data")
    out = tmp_path / "data"
    assert result.dataset_path == str(out / "dataset") and result.stats_path == str(out / "stats.json")
    manifest = {"total_tokens": result.total_tokens, "assistant_tokens": result.assistant_tokens,
                "dataset_path": result.dataset_path}
    assert result.samples == len(CONVERSATIONS) and result.stats["samples_skipped"] == 0

    ds = datasets.load_from_disk(manifest["dataset_path"])
    assert ds.features["input_ids"].feature.dtype == "int32" and ds.features["loss_mask"].feature.dtype == "int8"
    assert ds.features["source_index"].dtype == "int64"
    stats = json.loads((out / "stats.json").read_text())
    lengths = [len(x) for x in ds["input_ids"]]
    assert stats["total_tokens"] == sum(lengths) == manifest["total_tokens"]
    assert stats["assistant_tokens"] == sum(map(sum, ds["loss_mask"])) == manifest["assistant_tokens"]
    assert sum(b["count"] for b in stats["length_histogram"]) == len(ds)
    for n in lengths:
        assert sum(b["min_tokens"] <= n <= b["max_tokens"] for b in stats["length_histogram"]) == 1
    assert stats["tokenizer_path"] == str(BUNDLED_TOKENIZER) and len(stats["chat_template_sha256"]) == 64
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temp leftovers

    # the same input gives the same dataset content (a rerun's fingerprint matches: a cache hit downstream)
    again = prepare_data(cfg.model_dump(), tmp_path / "again")
    assert fingerprint_paths([again.dataset_path]) == fingerprint_paths([result.dataset_path])

    with pytest.raises(ValidationError):
        PrepareConfig(sources=[src], tokenizer_path=str(BUNDLED_TOKENIZER), max_seq=10)
    with pytest.raises(ValidationError):
        PrepareConfig(sources=[], tokenizer_path=str(BUNDLED_TOKENIZER))


def test_template_override_renders_identical_prompts_in_prepare_regenerate_and_validate(tmp_path):
    """One chat layer: with ``data.chat_template`` overridden, the prompt the verifier answers during regeneration
    (the driver's encoder, built from the JSON job it receives), the prompt validation sends to vLLM and the
    offline reference, and the prefix that precedes the first answer in the prepared training sample are the same
    token ids, and they are the override's rendering, not the tokenizer's own."""
    from eagle3.chat.encoder import ChatSettings
    from eagle3.chat.sources import read_prompt_messages
    from eagle3.config import load_config
    
    override = ("{%- for m in messages %}{{- '### ' + m.role + ':\\n' + m.content + '\\n' }}{%- endfor %}"
                "{%- if add_generation_prompt %}{{- '### assistant:\\n' }}{%- endif %}")
    rows = [{"messages": m} for m in CONVERSATIONS]
    src = write_jsonl(tmp_path / "rows.jsonl", rows)
    config = load_config("tiny", {"data": {"sources": [str(src)], "chat_template": override}})

    prepared = load(prepare_data(config.prepare_config(), tmp_path / "data"))
    job_chat = json.loads(json.dumps({"chat": config.prepare_config().chat_settings().model_dump()}))["chat"]
    regen_encoder = ChatSettings.model_validate(job_chat).encoder()  # as eagle3.regenerate.vllm_worker builds it
    validate_ids = config.chat_settings().held_out_prompt_ids(src, len(rows))
    own = ChatSettings(tokenizer_path=str(BUNDLED_TOKENIZER)).encoder()

    firsts = read_prompt_messages(src, len(rows))  # the conversation up to its first user turn
    assert len(prepared) == len(rows) == len(validate_ids)
    for i, ids, mask in zip(prepared["source_index"], prepared["input_ids"], prepared["loss_mask"]):
        (regen,) = regen_encoder.prompt_ids([firsts[i]])
        assert regen == validate_ids[i], i
        assert ids[:len(regen)] == regen and not any(mask[:len(regen)]) and mask[len(regen)] == 1, i
        assert own.prompt_ids([firsts[i]])[0] != regen, i  # the override really rendered it
        assert regen_encoder.tokenizer.decode(regen).endswith("### assistant:\n"), i
