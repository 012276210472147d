"""Vocab stage: assistant-token counts, top-k draft vocabulary, d2t/t2d round trip, mapping file checks."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import datasets
import pytest
import torch

from eagle3.vocab import (
    VocabConfig,
    VocabError,
    build_vocab,
    build_vocab_mapping,
    count_assistant_tokens,
    load_mapping,
    save_mapping,
    sized_to_data,
)

FEATURES = datasets.Features(
    {"input_ids": datasets.Sequence(datasets.Value("int32")), "loss_mask": datasets.Sequence(datasets.Value("int8"))}
)


def save_dataset(path: Path, input_ids: list[list[int]], loss_mask: list[list[int]]) -> Path:
    datasets.Dataset.from_dict({"input_ids": input_ids, "loss_mask": loss_mask}, features=FEATURES).save_to_disk(
        str(path)
    )
    return path


def random_dataset(n: int = 300, vocab: int = 500, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """Zipf-like assistant tokens; the prompt part (mask 0) is dominated by ids 3 and 4."""
    rng = random.Random(seed)
    weights = [1.0 / (k + 1) for k in range(vocab)]
    ids, mask = [], []
    for _ in range(n):
        prompt = [rng.choice([3, 4, rng.randrange(vocab)]) for _ in range(rng.randint(1, 20))]
        answer = rng.choices(range(5, vocab), weights=weights[5:], k=rng.randint(0, 60))
        ids.append(prompt + answer)
        mask.append([0] * len(prompt) + [1] * len(answer))
    return ids, mask


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> tuple[Path, list[list[int]], list[list[int]]]:
    ids, mask = random_dataset()
    return save_dataset(tmp_path_factory.mktemp("vocab") / "dataset", ids, mask), ids, mask


def brute_force_counts(ids: list[list[int]], mask: list[list[int]]) -> Counter:
    return Counter(t for row, m in zip(ids, mask) for t, keep in zip(row, m) if keep)


def test_counts_only_masked_tokens_and_match_python(dataset):
    path, ids, mask = dataset
    counts = count_assistant_tokens(path, 500, batch_samples=37)  # several record batches
    expected = brute_force_counts(ids, mask)
    assert counts.dtype == torch.int64 and counts.shape == (500,)
    assert {i: int(c) for i, c in enumerate(counts) if c} == dict(expected)


def test_round_trip_coverage_and_frequent_prompt_tokens_excluded(dataset, tmp_path):
    path, ids, mask = dataset
    result = build_vocab(VocabConfig(draft_vocab_size=64), path, 500, tmp_path / "vocab")
    d2t, t2d = load_mapping(tmp_path / "vocab" / "mapping.safetensors")

    expected = brute_force_counts(ids, mask)
    kept = sorted(sorted(expected, key=lambda t: (-expected[t], t))[:64])
    target_ids = torch.arange(64) + d2t  # every draft id -> its target id
    assert target_ids.tolist() == kept
    assert t2d.shape == (500,) and t2d.dtype == torch.bool
    assert torch.nonzero(t2d).flatten().tolist() == kept  # true there and nowhere else

    all_tokens = Counter(t for row in ids for t in row)
    assert all_tokens.most_common(2)[0][0] in (3, 4)  # the most frequent tokens overall are prompt tokens...
    assert not t2d[3] and not t2d[4]  # ...and never enter the draft vocabulary

    total = sum(expected.values())
    assert result.coverage == pytest.approx(sum(expected[t] for t in kept) / total, abs=0)
    assert result.assistant_token_occurrences == total
    assert result.distinct_tokens_seen == len(expected)
    report = json.loads((tmp_path / "vocab" / "report.json").read_text())
    assert report["seen_tokens_dropped"] == len(expected) - 64
    assert report["coverage"] == result.coverage and report["top_tokens"][0]["count"] == max(expected.values())


def test_tie_break_higher_count_then_lower_id():
    counts = torch.tensor([0, 5, 2, 5, 2, 2, 9, 0], dtype=torch.int64)
    d2t, t2d, report = build_vocab_mapping(counts, 4)
    # 6 (9), 1 (5), 3 (5), then the lowest id among the count-2 ties: 2
    assert (torch.arange(4) + d2t).tolist() == [1, 2, 3, 6]
    assert d2t.tolist() == [1, 1, 1, 3]
    assert torch.nonzero(t2d).flatten().tolist() == [1, 2, 3, 6]
    assert report["coverage"] == pytest.approx(21 / 25)
    again = build_vocab_mapping(counts.clone(), 4)
    assert torch.equal(again[0], d2t) and torch.equal(again[1], t2d)

    many = torch.randint(0, 4, (50_000,), generator=torch.Generator().manual_seed(0))  # long runs of equal counts
    d2t, _, _ = build_vocab_mapping(many, 20_000)
    expected = sorted(sorted(range(50_000), key=lambda t: (-int(many[t]), t))[:20_000])
    assert (torch.arange(20_000) + d2t).tolist() == expected


def test_sample_order_does_not_change_the_mapping(dataset, tmp_path):
    path, ids, mask = dataset
    order = list(range(len(ids)))
    random.Random(1).shuffle(order)
    shuffled = save_dataset(tmp_path / "shuffled", [ids[i] for i in order], [mask[i] for i in order])
    a = build_vocab_mapping(count_assistant_tokens(path, 500), 100)
    b = build_vocab_mapping(count_assistant_tokens(shuffled, 500), 100)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_draft_vocab_larger_than_tokens_seen_fills_lowest_unseen_ids(tmp_path):
    path = save_dataset(tmp_path / "ds", [[7, 9, 9, 2], [9, 5]], [[1, 1, 1, 0], [1, 0]])
    result = build_vocab(VocabConfig(draft_vocab_size=6), path, 12, tmp_path / "vocab")
    d2t, t2d = load_mapping(tmp_path / "vocab")
    # seen: 9 (3x), 7 (1x); unseen fill, lowest first: 0, 1, 2, 3
    assert (torch.arange(6) + d2t).tolist() == [0, 1, 2, 3, 7, 9]
    assert torch.nonzero(t2d).flatten().tolist() == [0, 1, 2, 3, 7, 9]
    assert result.coverage == 1.0
    report = json.loads(Path(result.report_path).read_text())
    assert result.distinct_tokens_seen == 2 and report["unseen_tokens_filled"] == 4
    assert "4 draft slots hold unseen" in report["note"]


def test_sized_to_data_rounds_the_seen_tokens_up_to_64_rows_at_most_the_configured_size():
    assert [sized_to_data(n, 8192) for n in (0, 1, 64, 65, 2685, 8191, 8192, 20000)] == \
        [64, 64, 64, 128, 2688, 8192, 8192, 8192]
    assert sized_to_data(2685, 2000) == 2000 and sized_to_data(3, 6) == 6


def test_draft_vocab_sized_to_the_data_keeps_every_seen_token(tmp_path):
    """150 distinct assistant tokens, 512 slots configured: 192 slots (the seen 150 + the 42 lowest unseen ids);
    size_to_data false keeps 512. Same seen tokens either way, coverage 1."""
    rng = random.Random(3)
    seen = sorted(rng.sample(range(10, 1000), 150))
    ids = [[1, 2] + rng.sample(seen, 40) for _ in range(20)] + [[1, 2] + seen]  # every seen id at least once
    path = save_dataset(tmp_path / "ds", ids, [[0, 0] + [1] * (len(r) - 2) for r in ids])  # prompt ids 1, 2 unseen
    sized = build_vocab(VocabConfig(draft_vocab_size=512), path, 1000, tmp_path / "sized")
    fixed = build_vocab(VocabConfig(draft_vocab_size=512, size_to_data=False), path, 1000, tmp_path / "fixed")
    assert (sized.draft_vocab_size, fixed.draft_vocab_size) == (192, 512)
    assert sized.distinct_tokens_seen == fixed.distinct_tokens_seen == 150
    assert sized.coverage == fixed.coverage == 1.0
    d2t, t2d = load_mapping(sized.mapping_path)
    kept = (torch.arange(192) + d2t).tolist()
    assert kept == sorted(seen + [i for i in range(1000) if i not in seen][:42])  # seen + the lowest unseen
    assert torch.nonzero(t2d).flatten().tolist() == kept
    report = json.loads(Path(sized.report_path).read_text())
    assert report["configured_draft_vocab_size"] == 512 and report["size_to_data"] is True
    assert "150 distinct assistant tokens seen, so 192 draft slots" in report["note"]
    assert "the last 42 hold unseen ids" in report["note"]
    assert len(load_mapping(fixed.mapping_path)[0]) == 512


def test_draft_vocab_larger_than_target_is_one_clear_error(dataset, tmp_path):
    with pytest.raises(VocabError, match=r"draft_vocab_size 600 .* target vocabulary \(500 tokens\)"):
        build_vocab(VocabConfig(draft_vocab_size=600), dataset[0], 500, tmp_path / "vocab")
    assert not (tmp_path / "vocab").exists()
    with pytest.raises(VocabError, match="draft_vocab_size 9 .*8 tokens"):
        build_vocab_mapping(torch.ones(8, dtype=torch.int64), 9)


def test_bad_dataset_errors_name_the_sample(tmp_path):
    out_of_range = save_dataset(tmp_path / "oor", [[1, 2], [3, 40]], [[1, 1], [1, 1]])
    with pytest.raises(VocabError, match=r"sample 1: token id 40 outside the verifier's vocabulary \[0, 32\)"):
        count_assistant_tokens(out_of_range, 32)
    ragged = save_dataset(tmp_path / "ragged", [[1, 2], [3, 4, 5]], [[1, 1], [1, 1]])
    with pytest.raises(VocabError, match="sample 1 has 3 input_ids but 2 loss_mask entries"):
        count_assistant_tokens(ragged, 32)
    bad_mask = save_dataset(tmp_path / "bad_mask", [[1, 2], [3, 4], [5]], [[1, 1], [0, 1], [2]])
    with pytest.raises(VocabError, match=r"sample 2: loss_mask value 2 \(expected 0 or 1\)"):
        count_assistant_tokens(bad_mask, 32)
    no_assistant = save_dataset(tmp_path / "none", [[1, 2]], [[0, 0]])
    with pytest.raises(VocabError, match="no loss-masked"):
        build_vocab(VocabConfig(draft_vocab_size=4), no_assistant, 32, tmp_path / "vocab")
    with pytest.raises(VocabError, match="dataset folder not found"):
        count_assistant_tokens(tmp_path / "missing", 32)


def test_corrupted_or_inconsistent_mapping_file_is_a_clear_error(tmp_path):
    d2t, t2d, report = build_vocab_mapping(torch.tensor([3, 0, 1, 0, 7, 2], dtype=torch.int64), 3)
    path = save_mapping(tmp_path / "ok", d2t, t2d, report)

    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(VocabError, match="truncated.safetensors is not a readable safetensors file"):
        load_mapping(truncated)

    from safetensors.torch import save_file

    wrong_t2d = tmp_path / "wrong_t2d.safetensors"
    bad = t2d.clone()
    bad[1] = True
    save_file({"d2t": d2t, "t2d": bad}, str(wrong_t2d))
    with pytest.raises(VocabError, match="wrong_t2d.safetensors: t2d must be True exactly at the 3 target ids"):
        load_mapping(wrong_t2d)

    wrong_dtype = tmp_path / "wrong_dtype.safetensors"
    save_file({"d2t": d2t.to(torch.int32), "t2d": t2d}, str(wrong_dtype))
    with pytest.raises(VocabError, match="wrong_dtype.safetensors: d2t must be 1-D int64"):
        load_mapping(wrong_dtype)

    missing = tmp_path / "missing.safetensors"
    save_file({"d2t": d2t}, str(missing))
    with pytest.raises(VocabError, match=r"missing.safetensors lacks tensor\(s\) \['t2d'\]"):
        load_mapping(missing)
