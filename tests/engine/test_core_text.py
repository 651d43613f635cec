"""Incremental detokenization and stop strings (pure logic; a byte tokenizer stands in)."""

from services.engine.detokenize import TextStream


class ByteTokenizer:
    """One token per UTF-8 byte, like the demo model's tokenizer without merges."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def run(text: str, stop: tuple[str, ...], end_after: tuple[str, ...] = ()
        ) -> tuple[list[str], bool]:
    stream = TextStream(ByteTokenizer(), stop, end_after=end_after)
    pieces = []
    for token in ByteTokenizer().encode(text):
        piece, stopped = stream.push(token)
        pieces.append(piece)
        if stopped:
            return pieces, True
    pieces.append(stream.flush())
    return pieces, False


def test_text_is_reassembled_exactly():
    pieces, stopped = run("héllo wörld ✓", ())
    assert "".join(pieces) == "héllo wörld ✓" and not stopped
    assert all("\ufffd" not in p for p in pieces), "partial UTF-8 must be held back"


def test_stop_string_ends_output_before_it():
    pieces, stopped = run("answer: 42\nEND more", ("\nEND",))
    assert stopped and "".join(pieces) == "answer: 42"


def test_an_end_after_string_ends_output_after_it():
    pieces, stopped = run("<call>{}</call>\n<call>{}</call>", (), ("</call>",))
    assert stopped and "".join(pieces) == "<call>{}</call>"
    pieces, stopped = run("no end here </cal", (), ("</call>",))
    assert not stopped and "".join(pieces) == "no end here </cal"


def test_text_that_only_looks_like_a_stop_prefix_is_released():
    pieces, stopped = run("a <b <c", ("<stop>",))
    assert not stopped and "".join(pieces) == "a <b <c"


def test_first_of_several_stop_strings_wins():
    pieces, stopped = run("xx STOP yy END", ("END", "STOP"))
    assert stopped and "".join(pieces) == "xx "


class SentencePieceLike:
    """Words as tokens, "▁" for a space, the leading space of a decode dropped (as
    sentencepiece's decoder does): a token's text depends on whether it comes first."""

    def __init__(self) -> None:
        self.vocab = ["▁the", "▁cat", "s", "▁sat", ".", "▁é", "t", "é"]
        self.windows: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.windows.append(len(ids))
        return "".join(self.vocab[i] for i in ids).replace("▁", " ").removeprefix(" ")


def test_a_token_decodes_in_a_short_window_with_its_neighbour():
    tok = SentencePieceLike()
    ids = [i % len(tok.vocab) for i in range(3000)]
    stream = TextStream(tok, ())
    text = "".join(stream.push(i)[0] for i in ids) + stream.flush()
    assert text == SentencePieceLike().decode(ids)  # the spaces between words kept
    assert max(tok.windows) <= 2, "each token decodes a window, not the whole output"


def test_random_bytes_reassemble_as_one_decode():
    """Byte tokens in any order (invalid UTF-8 included): the pieces are one decode's text."""
    import random

    rng = random.Random(7)
    for _ in range(50):
        ids = [rng.choice([rng.randrange(256), *"aé✓😀".encode()]) for _ in range(60)]
        stream = TextStream(ByteTokenizer(), ())
        pieces = [stream.push(i)[0] for i in ids] + [stream.flush()]
        assert "".join(pieces) == ByteTokenizer().decode(ids)
