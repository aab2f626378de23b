"""What the feedback gateway costs: latency it adds over calling vLLM directly, and ratings/s.

One vLLM server (the tiny demo-sized model, CPU backend) and one gateway (`rlhf gateway`, its
own process, SQLite store) in front of it. Latency: at each of `--concurrency` (1 and 16),
clients send greedy completions of `--max-tokens` tokens, in alternating rounds straight to
vLLM and through the gateway (so that drift on a shared machine hits both alike); printed are
p50, p99 and mean of each and their difference, and the gateway's own account of the time it
adds (its `rlhf_gateway_added_seconds` histogram: its total minus the upstream's).
Ratings: the same number of clients post thumbs for `--seconds` seconds, each from its own
user, signed with the gateway's user-signing secret as an application signs its users' ids
(the gateway checks every signature); every one is acknowledged only after its SQLite
transaction committed (WAL, synchronous=FULL).

    .venv/bin/python bench/gateway.py                 # 1 and 16 concurrent, 6 rounds of 64 requests per side
"""
from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import save, table  # noqa: E402
from rlhf_core.config import ServingConfig  # noqa: E402
from rlhf_core.serving.server import deploy, stop  # noqa: E402
from rlhf_core.serving.user_auth import USER_SECRET_FILE, resolve_secret, sign_user  # noqa: E402
from rlhf_core.testing.ports import free_ports  # noqa: E402
from rlhf_core.testing.gateway_process import running_gateway  # noqa: E402
from rlhf_core.testing.models import tiny_policy_dir  # noqa: E402


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


async def completions(url: str, key: str, n: int, concurrency: int, max_tokens: int) -> list[float]:
    """Latency (s) of `n` completions, `concurrency` at a time."""
    latencies: list[float] = []
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(n):
        queue.put_nowait(i)
    async with httpx.AsyncClient(timeout=120, headers={"Authorization": f"Bearer {key}"},
                                 limits=httpx.Limits(max_connections=concurrency)) as client:
        async def worker():
            while not queue.empty():
                i = queue.get_nowait()
                body = {"model": "policy-v1", "prompt": f"{i % 90 + 10}+{i % 7 + 11}=", "max_tokens": max_tokens,
                        "temperature": 0, "ignore_eos": True}
                t0 = time.perf_counter()
                r = await client.post(f"{url}/v1/completions", json=body)
                latencies.append(time.perf_counter() - t0)
                r.raise_for_status()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies


async def ratings(url: str, key: str, user_secret: str, response_id: str, concurrency: int,
                  seconds: float) -> tuple[int, float]:
    done = 0
    stop_at = time.perf_counter() + seconds
    async with httpx.AsyncClient(timeout=60, headers={"Authorization": f"Bearer {key}"},
                                 limits=httpx.Limits(max_connections=concurrency)) as client:
        async def worker(w: int):
            nonlocal done
            i = 0
            while time.perf_counter() < stop_at:
                r = await client.post(f"{url}/v1/feedback", headers=sign_user(user_secret, f"b{w}-{i}"),
                                      json={"response_id": response_id, "rating": "up"})
                r.raise_for_status()
                done += 1
                i += 1
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        return done, time.perf_counter() - t0


def added_histogram(metrics: str) -> dict[str, float]:
    """p50 and p99 of the gateway's added-time histogram (upper bucket bounds)."""
    buckets = [(float(le), float(v)) for le, v in re.findall(
        r'rlhf_gateway_added_seconds_bucket\{le="([^"]+)",route="/v1/completions"\} (\S+)', metrics)]
    buckets.sort()
    total = buckets[-1][1]
    out = {}
    for q in (0.5, 0.99):
        out[f"p{int(q * 100)}_at_most_ms"] = next(le for le, c in buckets if c >= q * total) * 1000
    total_s = float(re.search(r'rlhf_gateway_added_seconds_sum\{route="/v1/completions"\} (\S+)', metrics).group(1))
    out["mean_ms"] = total_s / total * 1000
    return out


