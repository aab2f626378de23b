"""How often the canary's sequential test (`rlhf_core.eval.always_valid.decide`) decides wrong,
on simulated streams of thumbs-up ratings looked at after every `--every` ratings.

Each simulated canary serves half the users (alternating), each rating a Bernoulli draw of its
version's thumbs-up rate, until the test promotes, rolls back, or reaches its budget (where a
call still open rolls back). Scenarios: equal versions (a roll-back is wrong), a canary worse
by exactly the margin (a promotion is wrong), and one clearly better and one clearly worse
(how many ratings a right call takes). The stated level: each wrong call at most alpha / 2.

    .venv/bin/python bench/canary_sequential.py                  # 2,000 canaries a scenario, about a minute
    .venv/bin/python bench/canary_sequential.py --canaries 1000 --margin 0.03
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import RESULTS, machine, table, write_json  # noqa: E402
from rlhf_core.eval.always_valid import Arm, decide  # noqa: E402


def one_canary(rng: random.Random, champion: float, canary: float, args) -> tuple[str, int]:
    up = [0, 0]
    for n in range(1, args.max_ratings + 1):
        arm = n % 2
        up[arm] += rng.random() < (canary if arm else champion)
        if n % args.every == 0:
            call = decide(Arm(up[0], n - n // 2), Arm(up[1], n // 2), margin=args.margin, alpha=args.alpha,
                          min_ratings=args.min_ratings, max_ratings=args.max_ratings)
            if call.action != "continue":
                return call.action, n
    raise RuntimeError("no call at the budget")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--canaries", type=int, default=2000)
    p.add_argument("--champion-rate", type=float, default=0.6)
    p.add_argument("--margin", type=float, default=0.05)
    p.add_argument("--alpha", type=float, default=0.05)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--min-ratings", type=int, default=100)
    p.add_argument("--max-ratings", type=int, default=20_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default="canary_sequential")
    args = p.parse_args()
    c, m = args.champion_rate, args.margin
    scenarios = [("equal", c, "roll_back"), ("worse by the margin", c - m, "promote"),
                 ("better by the margin", c + m, "roll_back"), ("worse by twice the margin", c - 2 * m, "promote")]
    rows, start = [], time.perf_counter()
    for name, rate, wrong in scenarios:
        rng = random.Random(f"{args.seed}:{name}")
        calls = [one_canary(rng, c, rate, args) for _ in range(args.canaries)]
        actions = [a for a, _ in calls]
        rows.append({
            "scenario": name, "champion_rate": c, "canary_rate": round(rate, 4), "canaries": args.canaries,
            "promoted": actions.count("promote") / args.canaries, "rolled_back": actions.count("roll_back") / args.canaries,
            "wrong_call": wrong, "wrong_share": actions.count(wrong) / args.canaries, "stated_level": args.alpha / 2,
            "at_budget": sum(n >= args.max_ratings for _, n in calls) / args.canaries,
            "median_ratings": statistics.median(n for _, n in calls),
        })
    print(table(rows, ["scenario", "canary_rate", "promoted", "rolled_back", "wrong_call", "wrong_share",
                       "stated_level", "at_budget", "median_ratings"]))
    for r in rows:
        verdict = "within" if r["wrong_share"] <= r["stated_level"] else "ABOVE"
        print(f"{r['scenario']}: wrong calls {r['wrong_share']:.4f}, {verdict} the stated {r['stated_level']:.3f}")
    path = write_json(RESULTS / f"{args.name}.json", {
        "machine": machine(engine=False), "settings": {k: v for k, v in vars(args).items() if k != "name"},
        "rows": rows, "seconds": round(time.perf_counter() - start, 1)})
    print(f"written {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
