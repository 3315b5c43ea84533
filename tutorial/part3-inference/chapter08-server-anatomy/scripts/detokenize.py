"""Streaming text from subword tokens: why a server detokenizes incrementally, on a real byte-level BPE.

What it shows
    The book's models read characters, so each token is one character and printing tokens as they come is
    trivial. Production tokenizers are subword tokenizers. This script uses one: a byte-level BPE (GPT-2's
    scheme) trained on the book's corpus with Hugging Face `tokenizers` (mlsys/bpe.py, cached beside the
    weights). It takes two texts:
      corpus    records from mlsys.data.make_corpus: frequent words become single tokens ('name', 'london')
      unicode   a record with characters the corpus never showed (accents, CJK, an emoji): each falls back to
                its 2 to 4 UTF-8 byte tokens, and one such token alone is only part of a character
    For each it counts the tokens that span several characters and the partial tokens (decoded alone they
    end in U+FFFD, the replacement character), then streams the ids one at a time through the engine's
    IncrementalDetokenizer (mlsys/engine/tokenizer.py), printing every step of the unicode text: the token,
    its bytes, what it decodes to alone, and the text the detokenizer releases (nothing, while a character
    is incomplete).
    Self-checks: the streamed pieces add up to tokenizer.decode(all ids) and to the original text; they equal,
    step for step, the pieces of the tokenizers library's own streaming decoder (tokenizers.decoders.
    DecodeStream, an independent implementation); decoding each token alone and concatenating, the naive
    way, garbles the unicode text; and a fresh training run reproduces the cached tokenizer file.

How to run
    python tutorial/part3-inference/chapter08-server-anatomy/scripts/detokenize.py
    python .../detokenize.py --text 'ünïcödé 🚀 ok'

Runtime on 2 idle cores: about 2 s (training the tokenizer takes well under a second), the same with --smoke
(two or three times that on a busy machine).

Try next
    python tutorial/part3-inference/chapter08-server-anatomy/scripts/detokenize.py --vocab-size 300
        -> fewer merges: more tokens per record, fewer characters per token; the unicode line keeps its partial
           tokens and held-back steps, since its new characters were never merged anyway
    python tutorial/part3-inference/chapter08-server-anatomy/scripts/detokenize.py --text 'naïve 🙂🙂'
        -> your own text: every 4-byte emoji holds the stream back for three steps
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from mlsys import cli, report
from mlsys.bpe import VOCAB_SIZE, build_bpe, load_bpe, train_bpe
from mlsys.data import SPECIALS, make_corpus
from mlsys.engine.tokenizer import HFTokenizer, IncrementalDetokenizer

UNICODE_TEXT = '{"name": "zoë", "age": 31, "city": "são paulo", "langs": ["日本語", "🐍"]}'


@dataclass
class Settings(cli.Args):
    num_records: int = 4
    """Corpus records (lines of mlsys.data.make_corpus with --seed) in the corpus text."""
    text: str = UNICODE_TEXT
    """The unicode text, streamed step by step (any Unicode)."""
    vocab_size: int = VOCAB_SIZE
    """BPE vocabulary asked for; the default is the book's cached tokenizer, another value trains a new one."""

    def validate(self) -> None:
        if self.num_records < 1:
            raise cli.UsageError(f"--num-records must be at least 1, got {self.num_records}")
        if not self.text or any(s in self.text for s in SPECIALS):
            raise cli.UsageError(f"--text must be non-empty and free of the special tokens {', '.join(SPECIALS)}")
        if self.vocab_size < 259:
            raise cli.UsageError(f"--vocab-size must be at least 259 (3 specials + 256 bytes), got {self.vocab_size}")


def byte_symbols() -> dict[str, int]:
    """GPT-2's map from a byte-level token's printable symbols back to bytes ('Ġ' is a space, 'Ã' is 0xc3)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]  # control bytes, space, ...: shifted past 255
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


def token_bytes(tok: HFTokenizer, token_id: int, symbols: dict[str, int]) -> bytes:
    return bytes(symbols[c] for c in tok.token_text(token_id))


# --8<-- [start:stream]
def stream(tok: HFTokenizer, ids: list[int]) -> list[str]:
    """Feed the ids one at a time, as a server does with sampled tokens; the text released at each step."""
    detok = IncrementalDetokenizer(tok, [tok.bos_id])  # the prompt's last ids are its context; here just <bos>
    return [detok.step([i]) for i in ids]


def naive(tok: HFTokenizer, ids: list[int]) -> str:
    """Wrong: each token decoded alone. A token that is part of a character decodes to U+FFFD."""
    return "".join(tok.decode([i]) for i in ids)
# --8<-- [end:stream]


def library_stream(tok: HFTokenizer, ids: list[int]) -> list[str] | None:
    """The same, by tokenizers' own DecodeStream (None: this version has none). It returns None where we return ''."""
    try:
        from tokenizers.decoders import DecodeStream
    except ImportError:
        return None
    ds = DecodeStream(skip_special_tokens=True)
    ds.step(tok.tok, tok.bos_id)  # the same context as ours
    return [ds.step(tok.tok, i) or "" for i in ids]


