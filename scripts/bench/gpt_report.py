"""What scripts/bench/gpu_gpt.py derives from its rows, and its markdown: MFU, speed-ups,
the first-step loss check across the implementations of a size, the `goal` block, and the
tables (rows, sync check, profile, goal)."""
import json
from pathlib import Path

import gpt_profile
from gpt_measure import sig

COMPARED = ("eager", "compile", "mcore", "torchtitan")
# The goal (docs/benchmarks_gpu.md): megatorch's model driven from Python, and gpt_pretrain,
# against the datasheet and against PyTorch eager and torch.compile on the same model and GPU.
GOAL_TARGETS = {"mfu_datasheet": 0.55, "vs_eager_tokens": 1.05, "vs_compile_tokens": 1.0}
MFU_GOAL_SIZE = "1.3B"   # the MFU target is for GPT 1.3B in bf16; the Llama size has the ratios only
# First-step losses of one size agree to this (the same weights and tokens; bf16 rounding differs
# between implementations, fp32 barely).
SAME_START_RTOL = {"bfloat16": 2e-2, "float16": 2e-2, "float32": 1e-4}


def derive(rows: dict, matmul_tflops: float, datasheet: float, device, dtype: str, order=()) -> dict:
    """Adds MFU and the ratios to the megatorch rows; returns the per-size first-step loss check
    (sizes in `order`, then any other)."""
    for r in rows.values():
        if r.get("status") != "ok":
            continue
        r["mfu_vs_matmul"] = sig(r["tflops"] / matmul_tflops) if matmul_tflops else None
        r["mfu_vs_datasheet"] = sig(r["tflops"] / datasheet) if device == "cuda" else None
    same_start = {}
    rtol = SAME_START_RTOL.get(dtype, 2e-2)
    for size in dict.fromkeys([*order, *(s for s, _ in rows)]):
        mt = rows.get((size, "megatorch"), {})
        if mt.get("status") != "ok":
            continue
        diffs = {}
        for impl in COMPARED:
            other = rows.get((size, impl), {})
            if other.get("status") == "ok":
                mt[f"speedup_vs_{impl}"] = round(mt["tokens_per_s"] / other["tokens_per_s"], 3)
                d = abs(other["loss_first"] - mt["loss_first"]) / max(abs(mt["loss_first"]), 1e-12)
                other["loss_first_rel_diff"] = float(f"{d:.2e}")
                diffs[impl] = other["loss_first_rel_diff"]
        same_start[size] = {"megatorch": mt["loss_first"], "rel_diff": diffs, "rtol": rtol,
                            "same": all(d <= rtol for d in diffs.values()) if diffs else None}
        # FP8 (docs/fp8.md): megatorch's FP8 row over its bf16 row (goal >= 1.3) and over
        # torchao's float8 on the eager model (goal >= 1.0). Not in same_start: quantisation
        # moves the first loss.
        fp8 = rows.get((size, "megatorch_fp8"), {})
        if fp8.get("status") == "ok":
            fp8["speedup_vs_megatorch_bf16"] = round(fp8["tokens_per_s"] / mt["tokens_per_s"], 3)
            peer = rows.get((size, "torchao_fp8"), {})
            if peer.get("status") == "ok":
                fp8["speedup_vs_torchao_fp8"] = round(fp8["tokens_per_s"] / peer["tokens_per_s"], 3)
    return same_start


PRETRAIN_KEYS = {"gpt": ("gpt_1p3b", "1.3B"), "llama": ("llama_1b", "llama-1B")}  # gpu_pretrain.py's rows


def read_pretrain(path, arch="gpt"):
    """gpu_pretrain.py's row of `arch` (the trainer's own log), or (None, why)."""
    key, name = PRETRAIN_KEYS[arch]
    if not path:
        return None, "no --pretrain-json given"
    p = Path(path)
    if not p.exists():
        return None, f"{p.name} not found (the pretrain step did not write it)"
    try:
        g = json.loads(p.read_text()).get(key)
    except (OSError, ValueError) as e:
        return None, f"{p.name} unreadable: {e}"
    if g is None:
        return None, f"{p.name} has no {key} row"
    if g.get("skipped"):
        return None, f"gpt_pretrain {name} skipped: {g['skipped']}"
    if not g.get("ok"):
        return None, f"gpt_pretrain {name} failed: {str(g.get('error', ''))[-160:]}"
    return g, None


