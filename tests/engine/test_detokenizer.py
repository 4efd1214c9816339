"""IncrementalDetokenizer: no broken characters mid-stream, the full decode at the end, O(1)
tokens decoded per step. Uses the real SmolLM2 tokenizer (byte-level BPE) and a tiny byte
tokenizer whose tokens split characters on purpose."""

from __future__ import annotations

import random

from deepinfer.engine.detokenizer import IncrementalDetokenizer

MULTIBYTE_TEXTS = ["héllo wörld, ça va? naïve café", "世界你好，日本語のテキスト",
                   "party 🎉👍🏽 family 👨‍👩‍👧 flags 🇯🇵🇫🇷", "math 𝔘𝔫𝔦 ∀x∈ℝ — “quoted” ½"]
CHAT_PROMPT = "<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n"


class ByteTokenizer:
    """Token i < 256 is byte i; then multi-byte tokens given at construction; then specials."""

    def __init__(self, pieces: list[bytes], specials: list[str]):
        self.pieces = [bytes([i]) for i in range(256)] + pieces
        self.special_ids = set(range(len(self.pieces), len(self.pieces) + len(specials)))
        self.pieces += [s.encode() for s in specials]
        self.decoded_lengths: list[int] = []

    def decode(self, token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=None):
        self.decoded_lengths.append(len(token_ids))
        return b"".join(self.pieces[t] for t in token_ids
                        if not (skip_special_tokens and t in self.special_ids)
                        ).decode("utf-8", errors="replace")


def stream(tokenizer, prompt_ids, output_ids, skip_special_tokens, rng=None) -> list[str]:
    """Feed output_ids in chunks of 1 (or random 1..3 with rng); return the deltas + flush."""
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    deltas, i = [], 0
    while i < len(output_ids):
        size = rng.randint(1, 3) if rng else 1
        deltas.append(detokenizer.step(output_ids[i:i + size]))
        i += size
    deltas.append(detokenizer.flush())
    return deltas


def test_multibyte_characters_split_over_tokens(smollm2_tokenizer):
    tokenizer = smollm2_tokenizer
    prompt_ids = tokenizer.encode(CHAT_PROMPT)
    for text in MULTIBYTE_TEXTS:
        ids = tokenizer.encode(text)
        split = [t for t in ids if "\ufffd" in tokenizer.decode([t])]
        assert split, f"expected some character of {text!r} to span tokens"
        deltas = stream(tokenizer, prompt_ids, ids, skip_special_tokens=True)
        assert not any("\ufffd" in d for d in deltas)
        assert "".join(deltas) == text == tokenizer.decode(ids, skip_special_tokens=True)
        assert deltas[-1] == ""                   # nothing was left for flush()
    # "🎉" is 4 bytes in 3 tokens (F0 9F | 8E | 89): it appears whole, with the third
    ids = tokenizer.encode("a🎉b")
    assert len(ids) == 5
    assert stream(tokenizer, prompt_ids, ids, skip_special_tokens=True) == [
        "a", "", "", "🎉", "b", ""]


def test_random_sequences_equal_full_decode(smollm2_tokenizer):
    tokenizer = smollm2_tokenizer
    rng = random.Random(0)
    vocab = len(tokenizer)
    prompt_ids = tokenizer.encode(CHAT_PROMPT)
    for trial in range(300):
        kind = trial % 4
        if kind == 0:
            ids = tokenizer.encode(rng.choice(MULTIBYTE_TEXTS) * rng.randint(1, 3))
        elif kind == 1:
            ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        elif kind == 2:   # single-byte tokens: many broken and completed characters
            ids = [rng.randrange(100, 300) for _ in range(rng.randint(1, 40))]
        else:             # text with special tokens mixed in
            ids = tokenizer.encode(rng.choice(MULTIBYTE_TEXTS))
            for _ in range(3):
                ids.insert(rng.randrange(len(ids) + 1), rng.randrange(17))
        skip = trial % 2 == 0
        deltas = stream(tokenizer, prompt_ids, ids, skip, rng)
        full = tokenizer.decode(ids, skip_special_tokens=skip)
        assert "".join(deltas) == full, (ids, skip)
        if "\ufffd" not in full:
            assert not any("\ufffd" in d for d in deltas), (ids, skip)


def test_special_tokens_skipped_or_kept(smollm2_tokenizer):
    tokenizer = smollm2_tokenizer
    ids = tokenizer.encode("Hello") + [tokenizer.eos_token_id]
    prompt_ids = tokenizer.encode(CHAT_PROMPT)
    assert "".join(stream(tokenizer, prompt_ids, ids, True)) == "Hello"
    assert "".join(stream(tokenizer, prompt_ids, ids, False)) == "Hello<|im_end|>"


def test_tokens_that_end_mid_character_never_show_a_replacement_char():
    text = "世界😀é"
    data = text.encode()
    # every token ends inside a character (cuts at 2, 5, 8, 11; characters end at 3, 6, 10, 12)
    pieces = [data[0:2], data[2:5], data[5:8], data[8:11], data[11:]]
    tokenizer = ByteTokenizer(pieces, ["<eos>"])
    ids = list(range(256, 261))
    deltas = stream(tokenizer, [ord("x")], ids, skip_special_tokens=True)
    assert deltas == ["", "世", "界", "😀", "é", ""]


def test_genuinely_broken_bytes_come_out_as_the_full_decode():
    tokenizer = ByteTokenizer([], ["<eos>"])
    # a stray continuation byte mid-text, then a truncated 3-byte character at the very end
    ids = [ord("a"), 0x96, ord("b"), 0xE4, 0xB8]
    deltas = stream(tokenizer, [], ids, skip_special_tokens=True)
    full = tokenizer.decode(ids)
    assert full == "a\ufffdb\ufffd"
    assert "".join(deltas) == full
    assert deltas[-1] == "\ufffd"      # the truncated character only shows at flush()


def test_window_stays_small_on_long_outputs():
    rng = random.Random(1)
    text = "".join(rng.choice("ab é世😀\n") for _ in range(3000))
    data = text.encode()
    tokenizer = ByteTokenizer([], [])
    ids = list(data)                    # one token per byte
    deltas = stream(tokenizer, [1, 2, 3, 4, 5, 6, 7], ids, skip_special_tokens=False)
    assert "".join(deltas) == text
    assert max(tokenizer.decoded_lengths) <= 8          # O(1) tokens per decode, not O(n)


def test_long_run_of_skipped_specials_keeps_window_bounded():
    tokenizer = ByteTokenizer([], ["<s>"])
    ids = [ord("a")] + [256] * 500 + [ord("b")]
    deltas = stream(tokenizer, [], ids, skip_special_tokens=True)
    assert "".join(deltas) == "ab"
    assert max(tokenizer.decoded_lengths) <= 2 * 64 + 1


def test_sentencepiece_style_output_continues_the_prompt():
    """Metaspace decoders drop the leading space of the first token decoded; with the prompt as
    context the first output word keeps it, so prompt text + output text is the whole text."""
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "▁The": 1, "▁capital": 2, "▁is": 3, "▁Paris": 4, ".": 5}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    prompt, output = [1, 2, 3], [4, 5]
    deltas = stream(tokenizer, prompt, output, skip_special_tokens=True)
    assert deltas == [" Paris", ".", ""]
    assert tokenizer.decode(prompt) + "".join(deltas) == tokenizer.decode(prompt + output)
    assert tokenizer.decode(output) == "Paris."           # what decoding alone would give
