"""A byte-level BPE tokenizer trained on the book's corpus, for the lessons that need real subword tokens.

    from mlsys.bpe import load_bpe
    tok = load_bpe()   # an mlsys.engine.tokenizer.HFTokenizer; <pad> 0, <bos> 1, <eos> 2 as in mlsys.data
    tok.encode('{"name": "ada"')      # -> a few ids: '{"', 'name', '":', 'Ġ"', 'ada', '"'

The book's models read characters (`mlsys.data.Tokenizer`), so none of their tokens spans more than one
character. This one is what production models use (GPT-2's scheme, trained with Hugging Face `tokenizers`):
text is turned into UTF-8 bytes, each byte is one base symbol, and merges learned from the corpus join frequent
byte pairs into longer tokens ('name', 'london', '":'). Every string encodes, and a character the corpus never
showed (é, 数, 🙂) falls back to its 2 to 4 byte tokens, each of which alone is only part of a character.

Training is deterministic (same corpus seed, same file) and takes well under a second. The file lives beside the
weights, `<cache>/weights/bpe/tokenizer.json` (`mlsys.weights.cache_dir`), built on first use;
`scripts/train_weights.py --if-missing` builds it ahead of time. The corpus's grammar has few distinct words, so
merges run out before a large vocabulary fills: the default asks for 512 and gets about 450.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from mlsys.data import SPECIALS, make_corpus
from mlsys.weights import cache_dir

VOCAB_SIZE = 512
NUM_RECORDS = 2000  # about 150 KB of JSON lines: every word of the grammar many times over


def train_bpe(vocab_size: int = VOCAB_SIZE, seed: int = 0, num_records: int = NUM_RECORDS):
    """A `tokenizers.Tokenizer`: byte-level BPE on `make_corpus(num_records, seed)`, specials first (ids 0, 1, 2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # bytes -> printable symbols, GPT-2 split
    tok.decoder = decoders.ByteLevel()  # symbols -> bytes -> UTF-8 (U+FFFD for an incomplete character)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # all 256 bytes
    tok.train_from_iterator(make_corpus(num_records, seed=seed).splitlines(), trainer)
    return tok


def bpe_path() -> Path:
    return cache_dir() / "weights" / "bpe" / "tokenizer.json"


def build_bpe(path: Path | None = None, **train_args) -> Path:
    """Train and write the file atomically (a temp file in the same folder, then `os.replace`)."""
    path = Path(path or bpe_path())
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        train_bpe(**train_args).save(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_bpe(path: Path | None = None):
    """The cached tokenizer (trained and saved first if missing) as an HFTokenizer with the book's special ids."""
    from mlsys.engine.tokenizer import HFTokenizer

    path = Path(path or bpe_path())
    if not path.exists():
        build_bpe(path)
    tok = HFTokenizer(path)
    tok.pad_id, tok.bos_id, tok.eos_id = (tok.tok.token_to_id(s) for s in SPECIALS)
    return tok
