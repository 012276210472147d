"""Log-friendly progress lines: no ETA until a rate was measured after the first update (the first batch carries
the warm-up), and a line at the start of a long first batch instead of silence."""

from __future__ import annotations

import logging

from eagle3.support.progress import Progress


def test_eta_waits_for_a_rate_and_the_first_batch_is_announced(caplog):
    log = logging.getLogger("eagle3.test-progress")
    with caplog.at_level(logging.INFO, logger="eagle3.test-progress"):
        p = Progress("extract", total=300, every_n=1, every_s=0.0, logger=log)
        p.note("batch 1 of ~40: 8 samples, 4,096 tokens (4,096 padded), started")
        p.update(1, tokens=512)
        p.update(1, tokens=512)
        p.note("batch 3 of ~40 started")  # after updates, only when a line is due by time (every_s 0: never)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "[extract] batch 1 of ~40: 8 samples, 4,096 tokens (4,096 padded), started"
    assert "samples 1/300" in lines[1] and "ETA" not in lines[1]  # one point: no rate yet
    assert "samples 2/300" in lines[2] and "ETA" in lines[2]
    assert len(lines) == 3


def test_first_update_writes_a_line_and_finish_says_where_the_count_ended_once(caplog):
    log = logging.getLogger("eagle3.test-progress")
    with caplog.at_level(logging.INFO, logger="eagle3.test-progress"):
        p = Progress("data", total=10, every_n=0, every_s=3600.0, logger=log)
        p.update(1)  # the first update writes a line whatever the interval
        p.update(6)  # not due
        p.finish()  # stopped short of the total: the final count
        q = Progress("data", total=3, every_n=0, every_s=3600.0, logger=log)
        q.update(1)
        q.update(2)  # the total: a line
        q.finish()  # nothing new to say
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split(" | ")[0] for line in lines] == ["[data] samples 1/10 (10.0%)", "[data] samples 7/10 (70.0%)",
                                                         "[data] samples 1/3 (33.3%)", "[data] samples 3/3 (100.0%)"]
