"""Text buffering/segmentation for live sessions: word streams, sentence + flush, long text, CJK, tags."""

from __future__ import annotations

import random
import re
import unicodedata
from typing import Any

import pytest

from rtts.segmenter import Segmenter


def stream(seg: Segmenter, pieces: list[str]) -> list[list[str]]:
    """Push each piece; what each push returned."""
    return [seg.push(p) for p in pieces]


def words_of(text: str) -> list[str]:
    """How SDK users stream: complete words with a trailing space."""
    parts = text.split(" ")
    return [w + " " for w in parts[:-1]] + [parts[-1]]


def run(text_pieces: list[str], **kw: Any) -> list[str]:
    seg = Segmenter(**kw)
    out = [s for got in stream(seg, text_pieces) for s in got]
    return out + seg.flush()


def squash(text: str) -> str:
    return re.sub(r"\s+", "", text)


STORY = (
    "Hello there, this is Mr. Smith calling from the U.S. office about your order. "
    "We found 3.5 million reasons to ship it early! Would you like to hear them? "
    "I think you would, e.g. the first one is simple. (excited) Let's go. "
    "The second reason is longer, and it goes on for a while without much punctuation at all so that the "
    "segmenter has to decide where to cut it on its own, which is the interesting part of this test"
)


# ---------------------------------------------------------------------------------------------------- SDK word streams


def test_word_by_word_emits_at_sentence_ends() -> None:
    seg = Segmenter()
    pieces = words_of("Hello there, this is a fairly long first sentence of the reply. And here comes a second one.")
    results = stream(seg, pieces)
    emitted = [s for got in results for s in got]
    assert emitted == ["Hello there, this is a fairly long first sentence of the reply."]
    # A period is only a sentence end once the next word is known ("Mr. Smith"), so it came out with "And".
    assert results[pieces.index("And ")] == emitted
    assert seg.pending == "And here comes a second one."
    assert seg.flush() == ["And here comes a second one."]
    assert seg.pending == ""


def test_exclamation_and_question_need_only_whitespace() -> None:
    seg = Segmenter(min_chunk_length=10)
    assert seg.push("What a wonderful day it is") == []
    assert seg.push("! ") == ["What a wonderful day it is!"]
    assert seg.push("Is it not?") == []  # could still become "?!" or '?"'
    assert seg.push(" ") == ["Is it not?"]


def test_no_text_lost_or_reordered() -> None:
    out = run(words_of(STORY))
    assert squash("".join(out)) == squash(STORY)
    assert all(s == s.strip() and s for s in out)


def test_abbreviations_initials_decimals_do_not_split() -> None:
    out = run(words_of(STORY), min_chunk_length=0)
    assert "Hello there, this is Mr. Smith calling from the U.S. office about your order." in out
    assert "We found 3.5 million reasons to ship it early!" in out
    assert "I think you would, e.g. the first one is simple." in out


def test_ellipsis_before_lowercase_does_not_split() -> None:
    assert run(["Well... maybe not. I think so."], min_chunk_length=0) == ["Well... maybe not.", "I think so."]


def test_chunked_arrival_gives_the_same_segments_as_one_push() -> None:
    texts = [
        STORY,
        "今天天气很好。我们去公园散步吧！你觉得怎么样？好的，我们走吧。" * 6,
        "<|speaker:0|>Hello there, how are you? <|speaker:1|>"
        + "I am fine, thanks for asking " * 12
        + "[laughing] ok.",
        "no punctuation at all just a long stream of words that keeps going and going " * 8,
        "x" * 650,
    ]
    rnd = random.Random(0)
    for text in texts:
        for kw in ({}, {"chunk_length": 100, "min_chunk_length": 10}, {"chunk_length": 120, "min_chunk_length": 0}):
            whole = run([text], **kw)
            by_char = run(list(text), **kw)
            pieces, i = [], 0
            while i < len(text):
                n = rnd.randint(1, 12)
                pieces.append(text[i : i + n])
                i += n
            assert by_char == whole, (kw, text[:30])
            assert run(pieces, **kw) == whole, (kw, text[:30])
            assert run(words_of(text), **kw) == whole, (kw, text[:30])


