"""Streaming text: deltas never split a UTF-8 character, stop strings never leak, chunking does not matter."""
from __future__ import annotations

import functools

from hypothesis import given, settings
from hypothesis import strategies as st

from lora_compile import SamplingParams, Sequence
from lora_compile.tokenizer import Tokenizer
from service.runner.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, StopStringMatcher, token_texts
from service.runner.output import OutputProcessor
from tests.service_harness import demo_paths

MULTIBYTE = "naïve café — 世界 🎉 ok"


@functools.cache
def demo_tokenizer() -> Tokenizer:
    model, _ = demo_paths()
    return Tokenizer(model, (1,))


def stream(tok, prompt_ids, ids) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt_ids)
    deltas = [detok.add([t]) for t in ids]
    return deltas + [detok.flush()]


def test_multibyte_characters_are_never_split():
    tok = demo_tokenizer()
    ids = tok.encode(MULTIBYTE, add_special_tokens=False)
    assert len(ids) > len(MULTIBYTE)  # byte-level: the non-ASCII characters take several tokens
    deltas = stream(tok, tok.encode("Say:"), ids)
    assert "".join(deltas) == MULTIBYTE
    assert not any(REPLACEMENT_CHAR in d for d in deltas)
    assert "" in deltas  # something was held back while a character was incomplete


@settings(max_examples=60, deadline=None)
@given(prompt=st.text(max_size=20), text=st.text(min_size=1, max_size=40))
def test_stream_of_any_text_is_its_decode(prompt, text):
    tok = demo_tokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    deltas = stream(tok, tok.encode(prompt), ids)
    assert "".join(deltas) == tok.decode(ids)
    assert not any(REPLACEMENT_CHAR in d for d in deltas if REPLACEMENT_CHAR not in text)


def first_stop(text: str, stops: list[str]):
    """Reference: the match that ends first (ties: starts first)."""
    best = None
    for stop in stops:
        start = text.find(stop)
        if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
            best = (start + len(stop), start, stop)
    return (text[:best[1]], best[2]) if best else (text, None)


def feed_in_chunks(text: str, stops: list[str], cuts: list[int]):
    matcher = StopStringMatcher(stops)
    out, bounds = [], sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    for a, b in zip(bounds, bounds[1:], strict=False):
        emitted, matched = matcher.feed(text[a:b], final=b == len(text))
        out.append(emitted)
        if matched is not None:
            return "".join(out), matched, out
    if len(bounds) == 1:
        emitted, matched = matcher.feed("", final=True)
        return emitted, matched, [emitted]
    return "".join(out), None, out


alphabet = st.sampled_from("abc🎉")


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet, max_size=30), stops=st.lists(st.text(alphabet, min_size=1, max_size=4), max_size=3),
       cuts=st.lists(st.integers(0, 40), max_size=10))
def test_stop_strings_match_first_and_never_leak(text, stops, cuts):
    emitted, matched, pieces = feed_in_chunks(text, stops, cuts)
    assert (emitted, matched) == first_stop(text, stops)
    # No emitted prefix ever contains a complete stop (nothing to take back later).
    so_far = ""
    for piece in pieces[:-1]:
        so_far += piece
        assert not any(s in so_far for s in stops)


def test_stop_string_spanning_chunks_is_held_back():
    matcher = StopStringMatcher(["</end>"])
    assert matcher.feed("hello </") == ("hello ", None)
    assert matcher.feed("en") == ("", None)
    assert matcher.feed("d> more") == ("", "</end>")
    matcher = StopStringMatcher(["</end>"])
    assert matcher.feed("a </e") == ("a ", None)
    assert matcher.feed("x") == ("</ex", None)  # not a stop after all: released
    assert matcher.feed("<", final=True) == ("<", None)


def test_output_processor_finishes_on_stop_string_and_eos():
    tok = demo_tokenizer()
    prompt = tok.encode("Q:")
    seq = Sequence(0, prompt, SamplingParams(max_new_tokens=100))
    proc = OutputProcessor(tok, seq, stop=("STOP",))
    outs = []
    for t in tok.encode("one two STOP three", add_special_tokens=False):
        seq.output_ids.append(t)
        out = proc.process()
        outs.append(out)
        if out.finished:
            break
    assert "".join(o.text for o in outs) == "one two "
    assert outs[-1].finish_reason == "stop" and outs[-1].stop == "STOP"
    assert outs[-1].completion_tokens == len(seq.output_ids) and outs[-1].prompt_tokens == len(prompt)

    seq = Sequence(1, prompt, SamplingParams(max_new_tokens=100))
    proc = OutputProcessor(tok, seq, stop=())
    seq.output_ids += tok.encode("fin", add_special_tokens=False)
    assert proc.process().text == "fin"
    seq.output_ids.append(1)
    seq.finish_reason = "eos"
    last = proc.process()
    assert (last.text, last.token_ids, last.finish_reason) == ("", [1], "eos")


# --- each token's own text (logprobs) -------------------------------------------------------------------------
def test_token_texts_concatenate_to_the_text_byte_level():
    """Byte-level BPE (the demo tokenizer, as GPT-2, Llama 3, Qwen): each token's raw bytes, a character split
    across tokens included, concatenate to the text; such a part is shown as OpenAI shows it."""
    tok = demo_tokenizer()
    ids = tok.encode(MULTIBYTE, add_special_tokens=False)
    texts = token_texts(tok, ids)
    assert b"".join(t.data for t in texts) == MULTIBYTE.encode()
    assert [t.text for t in texts if not t.text.startswith("bytes:")] == [
        tok.decode([i]) for i, t in zip(ids, texts) if not t.text.startswith("bytes:")]
    parts = [t for t in texts if t.text.startswith("bytes:")]
    assert parts and all(t.text == "bytes:" + "".join(f"\\x{b:02x}" for b in t.data) for t in parts)
    (bos,) = token_texts(tok, tok.encode("")[:1])
    assert bos.special and bos.text == tok.decode(tok.encode("")[:1], skip_special_tokens=False)


def test_token_texts_of_a_sentencepiece_tokenizer(tmp_path):
    """SentencePiece with byte fallback (Llama 2, Mistral): "▁" is a space in context, <0xNN> pieces are bytes."""
    from tokenizers import AddedToken, decoders, models, normalizers
    from tokenizers import Tokenizer as HFTokenizer

    vocab = {"<unk>": 0, "<s>": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)}, "▁": 258, "a": 259, "▁a": 260,
             "b": 261}
    hf = HFTokenizer(models.BPE(vocab, [("▁", "a")], unk_token="<unk>", byte_fallback=True))
    hf.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    hf.add_special_tokens([AddedToken("<s>", special=True)])
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer(tmp_path)
    ids = tok.encode("a b é", add_special_tokens=False)
    texts = token_texts(tok, ids)
    assert [t.text for t in texts] == [" a", " ", "b", " ", "bytes:\\xc3", "bytes:\\xa9"]
    # (decode strips the text's leading space; a token's own text keeps it, as it reads inside a text)
    assert b"".join(t.data for t in texts).decode() == " " + tok.decode(ids)
