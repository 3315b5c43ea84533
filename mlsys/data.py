"""A synthetic corpus of JSON records, its character tokenizer, and batching.

Every chapter from Part II on trains, serves or fine-tunes the same tiny model
on the same data, so the data is generated in code: no download, and the same
seed gives the same bytes on every machine. One record per line:

    {"name": "ada", "age": 34, "city": "london", "langs": ["c", "go"]}

Grammar (fixed key order, fixed spacing, exactly as `format_record` writes it):

    record := '{"name": "' NAME '", "age": ' AGE ', "city": "' CITY
              '", "langs": [' LANG (', ' LANG)* ']}'
    NAME   := one of PEOPLE's keys
    AGE    := an integer in PEOPLE[NAME].decade .. decade + 9   (two digits)
    CITY   := PEOPLE[NAME].city                                 (fixed per name)
    LANG   := 1 to 3 distinct entries of LANGS, in sorted order

The regularities are what a tiny model can pick up in a minute or two: the
city is a function of the name, the age's first digit is too, and the list is
sorted without repeats. Two checks score generated text:

* `is_valid_record`: parses as JSON and fits the schema (keys, types, known
  words, age 10..99, 1..3 distinct langs). A JSON-constrained decoder or an RLHF
  reward can use it as "well formed".
* `is_consistent_record`: valid, and the learned facts also hold (the name's
  city and decade, langs sorted).

Token stream: each record becomes `<bos> chars... <eos>`, and the records are
concatenated; `get_batch` cuts random windows out of that stream.

    python -m mlsys.data      # prints a few records and the vocabulary (< 1 s)
"""

from __future__ import annotations

import json
import random
import string
from typing import NamedTuple

import torch


class Person(NamedTuple):
    city: str
    decade: int  # ages run decade .. decade + 9


PEOPLE: dict[str, Person] = {
    "ada": Person("london", 30), "alan": Person("cambridge", 40),
    "grace": Person("newyork", 50), "linus": Person("helsinki", 20),
    "barbara": Person("boston", 60), "dennis": Person("newjersey", 40),
    "edsger": Person("austin", 70), "margaret": Person("boston", 30),
    "ken": Person("berkeley", 50), "guido": Person("amsterdam", 60),
    "bjarne": Person("aarhus", 70), "john": Person("princeton", 20),
}
LANGS: tuple[str, ...] = ("c", "go", "lisp", "lua", "ml", "perl", "python", "rust")
AGE_RANGE = (10, 99)  # what the schema accepts; the facts are narrower
MAX_LANGS = 3

# The character set is fixed by the grammar, not scanned from data, so token
# ids never change when the corpus does. Newline is not in it: records are
# delimited by <bos>/<eos> in the token stream.
SPECIALS: tuple[str, ...] = ("<pad>", "<bos>", "<eos>")
ALPHABET: str = ' "' + ",:[]{}" + string.digits + string.ascii_lowercase


# ----------------------------------------------------------------- records


def sample_record(rng: random.Random) -> dict:
    """Draw one record from the grammar (key order matters: it is the format)."""
    name = rng.choice(sorted(PEOPLE))
    person = PEOPLE[name]
    num_langs = rng.randint(1, MAX_LANGS)
    return {
        "name": name,
        "age": person.decade + rng.randint(0, 9),
        "city": person.city,
        "langs": sorted(rng.sample(LANGS, num_langs)),
    }


def format_record(record: dict) -> str:
    # json.dumps' default separators (", " and ": ") are the grammar's spacing.
    return json.dumps(record)


def make_corpus(num_records: int, seed: int = 0) -> str:
    """`num_records` lines, newline-terminated; the same seed gives the same text."""
    rng = random.Random(seed)  # private RNG: no global state touched or read
    return "".join(format_record(sample_record(rng)) + "\n" for _ in range(num_records))


