"""The printed report of `bench/gateway.py`: the per-target table, the gateway / proxy ratios,
and the `/v1/responses` and `/v1/messages` CPU per request over the chat route's.

A route's ratio is reported per round (the interleaved rounds of `bench/gateway.py`: within one
round both targets met the same machine load) as the median of the per-round ratios and their
spread (lowest-highest), beside the ratio of the best rounds.
"""

from __future__ import annotations

import statistics

Cell = dict[str, float]
Results = dict[tuple[str, int], Cell]
Rounds = dict[tuple[str, int], list[Cell]]


def per_round(rounds: Rounds, mine: tuple[str, int], base: tuple[str, int]) -> list[float]:
    """`mine`'s CPU per request over `base`'s, one ratio per round both ran in (rounds where
    `base` measured no CPU are left out). Example: mine 0.60, 0.66 ms and base 0.50, 0.60 ms
    -> [1.2, 1.1]."""
    if mine not in rounds or base not in rounds:
        return []
    return [
        a["cpu_ms"] / b["cpu_ms"]
        for a, b in zip(rounds[mine], rounds[base], strict=True)
        if b["cpu_ms"] > 0
    ]


def spread(ratios: list[float]) -> str:
    """ "x<median> [x<lowest>-x<highest>]" of per-round ratios, e.g. [1.2, 1.0, 1.1] ->
    "x1.10 [x1.00-x1.20]"; "n/a" when there are none."""
    if not ratios:
        return "n/a"
    return f"x{statistics.median(ratios):.2f} [x{min(ratios):.2f}-x{max(ratios):.2f}]"


def median_cpu(rounds: Rounds, key: tuple[str, int]) -> float:
    """The median over rounds of a cell's CPU ms per request (nan: it did not run)."""
    got = [r["cpu_ms"] for r in rounds.get(key, [])]
    return statistics.median(got) if got else float("nan")


def report(
    results: Results, rounds: Rounds, targets: list[str], levels: tuple[int, ...], rev: str = ""
) -> list[str]:
    """The report's lines: `results` (best round per (target, concurrency)), `rounds` (every
    round per cell, in order), the `targets` and concurrency `levels` that ran; `rev`: the
    revision of target gateway-recorded-B, if any."""
    lines = [
        f"{'target':<19}{'conc':>5}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}"
        f"{'+p50 ms':>9}{'+p99 ms':>9}{'cpu ms/req':>11}{'median':>8}{'redis':>7}{'errors':>8}"
    ]
    for c in levels:
        for t in targets:
            r = results[(t, c)]
            floor = results.get(("direct", c), r)
            lines.append(
                f"{t:<19}{c:>5}{r['rps']:>9.0f}{r['p50']:>9.2f}{r['p99']:>9.2f}"
                f"{r['p50'] - floor['p50']:>9.2f}{r['p99'] - floor['p99']:>9.2f}"
                f"{r['cpu_ms']:>11.3f}{median_cpu(rounds, (t, c)):>8.3f}"
                f"{r.get('redis_ms', 0.0):>7.3f}{r['errors']:>8.0f}"
            )
    if rev and all(("gateway-recorded-B", c) in results for c in levels):
        lines.append("")
        lines.append(f"this tree / {rev} (recorded, cpu per request; target <= 1.0):")
        for c in levels:
            a, b = results[("gateway-recorded", c)], results[("gateway-recorded-B", c)]
            each = per_round(rounds, ("gateway-recorded", c), ("gateway-recorded-B", c))
            lines.append(
                f"  concurrency {c:>2}: {a['cpu_ms']:.2f} / {b['cpu_ms']:.2f} ms = "
                f"x{a['cpu_ms'] / b['cpu_ms']:.2f}; req/s x{a['rps'] / b['rps']:.2f}; "
                f"cpu per round {', '.join(f'x{r:.2f}' for r in each)} "
                f"(median x{statistics.median(each or [float('nan')]):.2f})"
            )
    for route in ("responses", "messages"):
        lines += route_ratios(results, rounds, levels, route)
    lines += aa_lines(rounds, targets, levels)
    lines += route_table(rounds, levels)
    if {"direct", "proxy", "proxy-httpx", "gateway", "gateway-recorded", "responses"} <= set(
        targets
    ) and "responses-recorded" in targets:
        lines += _proxy_ratios(results, levels)
    return lines


def aa_lines(rounds: Rounds, targets: list[str], levels: tuple[int, ...]) -> list[str]:
    """The A/A check: each copy of a target ("gateway#2", from `--targets gateway,gateway`)
    over the target itself, CPU per request, per round: identical work, so every round's
    ratio should be x1.00 and the spread is the method's own noise. Example: a copy at 0.52,
    0.50 ms over 0.50, 0.50 -> "x1.02 [x1.00-x1.04]"."""
    pairs = [(t, t.split("#")[0]) for t in targets if "#" in t]
    if not pairs:
        return []
    lines = ["", "A/A (a copy of a target over the target; identical work, ideally x1.00):"]
    for c in levels:
        parts = [f"{t} / {b} {spread(per_round(rounds, (t, c), (b, c)))}" for t, b in pairs]
        lines.append(f"  concurrency {c:>2}: " + "; ".join(parts))
    return lines


