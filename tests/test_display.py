"""Numbers for people (eagle3.support.display): 3 significant digits, exact counts, words for what was not measured."""

from __future__ import annotations

import pytest

from eagle3.support.display import measured, percent, sig, signed, size


@pytest.mark.parametrize(("value", "text"), [
    (1.1031390134529149, "1.10"),  # the run summary's acceptance length in issue 20
    (1.2126719199790643, "1.21"),  # the train summary's
    (0.06278, "0.0628"), (2958.4, "2,960"), (123456.7, "123,000"), (0.9996, "1.00"), (99.95, "100"),
    (7.5e-4, "7.50e-04"), (-0.0738, "-0.0738"), (0.0, "0"), (1.0, "1.00"),
    (7077, "7,077"), (0, "0"), (True, "yes"), (False, "no"),
    (None, "not measured"), (float("nan"), "not measured"), ("as written", "as written"),
])
def test_sig(value, text):
    assert sig(value) == text


def test_units_signs_percentages_and_sizes():
    assert measured(1.1031, "tokens per verifier step") == "1.10 tokens per verifier step"
    assert measured(None, "tokens per verifier step") == "not measured"
    assert signed(0.07384) == "+0.0738" and signed(-0.5) == "-0.500" and signed(0.0) == "0"
    assert percent(0.02222) == "2.22%" and percent(None) == "not measured"
    assert size(29_071_893) == "29.1 MB" and size(79_065_726_976) == "79.1 GB" and size(512) == "512 bytes"
