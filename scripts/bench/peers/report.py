"""Markdown tables from the suite's results.json (what docs/benchmarks.md shows):

    python scripts/bench/peers/report.py runs/cpu_peers/results.json > runs/cpu_peers/report.md

Step time: median over the timed steps of all rounds and the spread as their
interquartile range (p25-p75), then each round's median; ×mt = this system's median /
megatorch's median in the same configuration (> 1: megatorch is faster). Other load: the
largest share of the machine that processes outside the benchmark used during the
system's runs (machine_load.py); a number next to a high one measured a busy machine. Peak RSS: the largest ru_maxrss over the ranks. State: the
parameters, gradients and optimizer state the last rank holds (megatorch: its own
accounting, with padding; peers: counted from their tensors). Comm: bytes the last rank
handed to collectives in one step (megatorch's convention, comm_count.py). Loss: the
loss of the last step and the largest difference from megatorch's over all steps,
relative; systems agree when it is below TOLERANCE.
"""
import json
import statistics
import sys

# fp32 everywhere and the same initial weights, data and update rule: only the order of
# summations differs between systems (fused kernels, TP partial sums, bucketed
# reductions), ~1e-7 relative per operation, grown by 23 AdamW steps.
TOLERANCE = 1e-3
MiB = 1 << 20


def merge_rounds(runs):
    """One record per (part, configuration, system): the timed steps of every round pooled,
    each round's median kept, the losses of the first round (rounds must repeat them
    exactly: the same computation on the same data; `repeatable` says whether they did)."""
    groups = {}
    for r in runs:
        groups.setdefault((r["part"], r["config"], r["label"]), []).append(r)
    merged = []
    for rounds in groups.values():
        rounds.sort(key=lambda r: r.get("round", 0))
        failed = [r for r in rounds if "error" in r]
        if failed:
            merged.append(failed[0])
            continue
        m = dict(rounds[0])
        if "step_ms" in m:
            m["step_ms"] = [x for r in rounds for x in r["step_ms"]]
            m["round_medians"] = [statistics.median(r["step_ms"]) for r in rounds]
            m["median_ms"] = statistics.median(m["step_ms"])
            m["peak_rss_bytes"] = [max(v) for v in zip(*(r["peak_rss_bytes"] for r in rounds))]
            m["repeatable"] = all(r["losses"] == rounds[0]["losses"] for r in rounds)
        for key in ("square_gflops", "shapes_gflops"):  # a rate: the best round is what the machine can do
            if key in m:
                m[key] = max(r[key] for r in rounds)
        m["other_load"] = max(r.get("other_load", 0.0) for r in rounds)
        merged.append(m)
    return merged


def q(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(p * (len(values) - 1))))]


def fmt_ms(r):
    s = r["step_ms"]
    rounds = " / ".join(f"{x:.0f}" for x in r.get("round_medians", []))
    return f"{statistics.median(s):.0f}", f"{q(s, 0.25):.0f}–{q(s, 0.75):.0f}", rounds


def load(r):
    return f"{100 * r.get('other_load', 0):.0f}%"


def mib(x):
    return "–" if x is None else f"{x / MiB:.1f}"