def parse_record(line: str) -> dict | None:
    """The record as a dict if `line` is schema-valid JSON, else None."""
    try:
        rec = json.loads(line)
    except (ValueError, TypeError):
        return None
    if not isinstance(rec, dict) or list(rec) != ["name", "age", "city", "langs"]:
        return None
    age, langs = rec["age"], rec["langs"]
    ok = (
        rec["name"] in PEOPLE
        and type(age) is int  # not bool, not float
        and AGE_RANGE[0] <= age <= AGE_RANGE[1]
        and rec["city"] in {p.city for p in PEOPLE.values()}
        and isinstance(langs, list)
        and 1 <= len(langs) <= MAX_LANGS
        and all(isinstance(x, str) and x in LANGS for x in langs)
        and len(set(langs)) == len(langs)
    )
    return rec if ok else None


def is_valid_record(line: str) -> bool:
    return parse_record(line) is not None


def is_consistent_record(line: str) -> bool:
    """Valid, and agrees with the facts the corpus teaches."""
    rec = parse_record(line)
    if rec is None:
        return False
    person = PEOPLE[rec["name"]]
    return (
        rec["city"] == person.city
        and person.decade <= rec["age"] <= person.decade + 9
        and rec["langs"] == sorted(rec["langs"])
    )


# --------------------------------------------------------------- tokenizer


class Tokenizer:
    """Character-level: ids 0..2 are <pad>, <bos>, <eos>; then ALPHABET in order."""

    def __init__(self) -> None:
        self.itos: list[str] = list(SPECIALS) + list(ALPHABET)
        self.stoi: dict[str, int] = {s: i for i, s in enumerate(self.itos)}
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        try:
            ids = [self.stoi[ch] for ch in text]
        except KeyError as err:
            raise ValueError(f"character {err.args[0]!r} is not in the alphabet") from None
        return [self.bos_id] * bos + ids + [self.eos_id] * eos

    def decode(self, ids, skip_special: bool = True) -> str:
        """Ids (list or 1-D tensor) to text; specials are dropped unless asked."""
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else ids
        num_special = len(SPECIALS) if skip_special else 0
        return "".join(self.itos[i] for i in ids if i >= num_special)

    def encode_corpus(self, text: str) -> torch.Tensor:
        """Newline-separated records -> one stream `<bos> rec <eos> <bos> rec <eos> ...`."""
        ids = []
        for line in text.splitlines():
            ids += self.encode(line, bos=True, eos=True)
        return torch.tensor(ids, dtype=torch.long)


# ---------------------------------------------------------------- batching


def load_splits(
    num_records: int = 20_000, seed: int = 0, val_fraction: float = 0.1
) -> tuple[torch.Tensor, torch.Tensor]:
    """(train_tokens, val_tokens), 1-D long tensors, split at a record boundary.

    Validation records are drawn from the same grammar with a different seed,
    so no validation line is a copy of the training stream by construction.
    """
    tok = Tokenizer()
    num_val = max(1, int(num_records * val_fraction))
    train = tok.encode_corpus(make_corpus(num_records - num_val, seed))
    val = tok.encode_corpus(make_corpus(num_val, seed + 1_000_003))
    return train, val


def get_batch(
    tokens: torch.Tensor, batch_size: int, block_size: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of the stream: x (B, T) and y = x shifted left by one (B, T)."""
    max_start = len(tokens) - block_size - 1
    if max_start < 0:
        raise ValueError(f"{len(tokens)} tokens is too few for block_size={block_size}")
    starts = torch.randint(0, max_start + 1, (batch_size,), generator=generator)  # (B,)
    offsets = starts[:, None] + torch.arange(block_size + 1)  # (B, T+1)
    window = tokens[offsets]  # (B, T+1)
    return window[:, :-1], window[:, 1:]


def shard(tokens: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """The `rank`-th of `world_size` contiguous, near-even slices of a 1-D stream.

        tokens: |-- rank 0 --|-- rank 1 --|-- rank 2 --|- rank 3 -|
                 n//w + 1      n//w + 1     n//w + 1     n//w      (n % w = 3)

    The first n % w ranks take one extra token; the slices are disjoint and
    together cover the stream exactly once.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
    base, extra = divmod(len(tokens), world_size)
    start = rank * base + min(rank, extra)
    return tokens[start : start + base + (rank < extra)]


if __name__ == "__main__":
    tok = Tokenizer()
    print(make_corpus(5, seed=0), end="")
    print(f"vocab_size={tok.vocab_size}: {tok.itos}")
