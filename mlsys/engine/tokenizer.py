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
    """A text prompt as the model saw records in training: `<bos>` then characters."""
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
# --8<-- [end:detok]