def _ratio(num: float, den: float) -> str:
    return f"x{num / den:.2f}" if den > 0 else "n/a (proxy added no latency: noise)"


def _proxy_ratios(results: Results, levels: tuple[int, ...]) -> list[str]:
    lines = ["", "gateway / pass-through proxy (overhead ratios; target <= 1.5):"]
    for c in levels:
        floor, proxy = results[("direct", c)], results[("proxy", c)]
        slow = results[("proxy-httpx", c)]
        parts = []
        for t in ("gateway", "gateway-recorded"):
            r = results[(t, c)]
            parts.append(
                f"{t}: cpu/req {_ratio(r['cpu_ms'], proxy['cpu_ms'])}, added p50 "
                f"{_ratio(r['p50'] - floor['p50'], proxy['p50'] - floor['p50'])}, added p99 "
                f"{_ratio(r['p99'] - floor['p99'], proxy['p99'] - floor['p99'])}, req/s "
                f"{_ratio(r['rps'], proxy['rps'])}"
            )
        lines.append(f"  concurrency {c:>2}: " + "; ".join(parts))
        rec = results[("gateway-recorded", c)]
        lines.append(
            f"  {'':>14}  (gateway-recorded / proxy-httpx: cpu/req "
            f"{_ratio(rec['cpu_ms'], slow['cpu_ms'])}, added p50 "
            f"{_ratio(rec['p50'] - floor['p50'], slow['p50'] - floor['p50'])})"
        )
        resp, resp_rec = results[("responses", c)], results[("responses-recorded", c)]
        lines.append(
            f"  {'':>14}  (/v1/responses / chat: cpu/req unrecorded "
            f"{_ratio(resp['cpu_ms'], results[('gateway', c)]['cpu_ms'])}, recorded "
            f"{_ratio(resp_rec['cpu_ms'], rec['cpu_ms'])}; target <= 1.2)"
        )
        if ("gateway-recorded-B", c) in results:
            b = results[("gateway-recorded-B", c)]
            lines.append(
                f"  {'':>14}  (gateway-recorded-B / gateway-recorded: cpu/req "
                f"{_ratio(b['cpu_ms'], rec['cpu_ms'])}, req/s "
                f"{_ratio(b['rps'], rec['rps'])})"
            )
    return lines


def route_ratios(
    results: Results, rounds: Rounds, levels: tuple[int, ...], route: str
) -> list[str]:
    """`route`'s (responses, messages) CPU per request over the chat route's, unrecorded and
    recorded (when all four targets ran): the best rounds' ratio, and the median of the
    per-round ratios with their lowest and highest."""
    need = ("gateway", "gateway-recorded", route, f"{route}-recorded")
    if not all((t, c) in results for t in need for c in levels):
        return []
    lines = [
        "",
        f"/v1/{route} / chat (cpu per request; target <= 1.2; best rounds; median of the "
        "per-round ratios [lowest-highest]):",
    ]
    pairs = [
        ("unrecorded", route, "gateway"),
        ("recorded", f"{route}-recorded", "gateway-recorded"),
    ]
    if (f"{route}-unstored", levels[0]) in results:
        pairs.append(("store: false", f"{route}-unstored", "gateway"))
    for c in levels:
        parts = []
        for name, mine, chat in pairs:
            a, b = results[(mine, c)]["cpu_ms"], results[(chat, c)]["cpu_ms"]
            each = per_round(rounds, (mine, c), (chat, c))
            parts.append(f"{name} {a:.2f} / {b:.2f} ms = x{a / b:.2f} ({spread(each)})")
        lines.append(f"  concurrency {c:>2}: " + "; ".join(parts))
    return lines


ROUTE_COLUMNS = (
    ("responses", "responses", "gateway"),
    ("recorded", "responses-recorded", "gateway-recorded"),
    ("store: false", "responses-unstored", "gateway"),
    ("messages", "messages", "gateway"),
    ("recorded", "messages-recorded", "gateway-recorded"),
    ("responses at --compare-rev", "responses-B", "gateway-B"),
)
"""The columns of `route_table`: (heading, target, the chat target it is compared with; the
last: the --compare-rev gateway's Responses over its own chat route)."""


def route_table(rounds: Rounds, levels: tuple[int, ...]) -> list[str]:
    """A markdown table of the route ratios that ran: per concurrency, chat's median CPU ms
    per request (unrecorded, recorded) and each route's median per-round ratio [spread]."""
    cols = [col for col in ROUTE_COLUMNS if (col[1], levels[0]) in rounds]
    if not cols or ("gateway", levels[0]) not in rounds:
        return []
    n = len(rounds[("gateway", levels[0])])
    head = "| concurrency | chat ms | chat recorded ms | " + " | ".join(h for h, _, _ in cols)
    lines = [
        "",
        f"CPU per request over chat's, median of {n} per-round ratios [lowest-highest]:",
        "",
        head + " |",
        "|---:" * (3 + len(cols)) + "|",
    ]
    for c in levels:
        chat = (median_cpu(rounds, ("gateway", c)), median_cpu(rounds, ("gateway-recorded", c)))
        cells = [f"{ms:.3f}" if ms == ms else "-" for ms in chat]  # nan: not run
        cells += [spread(per_round(rounds, (t, c), (chat, c))) for _, t, chat in cols]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return lines
