"""Garbled generations (control and replacement characters) are rejected by every text gate."""

from __future__ import annotations

from rde.common.garbled_text import garbled_detail
from rde.largefine.caption_quality import gate_caption
from rde.secmm.sentence_checks import clean_caption

# what a random-weight Qwen2-VL wrote for the caption pool (a byte-level BPE decoding random ids)
SOUP = "\ufffd\u03ba,\x03v\ufffdk\x02\u029e\ufffde\x07\ufffd person\ufffdo\x08-\ufffdD"


def test_plain_text_passes_and_soup_is_counted_by_kind() -> None:
    assert garbled_detail("A man in a red jacket walks left.\nA white van.\t(parked)") is None
    assert garbled_detail("Ein Mann läuft – café, naïve “quotes”") is None
    # 4 control characters (\x03 \x02 \x07 \x08) and 6 U+FFFD, counted by hand
    assert garbled_detail(SOUP) == "4 control, 6 replacement characters"
    assert garbled_detail("a person\ue000 walks") == "1 private-use characters"


def test_the_caption_gates_reject_it_as_garbled() -> None:
    gate = gate_caption(SOUP + " walks down the street with a bag.", min_words=1, max_words=100, boilerplate=(),
                        max_repeated_sentence_share=1.0)
    assert gate.reason == "garbled" and gate.detail == "4 control, 6 replacement characters"
    check = clean_caption(f"A man walks down the street. {SOUP} walks.", None, set())
    assert check.kept == "A man walks down the street."
    assert [v.reason for v in check.sentences] == [None, "garbled"]
