"""Mistake for ch08.1: percentile takes the nearest rank instead of interpolating between floor and ceil."""

from __future__ import annotations


def percentile(values: list[float], p: float) -> float:
    xs = sorted(values)
    r = p / 100 * (len(xs) - 1)
    return xs[round(r)]


def request_metrics(arrival: float, token_times: list[float]) -> dict:
    n = len(token_times)
    itl = [b - a for a, b in zip(token_times, token_times[1:])]
    tpot = (token_times[-1] - token_times[0]) / (n - 1) if n > 1 else None
    return {"ttft": token_times[0] - arrival, "tpot": tpot, "itl": itl, "e2e": token_times[-1] - arrival}


def summarize(requests: list[tuple[float, list[float]]], duration: float) -> dict:
    per = [request_metrics(arrival, times) for arrival, times in requests]
    series = {
        "ttft": [m["ttft"] for m in per],
        "tpot": [m["tpot"] for m in per if m["tpot"] is not None],
        "itl": [gap for m in per for gap in m["itl"]],
    }
    out = {"request_throughput": len(requests) / duration,
           "output_throughput": sum(len(times) for _, times in requests) / duration}
    for name, values in series.items():
        ms = [v * 1e3 for v in values]
        out[f"mean_{name}_ms"] = sum(ms) / len(ms) if ms else 0.0
        out[f"p50_{name}_ms"] = percentile(ms, 50) if ms else 0.0
        out[f"p99_{name}_ms"] = percentile(ms, 99) if ms else 0.0
    return out
