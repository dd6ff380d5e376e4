"""The Markdown report of scripts/bench/moe.py's JSON results: the dense-vs-MoE table, the two
dispatchers, the agreement checks and the kernel table."""
import re
import statistics

MiB = 1 << 20


def max_abs_diff(a, b):
    return max(abs(x - y) for x, y in zip(a, b)) if a and b and len(a) == len(b) else float("nan")


def fmt_ms(x: float) -> str:
    return f"{x:.2f}" if x < 10 else f"{x:.1f}"


def fmt_params(n: int) -> str:
    return f"{n / 1e6:.2f} M"


def render(res: dict) -> str:
    cfg, moe, runs = res["config"], res["moe"], res.get("runs", {})
    L = []
    if runs:
        L += [f"{res['date']}, {res['machine']['cpu']}, {res['machine']['cpus']} cores; "
              f"{'--quick; ' if res['quick'] else ''}{res['rounds']} round(s).", "",
              f"Model: {cfg['num_layers']} layers, hidden {cfg['hidden_size']}, {cfg['num_attention_heads']} heads, "
              f"sequence {cfg['seq_length']}, vocabulary {cfg['vocab_size']}, global batch {cfg['global_batch_size']} "
              f"({cfg['global_batch_size'] * cfg['seq_length']} tokens/step), micro-batch {cfg['micro_batch_size']}, "
              f"fp32, {cfg['warmup_steps'] + cfg['timed_steps']} iterations ({cfg['warmup_steps']} not timed). "
              f"Dense MLP width {moe['dense_ffn']}; MoE: {moe['experts']} experts, top-{moe['topk']}, expert width "
              f"{moe['moe_ffn']}, aux-loss coefficient {moe['aux_loss_coeff']}, every layer MoE, dropless.", ""]
    dense, moe_run = runs.get("dense_1"), runs.get("moe_1")
    if dense and moe_run and "error" not in dense and "error" not in moe_run:
        pd, pm = dense["parameters"], moe_run["parameters"]
        L += ["| parameters | total | active per token | of it MLP / experts + router, total | active |",
              "|---|---|---|---|---|",
              f"| dense | {fmt_params(pd['total'])} | {fmt_params(pd['active'])} | {fmt_params(pd['mlp_total'])} "
              f"| {fmt_params(pd['mlp_active'])} |",
              f"| MoE | {fmt_params(pm['total'])} | {fmt_params(pm['active'])} | {fmt_params(pm['mlp_total'])} "
              f"| {fmt_params(pm['mlp_active'])} |", ""]

    def ms(r):
        return f"{r['median_ms']:.1f} ({r['p25_ms']:.1f}–{r['p75_ms']:.1f})"

    def ok(k):
        return k in runs and "error" not in runs[k]

    def val(r):
        return f"{r['val_loss']:.4f}" if r.get("val_loss") is not None else "–"

    # (a) dense against MoE
    pairs = [(d, m) for d, m in (("dense_1", "moe_1"), ("dense_dp4", "moe_ep4"), ("dense_dp2", "moe_ep2"),
                                 ("dense_tp2dp2_sp", "moe_ep2tp2dp2_sp")) if d in runs and m in runs]
    if "dense" in res["parts"] and pairs:
        L += ["**Dense against MoE of equal active parameters** (ms/step: median (p25–p75); "
              "state: parameters + gradients + AdamW bytes of the logging rank):", "",
              "| ranks | dense layout | MoE layout | dense ms/step | MoE ms/step | MoE ÷ dense time | dense tokens/s "
              "| MoE tokens/s | loss, last step: dense / MoE | mean of last 5: MoE − dense "
              "| validation loss: dense / MoE | state MiB/rank dense / MoE |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for d, m in pairs:
            if not (ok(d) and ok(m)):
                L.append(f"| {runs[d]['spec']['world']} | {d} | {m} | failed: "
                         f"{runs[d].get('error') or runs[m].get('error')} |" + " |" * 8)
                continue
            rd, rm = runs[d], runs[m]
            tail = (statistics.mean(rm["losses"][-5:]) - statistics.mean(rd["losses"][-5:]))
            L.append(f"| {rd['spec']['world']} | {rd['layout']} | {rm['layout']} | {ms(rd)} | {ms(rm)} "
                     f"| {rm['median_ms'] / rd['median_ms']:.2f} | {rd['tokens_per_s']:.0f} | {rm['tokens_per_s']:.0f} "
                     f"| {rd['losses'][-1]:.4f} / {rm['losses'][-1]:.4f} | {tail:+.4f} | {val(rd)} / {val(rm)} "
                     f"| {rd['state_bytes_per_rank'] / MiB:.1f} / {rm['state_bytes_per_rank'] / MiB:.1f} |")
        L.append("")

    # (b) the dispatchers
    eps = [int(k[len("moe_ep"):-len("_allgather")]) for k in runs if re.fullmatch(r"moe_ep\d+_allgather", k)]
    if "dispatcher" in res["parts"] and eps:
        L += ["**Token dispatchers** (the same MoE, same seed; EP over DP, world = EP; ep bytes: the log's "
              "`comm_bytes.ep` per step, median over steps, comm_stats.h's convention):", "",
              "| EP | alltoall ms/step | allgather ms/step | allgather ÷ alltoall time | alltoall tokens/s "
              "| allgather tokens/s | alltoall ep MiB/step | allgather ep MiB/step | bytes ratio "
              "| max abs loss diff allgather vs alltoall, every step |",
              "|---|---|---|---|---|---|---|---|---|---|"]
        for ep in sorted(eps):
            a, g = f"moe_ep{ep}", f"moe_ep{ep}_allgather"
            if not (ok(a) and ok(g)):
                L.append(f"| {ep} | failed: {runs.get(a, {}).get('error') or runs.get(g, {}).get('error')} |" + " |" * 8)
                continue
            ra, rg = runs[a], runs[g]
            ba, bg = ra["comm_bytes_per_step"].get("ep", 0), rg["comm_bytes_per_step"].get("ep", 0)
            L.append(f"| {ep} | {ms(ra)} | {ms(rg)} | {rg['median_ms'] / ra['median_ms']:.2f} | {ra['tokens_per_s']:.0f} "
                     f"| {rg['tokens_per_s']:.0f} | {ba / MiB:.2f} | {bg / MiB:.2f} | {bg / ba if ba else float('nan'):.2f} "
                     f"| {max_abs_diff(ra['losses'], rg['losses']):.1e} |")
        L.append("")

    # (c) grouped GEMM against the loop, end to end
    loops = [k for k in runs if k.endswith("_loop")]
    if "gemm" in res["parts"] and loops:
        L += ["**Grouped GEMM against the per-expert loop, end to end** (`--no-moe-grouped-gemm`):", "",
              "| experts | layout | local experts/rank | grouped ms/step | loop ms/step | loop ÷ grouped time "
              "| grouped tokens/s | loop tokens/s | max abs loss diff |",
              "|---|---|---|---|---|---|---|---|---|"]
        for k in loops:
            g = k[:-len("_loop")]
            if not (ok(k) and ok(g)):
                L.append(f"| {k} | failed: {runs.get(k, {}).get('error') or runs.get(g, {}).get('error')} |" + " |" * 7)
                continue
            rl, rg = runs[k], runs[g]
            e = rg["spec"]["experts"] or moe["experts"]
            L.append(f"| {e} | {rg['layout']} | {e // rg['spec']['ep']} | {ms(rg)} | {ms(rl)} "
                     f"| {rl['median_ms'] / rg['median_ms']:.2f} | {rg['tokens_per_s']:.0f} | {rl['tokens_per_s']:.0f} "
                     f"| {max_abs_diff(rl['losses'], rg['losses']):.1e} |")
        L.append("")

    # the kernel
    kernel = res.get("kernel")
    if kernel:
        L += [f"**kernels::grouped_gemm by itself** (one projection, {kernel['rows']} rows = token-expert pairs, "
              f"input [rows, h] x weight [E, h, F], fp32, one thread, torch {kernel['torch']}; median of "
              + (f"{kernel['iters']} to 50 interleaved calls per path (more while the slower path's add up to "
                 f"less than {kernel['budget_ms']:g} ms)" if kernel.get("budget_ms") else
                 f"{kernel['iters']} interleaved calls per path")
              + "; ratio > 1: grouped faster):", "",
              "| E | h | F | counts | mode | GFLOP | megatorch grouped ms | megatorch loop ms | loop ÷ grouped "
              "| torch._grouped_mm ms | split/unbind loop ms | loop ÷ grouped |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for c in kernel["cases"]:
            counts = "balanced" if not c["skewed"] else f"skewed (max {c['max_count']}, {c['empty_groups']} empty)"
            if c["megatorch_loop_ms"] is None:
                mloop, mratio = "not run¹", "–"
            else:
                mloop = fmt_ms(c["megatorch_loop_ms"])
                mratio = f"{c['megatorch_loop_ms'] / c['megatorch_grouped_ms']:.2f}"
            L.append(f"| {c['experts']} | {c['h']} | {c['F']} | {counts} | {'fwd+bwd' if c['mode'] == 'fwdbwd' else 'fwd'} "
                     f"| {c['gflop']:.2f} | {fmt_ms(c['megatorch_grouped_ms'])} | {mloop} | {mratio} "
                     f"| {fmt_ms(c['torch_grouped_mm_ms'])} | {fmt_ms(c['torch_loop_ms'])} "
                     f"| {c['torch_loop_ms'] / c['torch_grouped_mm_ms']:.2f} |")
        if any(c["megatorch_loop_ms"] is None for c in kernel["cases"]):
            L.append(f"\n¹ not run: the loop's backward would hold about twice the [E, h, F] weight "
                     f"(2 E h F × 4 bytes > {kernel['loop_backward_limit_gib']} GiB).")
        L.append("")

    # the checks
    cks = res.get("checks", [])
    if cks:
        n = res.get("check_steps", 10)
        L += [f"Loss agreement of runs that train the same model (checked: max relative difference over the first "
              f"{n} steps ≤ {res['tolerance']:g}; the rounds must repeat every loss bit for bit):", "",
              f"| check | first {n} steps, max rel. | every step, max rel. | every step, max abs. "
              "| routing first differs at step | ok |",
              "|---|---|---|---|---|---|"]
        for c in cks:
            if "max_rel_loss_diff_all_steps" in c:
                step = c["routing_first_differs_at_step"]
                L.append(f"| {c['check'].rsplit(',', 1)[0]} | {c['max_rel_loss_diff']:.1e} "
                         f"| {c['max_rel_loss_diff_all_steps']:.1e} | {c['max_abs_loss_diff_all_steps']:.1e} "
                         f"| {step if step else 'never'} | {'yes' if c['ok'] else '**NO**'} |")
        for c in cks:
            if "max_rel_loss_diff_all_steps" not in c:
                detail = ", ".join(f"{k} {v:.1e}" if isinstance(v, float) else f"{k} {v}"
                                   for k, v in c.items() if k not in ("check", "ok"))
                L.append(f"- {'ok' if c['ok'] else '**FAILED**'}: {c['check']} ({detail})")
        L.append("")
    loads = [f"{k} {r.get('other_load', 0):.0%}" for k, r in runs.items() if "other_load" in r]
    if loads:
        L.append("Other processes' largest share of the machine during a run: " + ", ".join(loads))
    cmds = [(k, r["command"]) for k, r in runs.items() if "command" in r]
    if cmds:
        L += ["", "Commands (round 1; each also with `--log-json FILE`):", ""]
        L += [f"    # {k}\n    {c}" for k, c in cmds]
    return "\n".join(L) + "\n"