def latency_at(endpoint_url: str, gateway: str, key: str, concurrency: int, args) -> dict:
    """Alternating rounds straight to vLLM and through the gateway, at one concurrency."""
    direct, through = [], []
    for _ in range(args.rounds):
        direct += asyncio.run(completions(endpoint_url, key, args.per_round, concurrency, args.max_tokens))
        through += asyncio.run(completions(gateway, key, args.per_round, concurrency, args.max_tokens))
    lat = {name: {"p50_ms": percentile(xs, 0.5) * 1000, "p99_ms": percentile(xs, 0.99) * 1000,
                  "mean_ms": statistics.mean(xs) * 1000, "requests": len(xs)}
           for name, xs in (("direct", direct), ("gateway", through))}
    lat["added"] = {"p50_ms": lat["gateway"]["p50_ms"] - lat["direct"]["p50_ms"],
                    "p99_ms": lat["gateway"]["p99_ms"] - lat["direct"]["p99_ms"],
                    "mean_ms": lat["gateway"]["mean_ms"] - lat["direct"]["mean_ms"]}
    return lat


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="1,16", help="comma-separated concurrencies")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--per-round", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--seconds", type=float, default=10.0)
    args = p.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    cfg = ServingConfig(ports=tuple(free_ports(2)), api_key_env="RLHF_BENCH_GATEWAY_KEY_UNSET",
                        smoke_prompt="12+34=", kv_cache_gib=0.25)
    state_dir = tmp / "serving"
    endpoint = deploy(tiny_policy_dir(tmp / "policy"), "1", cfg, state_dir).endpoint
    key = (state_dir / "api_key").read_text().strip()
    port = free_ports(1)[0]
    # the gateway's user-signing secret: an unset variable names none, so it is the state dir's
    # file, made here (mode 0600) and read by the gateway as it starts
    user_secret_env = "RLHF_BENCH_USER_SECRET_UNSET"
    user_secret = resolve_secret(user_secret_env, state_dir / USER_SECRET_FILE)
    sets = [f"output_dir={tmp}", f"serving.state_dir={state_dir}", f"serving.api_key_env={cfg.api_key_env}",
            f"feedback.user_secret_env={user_secret_env}", f"feedback.port={port}",
            "feedback.ratings_per_minute=1000000"]
    try:
        with running_gateway([a for s in sets for a in ("--set", s)], port) as gateway:
            asyncio.run(completions(endpoint.url, key, 32, max(levels), args.max_tokens))  # warm-up
            asyncio.run(completions(gateway, key, 32, max(levels), args.max_tokens))
            latency = {c: latency_at(endpoint.url, gateway, key, c, args) for c in levels}
            inside = added_histogram(httpx.get(f"{gateway}/metrics").text)
            rid = httpx.post(f"{gateway}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                             json={"prompt": "12+34=", "max_tokens": 2}, timeout=60).json()["id"]
            n, seconds = asyncio.run(ratings(gateway, key, user_secret, rid, max(levels), args.seconds))
    finally:
        stop(state_dir)
    save("gateway", {"settings": vars(args), "latency": latency, "added_inside_gateway": inside,
                     "ratings": {"count": n, "seconds": seconds, "per_second": n / seconds,
                                 "concurrency": max(levels)}})
    rows = [{"concurrency": c, "path": name, "p50 ms": f"{v['p50_ms']:+.1f}" if name == "added" else f"{v['p50_ms']:.1f}",
             "p99 ms": f"{v['p99_ms']:+.1f}" if name == "added" else f"{v['p99_ms']:.1f}",
             "mean ms": f"{v['mean_ms']:+.1f}" if name == "added" else f"{v['mean_ms']:.1f}"}
            for c, lat in latency.items() for name, v in lat.items()]
    print(table(rows, ["concurrency", "path", "p50 ms", "p99 ms", "mean ms"]))
    print(f"the gateway's own account of its added time (all requests): mean {inside['mean_ms']:.1f} ms, "
          f"p50 <= {inside['p50_at_most_ms']:.1f} ms, p99 <= {inside['p99_at_most_ms']:.1f} ms (bucket bounds)")
    print(f"ratings: {n} in {seconds:.1f} s = {n / seconds:.0f}/s at {max(levels)} concurrent, each committed "
          "before its 200")


if __name__ == "__main__":
    main()
