"""Exercise ch11.2 — never run out of budget: the minimum number of tokens to close, and the mask it gives.

A DFA is given as `trans`, one dict per state mapping a character to the next state, and the set of accepting
states (a complete JSON document). With the book's character tokenizer one token is one character, so one
token is one DFA edge.

1. min_tokens_to_close(trans, accepting): dist[s] = the fewest characters that take s to an accepting state
   (0 for accepting states; INF = 1 << 30 when none is reachable). Hint: search backwards from all accepting
   states at once.
2. allowed(trans, dist, accepting, state, remaining): the characters that may come next when `remaining` more
   characters are allowed: c is allowed iff trans[state] has c and 1 + dist[trans[state][c]] <= remaining.
   Add "<eos>" when the state accepts. Always allowing only these keeps dist[state] <= remaining, so decoding
   ends with a valid document for every budget >= dist[start].

Check your work:  make check EX=ch11.2
"""

from __future__ import annotations

INF = 1 << 30


def min_tokens_to_close(trans: list[dict[str, int]], accepting: set[int]) -> list[int]:
    """dist[s] for every state s, INF where no accepting state can be reached."""
    raise NotImplementedError("TODO: reverse the edges, breadth-first search from every accepting state")


def allowed(trans: list[dict[str, int]], dist: list[int], accepting: set[int], state: int,
            remaining: int) -> set[str]:
    """The characters (and "<eos>") that keep the document closable within `remaining` characters."""
    raise NotImplementedError("TODO: c in trans[state] with 1 + dist[next] <= remaining; '<eos>' if accepting")