# -------------------------------------------------------------------------------------- voice agents: sentence + flush


def test_livekit_sentence_then_flush() -> None:
    seg = Segmenter(chunk_length=100, min_chunk_length=50)  # LiveKit's chunk_length default
    assert seg.push("Sure, I can help with that. ") == []  # short: waits (nothing would come before the flush anyway)
    assert seg.flush() == ["Sure, I can help with that."]
    assert seg.push("Your appointment is confirmed for Tuesday at three in the afternoon. ") == []
    assert seg.flush() == ["Your appointment is confirmed for Tuesday at three in the afternoon."]
    assert seg.flush() == []  # a flush with nothing buffered yields nothing


def test_pipecat_many_text_flush_pairs() -> None:
    seg = Segmenter()
    out: list[str] = []
    for sentence in ["Hi!", "How can I help you today?", "Let me check that for you."]:
        out += seg.push(sentence)
        out += seg.flush()
    assert out == ["Hi!", "How can I help you today?", "Let me check that for you."]


def test_flush_of_long_text_respects_limits() -> None:
    seg = Segmenter(chunk_length=120, min_chunk_length=30)
    assert seg.push(STORY) != []  # complete sentences come out before the flush
    rest = seg.flush()
    assert rest and all(len(s) <= 120 for s in rest)
    assert seg.pending == ""


# ------------------------------------------------------------------------------------------ min_chunk_length behaviour


def test_short_sentences_are_merged_up_to_min_chunk_length() -> None:
    text = "Yes. Okay. Sure thing. That sounds great to me, thanks. Bye now."
    assert run([text], min_chunk_length=30) == ["Yes. Okay. Sure thing. That sounds great to me, thanks.", "Bye now."]
    assert run([text], min_chunk_length=0) == [
        "Yes.",
        "Okay.",
        "Sure thing.",
        "That sounds great to me, thanks.",
        "Bye now.",
    ]
    assert run([text], min_chunk_length=100) == [text]


def test_min_chunk_length_changed_between_pushes() -> None:
    seg = Segmenter(min_chunk_length=0)  # e.g. a short first segment for low latency
    assert seg.push("Hi there. ") == []
    assert seg.push("Welcome") == ["Hi there."]
    seg.min_chunk_length = 50
    assert seg.push(" back. Good to see you. ") == []
    assert seg.flush() == ["Welcome back. Good to see you."]


# ------------------------------------------------------------------------------------------------- chunk_length limits


def test_long_text_without_punctuation_cuts_at_whitespace() -> None:
    text = " ".join(f"word{i}" for i in range(120))
    seg = Segmenter(chunk_length=100, min_chunk_length=50)
    out = [s for got in stream(seg, words_of(text)) for s in got]
    assert out, "segments must come out before the flush once the buffer exceeds chunk_length"
    out += seg.flush()
    assert all(len(s) <= 100 for s in out)
    assert " ".join(out) == text  # every cut was at a space: no word was split
    assert len(seg.pending) == 0


def test_buffer_never_grows_past_chunk_length_while_streaming() -> None:
    seg = Segmenter(chunk_length=100)
    for piece in words_of("lorem ipsum dolor sit amet " * 40):
        seg.push(piece)
        assert len(seg.pending) <= 100 + len("lorem ")


def test_cut_preference_sentence_then_clause_then_space() -> None:
    clause = "alpha beta gamma delta epsilon, zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau"
    assert run([clause], chunk_length=60, min_chunk_length=10)[0] == "alpha beta gamma delta epsilon,"
    sentence = "Short one here. Then alpha beta gamma, delta epsilon zeta eta theta iota kappa lambda mu nu"
    assert run([sentence], chunk_length=60, min_chunk_length=30)[0] == "Short one here. Then alpha beta gamma,"
    assert run([sentence], chunk_length=60, min_chunk_length=10)[0] == "Short one here."