def goals(rows: dict, chosen, sizes: dict, dtype: str, device: str, pretrain_json=None) -> dict:
    """The goal block: for megatorch from Python (and gpt_pretrain, from pretrain.json) at the
    first GPT size and the first Llama size: the value of each target and whether it was
    reached (None when a row or value is missing)."""
    out = {"targets": dict(GOAL_TARGETS),
           "mfu_target_applies_to": f"GPT {MFU_GOAL_SIZE} in bf16 (the Llama size: the ratios only)",
           "entries": {}}
    if device != "cuda":
        out["note"] = "CPU fallback: computed to test the code; the numbers are not GPU numbers"
    firsts = {}
    for s in chosen:
        firsts.setdefault(sizes[s]["arch"], s)
    for arch, size in firsts.items():
        targets = dict(GOAL_TARGETS)
        if not (size == MFU_GOAL_SIZE and dtype == "bfloat16"):
            targets.pop("mfu_datasheet")
        eager, comp = rows.get((size, "eager"), {}), rows.get((size, "compile"), {})
        paths = {"megatorch_python": rows.get((size, "megatorch"), {})}
        missing = {}
        pretrain, why_not = read_pretrain(pretrain_json, arch) if arch in PRETRAIN_KEYS else (None, None)
        if pretrain is not None and size == PRETRAIN_KEYS[arch][1]:
            paths["gpt_pretrain"] = {"status": "ok", "tokens_per_s": pretrain["tokens_per_s"],
                                     "mfu_vs_datasheet": pretrain.get("mfu_datasheet"),
                                     "micro_batch": pretrain.get("micro_batch")}
        else:
            paths["gpt_pretrain"] = {}
            missing["gpt_pretrain"] = why_not or f"gpu_pretrain.py measures {PRETRAIN_KEYS.get(arch, ('', '?'))[1]} only"
        for path, r in paths.items():
            ok = r.get("status") == "ok"
            vals = {"mfu_datasheet": r.get("mfu_vs_datasheet") if ok else None,
                    "vs_eager_tokens": (round(r["tokens_per_s"] / eager["tokens_per_s"], 3)
                                        if ok and eager.get("status") == "ok" else None),
                    "vs_compile_tokens": (round(r["tokens_per_s"] / comp["tokens_per_s"], 3)
                                          if ok and comp.get("status") == "ok" else None)}
            entry = {"size": size, "arch": arch, **vals,
                     "reached": {k: (None if vals[k] is None else vals[k] >= t) for k, t in targets.items()}}
            if path == "gpt_pretrain" and ok:
                entry["micro_batch"] = r.get("micro_batch")
                entry["source"] = (f"pretrain.json {PRETRAIN_KEYS[arch][0]} (gpt_pretrain's own log), ratios against "
                                   "this run's rows")
            if not ok:
                entry["missing"] = missing.get(path) or f"the {size} megatorch row: {r.get('status', 'not run')}"
            else:
                why = [f"{name} row: {peer.get('status', 'not run')}"
                       for name, peer in (("eager", eager), ("compile", comp)) if peer.get("status") != "ok"]
                if "mfu_datasheet" in targets and vals["mfu_datasheet"] is None:
                    why.append("no datasheet MFU (not a GPU run)")
                if why:
                    entry["missing"] = "; ".join(why)
            out["entries"][f"{path}:{size}"] = entry
    flags = [v for e in out["entries"].values() for v in e["reached"].values()]
    out["all_reached"] = None if any(v is None for v in flags) or not flags else all(flags)
    out["count"] = {"reached": flags.count(True), "not_reached": flags.count(False),
                    "unknown": sum(v is None for v in flags)}
    return out


def _pct(x):
    return f"{100 * x:.1f}%" if x is not None else "–"


