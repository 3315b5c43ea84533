"""Prompts to token ids, and streamed token ids back to text, one step at a time.

A server streams text, not ids, so every step turns each request's new tokens
into the new piece of text. Decoding the new ids alone is wrong for real
tokenizers: a byte-level BPE token may be half of a UTF-8 character, and
SentencePiece decides spaces from the previous token. The standard remedy
(vLLM's `detokenize_incrementally`) decodes a short window of recent tokens
twice, without and with the new ones, emits only the difference, and holds
text back while it ends in an incomplete character (U+FFFD).

Our tokenizer is character level, so the window is overkill for it; the code
is the general one, so that the same loop serves a subword tokenizer.
"""

from __future__ import annotations

from mlsys.data import Tokenizer


def encode_prompt(tokenizer: Tokenizer, prompt: str) -> list[int]:
    """A text prompt as the model saw text in training: the book's models, `<bos>` then characters; a folder's
    tokenizer, with the special tokens its own post-processor adds (a Llama tokenizer adds <bos>, Qwen2's adds
    nothing), as transformers and vLLM encode a completions prompt."""
    if hasattr(tokenizer, "encode_with_specials"):
        return tokenizer.encode_with_specials(prompt)
    return tokenizer.encode(prompt, bos=True)


# --8<-- [start:detok]
class IncrementalDetokenizer:
    """Streams text for one request's generated ids."""

    def __init__(self, tokenizer: Tokenizer, context_ids: list[int] = ()):
        self.tokenizer = tokenizer
        self.ids: list[int] = list(context_ids)[-4:]  # a little context for tokenizers that need it
        self.prefix_offset = 0  # ids[prefix_offset:read_offset] were already turned into text
        self.read_offset = len(self.ids)
        self.text = ""  # all text emitted so far (generated part only)

    def step(self, new_ids: list[int]) -> str:
        """Add the step's new ids; return the text they complete (may be "")."""
        self.ids += new_ids
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # nothing printable yet (a special token, or half a character)
        new_text = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += new_text
        return new_text

    def flush(self) -> str:
        """The request is over: release what is still held back (bytes of a character the last token left
        incomplete, shown as U+FFFD, as decode of all the ids shows them)."""
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset :])
        rest = full[len(prefix) :] if len(full) > len(prefix) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += rest
        return rest
# --8<-- [end:detok]


class HFTokenizer:
    """A checkpoint folder's tokenizer.json (Hugging Face `tokenizers`) behind the book tokenizer's interface:
    vocab_size, bos_id / eos_id / pad_id, encode(text, bos=...), decode(ids). Subword tokens may end in half a
    UTF-8 character; IncrementalDetokenizer above holds such text back until the character is complete."""

    def __init__(self, path, bos_id: int | None = None, eos_id: int | None = None, eos_ids: tuple[int, ...] = ()):
        from tokenizers import Tokenizer as _Tokenizer  # lazy: only checkpoint folders need it

        try:
            self.tok = _Tokenizer.from_file(str(path))
        except Exception as err:  # tokenizers raises a bare Exception for a file it cannot parse
            from mlsys.checkpoint import CheckpointError

            raise CheckpointError(f"{path}: not a readable tokenizer.json "
                                  f"({' '.join(str(err).split())[:200]})") from None
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, None
        self.eos_ids = tuple(eos_ids) or ((eos_id,) if eos_id is not None else ())  # any of them ends a text
        self._specials = {t.content for t in self.tok.get_added_tokens_decoder().values() if t.special}

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        text.encode("utf-8")  # a lone surrogate ("\ud800" is valid JSON) raises UnicodeEncodeError, a ValueError
        ids = self.tok.encode(text, add_special_tokens=False).ids
        head = [self.bos_id] if bos and self.bos_id is not None else []
        return head + ids + ([self.eos_id] if eos and self.eos_id is not None else [])

    def encode_with_specials(self, text: str) -> list[int]:
        """The ids with the special tokens the tokenizer's post-processor adds (add_special_tokens=True)."""
        text.encode("utf-8")
        return self.tok.encode(text, add_special_tokens=True).ids

    def decode(self, ids, skip_special: bool = True) -> str:
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        return self.tok.decode(ids, skip_special_tokens=skip_special)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (a byte-level BPE token may be part of a UTF-8 character; a
        SentencePiece byte-fallback token <0xE6> is one byte), which decoding it alone cannot give."""
        piece = self.tok.id_to_token(token_id) or ""
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        if piece in self._specials:
            return b""
        byte_of = _byte_level_map()
        if all(ch in byte_of for ch in piece):     # a byte-level BPE piece: each character stands for one byte
            return bytes(byte_of[ch] for ch in piece)
        return piece.replace("\u2581", " ").encode("utf-8")   # SentencePiece marks a space with U+2581

    def token_text(self, token_id: int | None) -> str:
        """The text of one token (a chat template writes <s>, </s> and the like by name); "" for None."""
        return "" if token_id is None else (self.tok.id_to_token(token_id) or "")


def _byte_level_map() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable character a byte-level BPE writes for each byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenIdsOnly:
    """For a checkpoint folder without a tokenizer.json: prompts must be token ids, and no text is streamed."""

    def __init__(self, vocab_size: int, bos_id: int | None = None, eos_id: int | None = None,
                 eos_ids: tuple[int, ...] = ()):
        self.vocab_size, self.bos_id, self.eos_id, self.pad_id = vocab_size, bos_id, eos_id, None
        self.eos_ids = tuple(eos_ids) or ((eos_id,) if eos_id is not None else ())

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        raise ValueError("this checkpoint has no tokenizer.json: give prompts as token ids "
                         "({'prompt_token_ids': [...]})")

    def decode(self, ids, skip_special: bool = True) -> str:
        return ""


class StopStrings:
    """OpenAI's and vLLM's `stop`: end a request where its text first contains one of these strings, the string
    itself left out. While streaming, the last len(longest stop) - 1 characters are held back, since they may be
    the start of a stop string that the next token completes; they are sent once they cannot be (or at the end)."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.hold = max(map(len, self.stops), default=1) - 1
        self.seen = ""  # the text so far, cut at a stop string once one is found
        self.sent = 0  # characters of `seen` already streamed
        self.stopped = False

    @property
    def text(self) -> str:
        return self.seen[: self.sent]

    def step(self, new_text: str, final: bool) -> str:
        """The detokenizer's new text in -> the part that may be streamed now."""
        if self.stopped:
            return ""
        start = max(0, len(self.seen) - self.hold)  # a stop string may begin in the held-back tail
        self.seen += new_text
        hits = [i for i in (self.seen.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            self.seen, self.stopped, final = self.seen[: min(hits)], True, True
        end = len(self.seen) if final else max(self.sent, len(self.seen) - self.hold)
        piece, self.sent = self.seen[self.sent : end], end
        return piece