def test_min_chunk_length_respected_by_forced_cuts_when_possible() -> None:
    # A clause mark early on would give a tiny segment; the cut goes to a later space instead.
    text = "Well, " + "the quick brown fox jumps over the lazy dog " * 4
    out = run([text], chunk_length=80, min_chunk_length=40)
    assert all(len(s) >= 40 for s in out[:-1]) and all(len(s) <= 80 for s in out)


def test_hard_cut_without_spaces() -> None:
    url = "https://example.com/" + "a" * 300
    out = run([url], chunk_length=100, min_chunk_length=50)
    assert [len(s) for s in out] == [100, 100, 100, 20] and "".join(out) == url


def test_hard_cut_keeps_combining_marks() -> None:
    text = "e\u0301" * 150  # é as e + combining acute: never separate the two
    out = run([text], chunk_length=101, min_chunk_length=0)
    assert all(not unicodedata.combining(s[0]) for s in out) and "".join(out) == text


# ----------------------------------------------------------------------------------------------------------------- CJK


def test_cjk_sentence_marks_need_no_space() -> None:
    seg = Segmenter(min_chunk_length=5)
    assert seg.push("今天天气很好。") == ["今天天气很好。"]  # a full-width stop ends the sentence at once
    assert seg.push("我们去公园") == []
    assert seg.push("散步吧！你呢") == ["我们去公园散步吧！"]
    assert seg.flush() == ["你呢"]


def test_cjk_short_sentences_merge() -> None:
    text = "你好。我很好。谢谢你的关心，今天我们一起去公园散步吧！"
    assert run([text], min_chunk_length=10) == ["你好。我很好。谢谢你的关心，今天我们一起去公园散步吧！"]
    assert run([text], min_chunk_length=5) == ["你好。我很好。", "谢谢你的关心，今天我们一起去公园散步吧！"]


def test_cjk_long_text_cut_at_clause_then_characters() -> None:
    text = "这是一个非常长的句子，" + "没有标点符号的中文文本" * 20
    out = run([text], chunk_length=100, min_chunk_length=5)
    assert out[0] == "这是一个非常长的句子，"
    assert all(len(s) <= 100 for s in out) and "".join(out) == text


def test_japanese_and_mixed_script() -> None:
    text = "こんにちは、世界。Hello world! これはテストです。"
    assert run([text], min_chunk_length=0) == ["こんにちは、世界。", "Hello world!", "これはテストです。"]


def test_korean_words_not_split() -> None:
    text = " ".join(["안녕하세요"] * 40)
    out = run([text], chunk_length=100, min_chunk_length=10)
    assert all(set(s.split()) == {"안녕하세요"} for s in out)


# ---------------------------------------------------------------------------------------------------------------- tags


def test_control_tags_never_split() -> None:
    tags = ("(excited)", "(in a soft whisper)", "[laughing]", "[clears throat, then sighs]", "<|speaker:1|>")
    text = "(excited) " + "la " * 30 + "(in a soft whisper) [laughing] " + "ha " * 30 + "[clears throat, then sighs] "
    text += "<|speaker:1|> done, " + "and that is all " * 5
    for limit in range(100, 121):
        out = run([text], chunk_length=limit, min_chunk_length=0)
        assert squash("".join(out)) == squash(text)
        for seg in out:
            for tag in tags:
                for k in range(1, len(tag)):  # no segment ends with a tag's prefix or starts with its suffix
                    assert not seg.endswith(tag[:k]) and not seg.startswith(tag[k:]), (limit, seg)


def test_tags_in_hard_cut_region_move_the_cut() -> None:
    text = "a" * 95 + "[laughing]" + "b" * 50
    out = run([text], chunk_length=100, min_chunk_length=0)
    assert out[0] == "a" * 95 and out[1].startswith("[laughing]")


def test_punctuation_inside_a_tag_is_not_a_sentence_end() -> None:
    assert run(["He said (wow!) and left. Then it rained."], min_chunk_length=5) == [
        "He said (wow!) and left.",
        "Then it rained.",
    ]


