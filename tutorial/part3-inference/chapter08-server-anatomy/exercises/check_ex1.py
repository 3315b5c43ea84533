"""Checker for ch08.1 — your metrics against numpy on random requests, edge cases, and mlsys.server's summary."""

from __future__ import annotations

import numpy as np

from mlsys.exercises import task


def random_requests(seed: int, n: int) -> list[tuple[float, list[float]]]:
    """n requests: Poisson-ish arrivals, a queueing delay, then 1..40 tokens with irregular gaps."""
    rng = np.random.default_rng(seed)
    out, t = [], 0.0
    for _ in range(n):
        t += rng.exponential(0.05)
        first = t + rng.uniform(0.005, 0.5)
        gaps = rng.exponential(0.02, size=int(rng.integers(0, 40)))
        out.append((t, list(first + np.concatenate([[0.0], np.cumsum(gaps)]))))
    return out


@task("percentile interpolates like numpy.percentile (one value, two values, ties, p = 0, 50, 99, 100)")
def check_percentile(ex) -> None:
    rng = np.random.default_rng(0)
    cases = [[3.0], [1.0, 2.0], [5.0, 5.0, 1.0], list(rng.exponential(1.0, size=17)), list(rng.normal(size=200))]
    for values in cases:
        for p in (0, 10, 50, 90, 99, 100):
            got, want = ex.percentile(list(values), p), float(np.percentile(values, p))
            assert abs(got - want) <= 1e-9 * max(1.0, abs(want)), (
                f"percentile({values[:5]}..., {p}) = {got}, want {want}")


@task("request_metrics: TTFT includes queueing, ITL has n-1 gaps, TPOT is None for a one-token request")
def check_request_metrics(ex) -> None:
    m = ex.request_metrics(1.0, [1.5, 1.6, 1.8, 2.1])
    assert abs(m["ttft"] - 0.5) < 1e-12, f"ttft {m['ttft']}, want 0.5 (first token 1.5 - arrival 1.0)"
    assert np.allclose(m["itl"], [0.1, 0.2, 0.3]), f"itl {m['itl']}, want [0.1, 0.2, 0.3]"
    assert abs(m["tpot"] - 0.2) < 1e-12, f"tpot {m['tpot']}, want (2.1 - 1.5) / 3 = 0.2"
    assert abs(m["e2e"] - 1.1) < 1e-12, f"e2e {m['e2e']}, want 1.1"
    one = ex.request_metrics(0.0, [0.25])
    assert one["tpot"] is None and list(one["itl"]) == [], f"one token: want tpot None and itl [], got {one}"
    assert abs(one["ttft"] - 0.25) < 1e-12 and abs(one["e2e"] - 0.25) < 1e-12


@task("summarize equals numpy on 300 random requests and mlsys.serving_metrics (ITL pooled, TPOT skips n=1)")
def check_summarize(ex) -> None:
    from mlsys.serving_metrics import serving_summary

    reqs = random_requests(7, 300)
    duration = max(times[-1] for _, times in reqs) - reqs[0][0]
    got = ex.summarize(reqs, duration)
    ttft = np.array([times[0] - a for a, times in reqs]) * 1e3
    tpot = np.array([(t[-1] - t[0]) / (len(t) - 1) for _, t in reqs if len(t) > 1]) * 1e3
    itl = np.concatenate([np.diff(t) for _, t in reqs]) * 1e3
    want = {"request_throughput": len(reqs) / duration, "output_throughput": sum(len(t) for _, t in reqs) / duration}
    for name, v in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        want |= {f"mean_{name}_ms": v.mean(), f"p50_{name}_ms": np.percentile(v, 50),
                 f"p99_{name}_ms": np.percentile(v, 99)}
    for key, value in want.items():
        assert key in got, f"summarize() has no key {key!r}"
        assert abs(got[key] - value) <= 1e-6 * max(1.0, abs(value)), f"{key}: {got[key]:.6g}, want {value:.6g}"
    ref = serving_summary([{"arrival": a, "token_times": t, "prompt_len": 1} for a, t in reqs], duration)
    for key in ("mean_itl_ms", "p99_itl_ms", "p50_tpot_ms", "p99_ttft_ms", "output_throughput"):
        assert abs(got[key] - ref[key]) <= 1e-6 * max(1.0, abs(ref[key])), f"{key} differs from mlsys.server"
