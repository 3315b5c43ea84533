"""Exercise ch08.1 — serving metrics from token timestamps, the way benchmark summaries compute them.

A serving benchmark records, for every request, when it arrived and when each of its output tokens was
produced (RequestMetrics.arrival_time and .token_times in mlsys.engine). Everything in the summary follows from
those timestamps. Times are seconds in, milliseconds out of `summarize`.
Check your work:  make check EX=ch08.1
"""

from __future__ import annotations


def percentile(values: list[float], p: float) -> float:
    """The p-th percentile (0 <= p <= 100) of a non-empty list, by linear interpolation between the two
    nearest ranks (numpy.percentile's default): sort, rank r = p/100 * (n - 1), blend the values at
    floor(r) and ceil(r). Do not call numpy.percentile: this is the function you are writing."""
    raise NotImplementedError("TODO: sort, r = p / 100 * (n - 1), interpolate between floor(r) and ceil(r)")


def request_metrics(arrival: float, token_times: list[float]) -> dict:
    """One request (at least one token) -> {"ttft", "tpot", "itl", "e2e"} in seconds.

    ttft: first token time - arrival (includes the time the request waited in the queue)
    itl:  the list of gaps between consecutive tokens (n - 1 of them; [] for one token)
    tpot: (last token time - first token time) / (n - 1), or None for a one-token request
    e2e:  last token time - arrival
    """
    raise NotImplementedError("TODO: ttft, the gaps between consecutive tokens, tpot (None for n == 1), e2e")


def summarize(requests: list[tuple[float, list[float]]], duration: float) -> dict:
    """[(arrival, token_times), ...] of finished requests over a run of `duration` seconds ->
    {"request_throughput" (req/s), "output_throughput" (tok/s),
     "mean_ttft_ms", "p50_ttft_ms", "p99_ttft_ms", the same three for "tpot" and for "itl"}.

    TPOT skips one-token requests. ITL pools the gaps of ALL requests into one list before taking
    percentiles (a long request contributes many gaps, a short one few), as vLLM's benchmark does.
    """
    raise NotImplementedError("TODO: per-request metrics, then throughputs and mean/p50/p99 in milliseconds")