def max_rel_diff(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def comm(r):
    c = r.get("comm_bytes_per_step") or {}
    if "by_group" in c:
        parts = ", ".join(f"{k} {v / MiB:.2f}" for k, v in c["by_group"].items() if v)
        return f"{c['total'] / MiB:.2f} ({parts})" if parts else "0"
    if "by_op" in c:
        return f"{c['total'] / MiB:.2f}"
    return "–"


def row_main(r, ref):
    if "error" in r:
        return f"| {r['label']} | failed: {r['error'][:200]} | | | | | | | | | |"
    med, spread, rounds = fmt_ms(r)
    ratio = "1.00" if r is ref or ref is None or "median_ms" not in ref else f"{r['median_ms'] / ref['median_ms']:.2f}"
    state = r["state_bytes"][-1] if r.get("state_bytes") else None
    if ref is None or r is ref or "losses" not in ref:
        agree = "(reference)" if r is ref else "–"
    else:
        d = max_rel_diff(r["losses"], ref["losses"])
        agree = f"{d:.1e} {'✓' if d <= TOLERANCE else '✗ diverges'}"
    return (f"| {r['label']} | {med} | {spread} | {rounds} | {ratio} | {mib(max(r['peak_rss_bytes']))} | "
            f"{mib(state)} | {comm(r)} | {r['losses'][-1]:.5f} | {agree} | {load(r)} |")


def main_table(runs):
    out = ["| system | ms/step | p25–p75 | rounds | ×mt | peak RSS MiB | state MiB | comm MiB/step | final loss | "
           "max rel. Δloss vs mt | other load |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    from suite import MAIN  # the suite's order, whatever order the runs were (re)done in
    order = {name: i for i, (name, _, _) in enumerate(MAIN)}
    configs = sorted(dict.fromkeys(r["config"] for r in runs), key=lambda c: order.get(c, len(order)))
    for c in configs:
        rows = [r for r in runs if r["config"] == c]
        ref = next((r for r in rows if r["label"] == "megatorch" and "error" not in r), None)
        out.append(f"| **{c}** | | | | | | | | | | |")
        out += [row_main(r, ref) for r in rows]
    return "\n".join(out)


def single_table(runs):
    from suite import MATMUL_RATE
    rate = next((r for r in runs if r["label"] == MATMUL_RATE and "error" not in r), None)
    runs = [r for r in runs if r["label"] != MATMUL_RATE]
    ref = next((r for r in runs if r["label"].startswith("megatorch") and "error" not in r), None)
    plain = next((r for r in runs if r["label"].startswith("plain LibTorch") and "error" not in r), None)
    out = ["| system | ms/step | p25–p75 | rounds | ×mt | peak RSS MiB | state MiB | final loss | "
           "max rel. Δloss vs mt | other load |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        if "error" in r:
            out.append(f"| {r['label']} | failed: {r['error'][:200]} | | | | | | | | |")
            continue
        med, spread, rounds = fmt_ms(r)
        ratio = f"{r['median_ms'] / ref['median_ms']:.2f}" if ref else "–"
        d = "(reference)" if r is ref else (f"{max_rel_diff(r['losses'], ref['losses']):.1e}" if ref else "–")
        out.append(f"| {r['label']} | {med} | {spread} | {rounds} | {ratio} | {mib(max(r['peak_rss_bytes']))} | "
                   f"{mib(r['state_bytes'][-1])} | {r['losses'][-1]:.5f} | {d} | {load(r)} |")
    if ref and plain:
        over = (ref["median_ms"] / plain["median_ms"] - 1) * 100
        out.append(f"\nOverhead of megatorch's machinery over the plain LibTorch model: {over:+.1f}% (goal ≤ 5%).")
    if ref and rate:
        achieved = rate["step_gflop"] / (ref["median_ms"] / 1e3)
        out.append(f"\nmegatorch's step: {achieved:.1f} model GFLOP/s ({rate['step_gflop']:.2f} GFLOP a step), "
                   f"{achieved / rate['shapes_gflops']:.0%} of the fp32 matmul rate at the step's own GEMM shapes "
                   f"({rate['shapes_gflops']:.1f} GFLOP/s) and {achieved / rate['square_gflops']:.0%} of a "
                   f"1024³ matmul's ({rate['square_gflops']:.1f} GFLOP/s), one thread (goal ≥ 80%).")
    return "\n".join(out)


def scaling_table(runs):
    out = ["| hidden | layers | parameters | megatorch ms/step | megatorch state MiB | megatorch peak RSS MiB | "
           "peer ms/step | peer peak RSS MiB | peer ×mt | other load |", "|---|---|---|---|---|---|---|---|---|---|"]
    from config import BenchConfig
    for name in dict.fromkeys(r["config"] for r in runs):
        h, L = (int(x[1:]) for x in name.split("_"))
        mt = next((r for r in runs if r["config"] == name and r["label"] == "megatorch"), {})
        peer = next((r for r in runs if r["config"] == name and r["label"] != "megatorch"), {})
        n = BenchConfig().with_(hidden_size=h, num_layers=L).parameter_count()
        cells = [str(h), str(L), f"{n / 1e6:.2f} M"]
        for r, keys in ((mt, ("ms", "state", "rss")), (peer, ("ms", "rss"))):
            for k in keys:
                if "median_ms" not in r:
                    cells.append("failed" if "error" in r else "–")
                elif k == "ms":
                    cells.append(f"{r['median_ms']:.0f}")
                elif k == "state":
                    cells.append(mib(r["state_bytes"][-1]))
                else:
                    cells.append(mib(max(r["peak_rss_bytes"])))
        cells.append(f"{peer['median_ms'] / mt['median_ms']:.2f}" if "median_ms" in peer and "median_ms" in mt else "–")
        cells.append(f"{100 * max(mt.get('other_load', 0), peer.get('other_load', 0)):.0f}%")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def bubble_table(runs):
    out = ["| p (ranks) | m | measured bubble | (p−1)/m | timeline | other load |", "|---|---|---|---|---|---|"]
    for r in runs:
        if "error" in r:
            out.append(f"| {r['config']} | {r['label']} | failed: {r['error'][:200]} | | | |")
        else:
            out.append(f"| {r['p']} | {r['m']} | {r['measured']:.3f} | {r['formula']:.3f} | {r['svg']} | {load(r)} |")
    return "\n".join(out)


def render(results) -> str:
    runs = merge_rounds(results["runs"])
    part = lambda p: [r for r in runs if r["part"] == p]  # noqa: E731
    sections = []
    if part("main"):
        sections.append("### Side by side, 4 ranks\n\n" + main_table(part("main")))
    if part("single"):
        sections.append("### Single process\n\n" + single_table(part("single")))
    if part("scaling"):
        sections.append("### Growth at TP2×DP2\n\n" + scaling_table(part("scaling")))
    if part("bubble"):
        sections.append("### Pipeline bubble (megatorch, 1F1B)\n\n" + bubble_table(part("bubble")))
    checks = results.get("checks", {}).get("main")
    if checks:
        sections.append("Same start for everyone: " + "; ".join(f"{k}: {v}" for k, v in checks.items()) + ".")
    notes = [f"- {r['config']} / {r['label']}: {r['exit_note']}" for r in results["runs"] if "exit_note" in r]
    notes += [f"- {r['config']} / {r['label']}: the rounds' losses differ (not repeatable)"
              for r in runs if r.get("repeatable") is False]
    if notes:
        sections.append("Notes:\n" + "\n".join(notes))
    return "\n\n".join(sections) + "\n"


if __name__ == "__main__":
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    with open(sys.argv[1]) as f:
        print(render(json.load(f)), end="")