def markdown(result, no_gpu_message: str) -> str:
    lines = []
    head = result.get("gpu_name") or "CPU"
    mm = result["matmul"]
    archs = ", ".join(result["archs"])
    lines.append(f"{head}, torch {result['torch']}, {archs}, {result['dtype']}; "
                 f"{mm['dtype']} matmul rate measured in this run {mm['tflops']:.0f} TFLOP/s, "
                 f"datasheet {result['datasheet_tflops']:.0f} TFLOP/s" if result["gpu"] else
                 f"CPU fallback ({no_gpu_message}); {archs}, {result['dtype']}; "
                 f"{mm['dtype']} matmul rate {mm['tflops']:.3g} TFLOP/s")
    for arch, p in (result.get("parity") or {}).items():
        text = (f"{p['megatorch']:.6g} vs {p['reference']:.6g}, rel. diff {p['rel_diff']:.2e}" if "rel_diff" in p
                else p.get("error", "?"))
        lines.append(f"Same model ({arch}): megatorch and the plain PyTorch model, same weights (fp32, toy shape): "
                     f"{text}")
    lines += ["", "| model | implementation | micro-batch | tokens/s | TFLOP/s | MFU (measured matmul) | "
                  "MFU (datasheet) | peak memory GiB | step ms | first-step loss | notes |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if r.get("status") != "ok":
            why = r.get("error", "").replace("|", "/")
            lines.append(f"| {r['size']} | {r['impl']} | – | – | – | – | – | – | – | – | "
                         f"{r['status']}: {why[:160]} |")
            continue
        mem = r.get("peak_memory_gib", r.get("peak_rss_gib"))
        extra = []
        for impl in (*COMPARED, "megatorch_bf16", "torchao_fp8"):
            if f"speedup_vs_{impl}" in r:
                extra.append(f"x{r[f'speedup_vs_{impl}']:.2f} vs {impl}")
        if r.get("oom_retries"):
            extra.append(f"{r['oom_retries']} OOM halvings")
        loss = f"{r['loss_first']:.5g}"
        if "loss_first_rel_diff" in r:
            loss += f" ({r['loss_first_rel_diff']:.1e})"
        lines.append(f"| {r['size']} ({r['params'] / 1e6:.4g}M) | {r['impl']} | {r['micro_batch']} | "
                     f"{r['tokens_per_s']:.0f} | {r['tflops']:.3g} | {_pct(r.get('mfu_vs_matmul'))} | "
                     f"{_pct(r.get('mfu_vs_datasheet'))} | {mem if mem is not None else '–'} | {r['step_ms']:.1f} | "
                     f"{loss} | {', '.join(extra)} |")
    lines.append("\nFirst-step loss: the same weights and tokens in every row of a size; in brackets the relative "
                 "difference from megatorch's.")
    same = result.get("same_start") or {}
    for size, s in same.items():
        lines.append(f"- {size}: {'same' if s['same'] else 'DIFFERENT' if s['same'] is False else 'nothing to compare'}"
                     f" start (tolerance {s['rtol']:g}): {s['rel_diff']}")

    checks = [r for r in result["rows"] if r.get("sync_check")]
    if checks:
        lines += ["", "Sync check (torch.cuda.set_sync_debug_mode(\"error\") around the steps after the warm-up; "
                      "one more step under \"warn\" counts them by phase):", "",
                  "| model | implementation | steps | device-to-host sync | first (step, phase, where: message) | "
                  "syncs per phase (warn step) |", "|---|---|---|---|---|---|"]
        for r in checks:
            c = r["sync_check"]
            if "status" in c:
                lines.append(f"| {r['size']} | {r['impl']} | – | {c['status']} | – | – |")
                continue
            f = c.get("first")
            first = (f"step {f['step']}, {f['phase']}, {f['where'] or '?'}: {f['message'][:120]}".replace("|", "/")
                     if f else "–")
            lines.append(f"| {r['size']} | {r['impl']} | {c['steps'][0]}-{c['steps'][-1]} | "
                         f"{'yes, ' + str(c['steps_with_sync']) + ' steps' if c['synchronized'] else 'none'} | "
                         f"{first} | {c.get('warn_step_syncs_by_phase') or 'none'} |")

    prof = result.get("profile")
    if prof and prof.get("impls"):
        lines += [""] + gpt_profile.markdown(prof["impls"], prof["size"])

    goal = result.get("goal")
    if goal:
        t = goal["targets"]
        lines += ["", f"Goal (targets: MFU {_pct(t['mfu_datasheet'])} of the datasheet at {MFU_GOAL_SIZE} bf16, "
                      f"tokens/s x{t['vs_eager_tokens']} of eager, x{t['vs_compile_tokens']} of torch.compile; "
                      f"all reached: {goal['all_reached']}; {goal['count']})"
                      f"{' — ' + goal['note'] if goal.get('note') else ''}:", "",
                  "| path | model | MFU (datasheet) | vs eager | vs torch.compile | reached | missing |",
                  "|---|---|---|---|---|---|---|"]
        for key, e in goal["entries"].items():
            ratio = lambda v: f"x{v:.3f}" if v is not None else "–"  # noqa: E731
            lines.append(f"| {key.split(':')[0]} | {e['size']} | {_pct(e['mfu_datasheet'])} | "
                         f"{ratio(e['vs_eager_tokens'])} | {ratio(e['vs_compile_tokens'])} | "
                         f"{', '.join(f'{k}: {v}' for k, v in e['reached'].items())} | "
                         f"{e.get('missing', '').replace('|', '/')[:120]} |")
    return "\n".join(lines)