def analyse(tok: HFTokenizer, name: str, text: str) -> dict:
    ids = tok.encode(text)
    alone = [tok.decode([i]) for i in ids]
    pieces = stream(tok, ids)
    whole = tok.decode(ids)
    row = {"text": name, "chars": len(text), "multibyte_chars": sum(len(c.encode()) > 1 for c in text),
           "utf8_bytes": len(text.encode()), "tokens": len(ids), "chars_per_token": len(text) / len(ids),
           "multi_char_tokens": sum(len(a) > 1 and "\ufffd" not in a for a in alone),
           "partial_tokens": sum(a.endswith("\ufffd") for a in alone),
           "held_back_steps": sum(p == "" for p in pieces),
           "naive_ok": naive(tok, ids) == text}
    report.expect_equal(f"{name}: streamed pieces joined == tokenizer.decode(all ids)", "".join(pieces), whole)
    report.expect_equal(f"{name}: tokenizer.decode(encode(text)) == text", whole, text)
    theirs = library_stream(tok, ids)
    if theirs is not None:
        report.expect_equal(f"{name}: our pieces == tokenizers.decoders.DecodeStream's, step by step", pieces, theirs)
    return {"row": row, "ids": ids, "alone": alone, "pieces": pieces, "library": theirs is not None}


def print_steps(tok: HFTokenizer, result: dict) -> None:
    symbols = byte_symbols()
    rows = []
    for step, (i, alone, piece) in enumerate(zip(result["ids"], result["alone"], result["pieces"]), start=1):
        rows.append({"step": step, "id": i, "token": tok.token_text(i), "bytes": token_bytes(tok, i, symbols).hex(" "),
                     "decoded alone": repr(alone), "streamed": repr(piece) + ("  (held back)" if piece == "" else "")})
    print(report.table(rows))


def tokenizer_for(args: Settings) -> tuple[HFTokenizer, float, str]:
    """(tokenizer, seconds to train one, where it lives). The default size must reproduce the cached file."""
    start = time.perf_counter()
    fresh = train_bpe(args.vocab_size)
    seconds = time.perf_counter() - start
    if args.vocab_size == VOCAB_SIZE:
        tok = load_bpe()  # the cached file (trained here first if missing)
        report.expect_equal("a fresh training run reproduces the cached tokenizer (delete it if stale)",
                            fresh.to_str(), tok.tok.to_str())
        return tok, seconds, "cached"
    with tempfile.TemporaryDirectory(prefix="bpe-") as folder:  # the tokenizer is read into memory at once
        tok = load_bpe(build_bpe(Path(folder) / "tokenizer.json", vocab_size=args.vocab_size))
    return tok, seconds, "trained for this run"


def main() -> None:
    args = cli.parse(Settings, __doc__, smoke={"num_records": 2})
    tok, train_s, where = tokenizer_for(args)
    print(f"byte-level BPE on mlsys.data.make_corpus: {tok.vocab_size} tokens (asked for {args.vocab_size}: "
          f"3 specials, 256 bytes, {tok.vocab_size - 259} merges), trained in {train_s:.2f} s, {where}")
    print(f"specials: <pad> {tok.pad_id}, <bos> {tok.bos_id}, <eos> {tok.eos_id}")

    corpus = make_corpus(args.num_records, seed=args.seed)
    results = {"corpus": analyse(tok, "corpus", corpus), "unicode": analyse(tok, "unicode", args.text)}
    first = results["corpus"]["ids"][:12]
    print(f"\nthe first corpus record as tokens: {[tok.token_text(i) for i in first]} ...")
    short = dict(multibyte_chars="multibyte", utf8_bytes="bytes", chars_per_token="chars/token",
                 multi_char_tokens="multi-char", partial_tokens="partial", held_back_steps="held back",
                 naive_ok="naive ok")  # table headers; the JSON keeps the long names
    rows = [{short.get(k, k): v for k, v in r["row"].items()} for r in results.values()]
    print(f"\n{report.table(rows, floatfmt='.2f')}")
    print("multibyte: characters of 2-4 UTF-8 bytes; multi-char: tokens that are several whole characters;\n"
          "partial: tokens that alone decode to U+FFFD; held back: stream steps that released no text")

    uni = results["unicode"]
    print(f"\nstreaming the unicode text {args.text!r} one token at a time:")
    print_steps(tok, uni)
    bad = naive(tok, uni["ids"])
    print(f"\nnaive, each token decoded alone: {bad!r}")
    print(f"streamed (IncrementalDetokenizer): {''.join(uni['pieces'])!r}")
    oracle = "and equal tokenizers' DecodeStream step for step" if uni["library"] else \
        "(tokenizers.decoders.DecodeStream is not in this version: not compared)"
    print(f"the streamed pieces add up to decode(all ids) and to the text, {oracle}")
    if uni["row"]["partial_tokens"]:  # an ASCII --text has no partial token, and naive decoding is then right
        report.expect_equal("naive per-token decoding garbles the unicode text", bad == args.text, False)
    if args.json:
        report.write_json(args.json, {"vocab_size": tok.vocab_size, "train_seconds": train_s,
                                      "rows": [r["row"] for r in results.values()],
                                      **{name: r["row"] for name, r in results.items()},
                                      "naive_unicode": bad, "decode_stream_compared": uni["library"]}, args)


if __name__ == "__main__":
    cli.run(main)