def test_unclosed_tag_while_streaming_is_not_split() -> None:
    seg = Segmenter(chunk_length=100, min_chunk_length=0)
    assert seg.push("x" * 95 + " (in a sof") == ["x" * 95]  # not "x... (in a": the tag may still close
    assert seg.pending == "(in a sof"
    assert seg.push("t whisper) Hi.") == []
    assert seg.flush() == ["(in a soft whisper) Hi."]
    assert seg.push("y" * 98 + " <|spea") == ["y" * 98]
    assert seg.push("ker:2|>Hi.") == []
    assert seg.flush() == ["<|speaker:2|>Hi."]


def test_unclosed_bracket_is_plain_text_once_flushed() -> None:
    # While streaming, the "(" might open a tag, so nothing after it is cut; at the flush it is just text.
    text = "z" * 90 + " (an aside that never closes and runs on"
    assert run([text], chunk_length=100, min_chunk_length=0) == ["z" * 90, "(an aside that never closes and runs on"]
    seg = Segmenter(chunk_length=30, min_chunk_length=0)
    seg._buf = "(an aside that never closes and runs on"  # a buffer over the limit reaching flush
    assert seg.flush() == ["(an aside that never closes", "and runs on"]


def test_speaker_turns_and_carry() -> None:
    text = "<|speaker:0|>Hi there, friend.<|speaker:1|>" + "Fine thanks " * 15
    out = run([text], chunk_length=100, min_chunk_length=0)
    assert out[0] == "<|speaker:0|>Hi there, friend."
    assert all(s.startswith("<|speaker:1|>") for s in out[1:]) and len(out) >= 3  # the turn's tag repeats
    assert squash("".join(out).replace("<|speaker:1|>", "")) == squash(text.replace("<|speaker:1|>", ""))


def test_speaker_carry_can_be_disabled() -> None:
    text = "<|speaker:1|>" + "Fine thanks " * 15
    out = run([text], chunk_length=100, min_chunk_length=0, carry_speaker=False)
    assert out[0].startswith("<|speaker:1|>") and not out[1].startswith("<|speaker:")


def test_speaker_tag_alone_is_not_a_segment_but_sets_the_speaker() -> None:
    seg = Segmenter()
    seg.push("<|speaker:3|>")
    assert seg.flush() == []
    seg.push("Hello.")
    assert seg.flush() == ["<|speaker:3|>Hello."]


# -------------------------------------------------------------------------------------------- whitespace, flush, clear


def test_whitespace_and_punctuation_only_never_emitted() -> None:
    seg = Segmenter(min_chunk_length=0)
    assert seg.push("   \n\t ") == [] and seg.pending == ""
    assert seg.flush() == []
    assert seg.push("... ") == []
    assert seg.flush() == []


def test_segments_are_stripped() -> None:
    assert run(["   Hello world.   \n"]) == ["Hello world."]


def test_paragraph_break_ends_a_segment() -> None:
    text = "Title without a period\n\nThe body text starts here and goes on."
    assert run([text], min_chunk_length=10) == ["Title without a period", "The body text starts here and goes on."]


def test_clear_drops_buffer() -> None:
    seg = Segmenter()
    seg.push("<|speaker:1|>Something long enough to be a segment on its own, surely. And more")
    assert seg.pending == "And more"
    assert seg.clear() == "And more"
    assert seg.pending == "" and seg.flush() == []
    assert seg.push("Fresh start.") == [] and seg.flush() == ["Fresh start."]  # the speaker was forgotten too


def test_invalid_settings() -> None:
    with pytest.raises(ValueError):
        Segmenter(chunk_length=0)
    with pytest.raises(ValueError):
        Segmenter(min_chunk_length=-1)


def test_min_larger_than_chunk_length_behaves_as_chunk_length() -> None:
    out = run(["One sentence here. Another one there. " * 5], chunk_length=100, min_chunk_length=500)
    assert all(len(s) <= 100 for s in out)


def test_deterministic() -> None:
    assert run(words_of(STORY), chunk_length=100) == run(words_of(STORY), chunk_length=100)
