"""The numbers of a serving benchmark, computed from what each request observed: TTFT, TPOT, ITL, throughput.

Shared by Chapter 8's benchmark scripts (and the checker of its first exercise), in the names and the report layout
of vLLM's `benchmarks/benchmark_serving.py`, so a reader can put this book's numbers beside vLLM's.
"""

from __future__ import annotations

from typing import Any

import numpy as np


# --8<-- [start:metrics]
def request_latencies(arrival: float, token_times: list[float]) -> dict[str, Any]:
    """One request's latencies (seconds) from its arrival time and the time each output token was produced.

    TTFT = first token - arrival. ITL = the gaps between consecutive tokens (n - 1 of them).
    TPOT = (last token - first token) / (n - 1): the mean ITL of this request; undefined for n = 1.
    """
    ttft = token_times[0] - arrival
    itl = list(np.diff(token_times)) if len(token_times) > 1 else []
    tpot = (token_times[-1] - token_times[0]) / (len(token_times) - 1) if len(token_times) > 1 else None
    return {"ttft": ttft, "tpot": tpot, "itl": itl, "e2e": token_times[-1] - arrival}


def serving_summary(requests: list[dict[str, Any]], duration: float,
                    percentiles: tuple[float, ...] = (50, 99)) -> dict[str, float]:
    """vLLM benchmark_serving's numbers from finished requests, each {"arrival", "token_times",
    "prompt_len"}, over a run of `duration` seconds. Times in the result are in milliseconds."""
    lat = [request_latencies(r["arrival"], r["token_times"]) for r in requests]
    ttft = [x["ttft"] for x in lat]
    tpot = [x["tpot"] for x in lat if x["tpot"] is not None]
    itl = [gap for x in lat for gap in x["itl"]]  # every gap of every request, pooled
    n_in = sum(r["prompt_len"] for r in requests)
    n_out = sum(len(r["token_times"]) for r in requests)
    out = {"completed": len(requests), "duration_s": duration, "total_input_tokens": n_in,
           "total_output_tokens": n_out, "request_throughput": len(requests) / duration,
           "output_throughput": n_out / duration, "total_token_throughput": (n_in + n_out) / duration}
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        ms = np.asarray(values, dtype=np.float64) * 1e3
        out[f"mean_{name}_ms"] = float(ms.mean()) if ms.size else 0.0
        out[f"median_{name}_ms"] = float(np.median(ms)) if ms.size else 0.0
        for p in percentiles:
            out[f"p{p:g}_{name}_ms"] = float(np.percentile(ms, p)) if ms.size else 0.0
    return out
# --8<-- [end:metrics]


def format_summary(s: dict[str, float], title: str = "Serving Benchmark Result",
                   percentiles: tuple[float, ...] = (99,)) -> str:
    """The summary block in the layout vLLM's benchmark_serving prints."""
    lines = [f"{' ' + title + ' ':=^50}"]
    row = lambda label, value, fmt: lines.append(f"{label:<40}{value:<10{fmt}}")
    row("Successful requests:", s["completed"], "")
    row("Benchmark duration (s):", s["duration_s"], ".2f")
    row("Total input tokens:", s["total_input_tokens"], "")
    row("Total generated tokens:", s["total_output_tokens"], "")
    row("Request throughput (req/s):", s["request_throughput"], ".2f")
    row("Output token throughput (tok/s):", s["output_throughput"], ".2f")
    row("Total Token throughput (tok/s):", s["total_token_throughput"], ".2f")
    for name, header in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                         ("itl", "Inter-token Latency")):
        lines.append(f"{header:-^50}")
        row(f"Mean {name.upper()} (ms):", s[f"mean_{name}_ms"], ".2f")
        row(f"Median {name.upper()} (ms):", s[f"median_{name}_ms"], ".2f")
        for p in percentiles:
            row(f"P{p:g} {name.upper()} (ms):", s[f"p{p:g}_{name}_ms"], ".2f")
    lines.append("=" * 50)
    return "\n".join(lines)
