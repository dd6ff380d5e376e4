"""Pipeline schedules side by side on 4 CPU ranks (docs/pipeline.md, "Zero bubble:
measured"): megatorch's 1F1B, interleaved (v = 2), ZB-H1, ZB-V and DualPipeV next to
torch.distributed.pipelining's Schedule1F1B, ScheduleInterleaved1F1B,
ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble and ScheduleDualPipeV; megatorch's
each under Gloo's rules (one PP group, tags) and under NCCL's (MEGATORCH_NCCL_CHECK=1: every
transfer alone on its channel's communicator, pipeline/p2p_channels.h), still on Gloo.

    .venv/bin/python scripts/bench/pipeline_schedules.py [--out runs/pipeline_schedules] \\
        [--microbatches 4,8,16 --steps 5 --rounds 2 --rules gloo,nccl]

One GPT (8 layers, hidden 256, 8 heads, sequence 128, micro-batch 2, vocabulary 1024,
fp32), the same initial weights and micro-batches everywhere, forward and backward only,
p = 4 Gloo ranks with one intra-op thread each. megatorch runs build/bin/pipeline_timeline
(measured bubble from its timeline, the slowest rank's step time, the F / B / W costs
measured in the same run and the simulator's bubble for them); the peers run
peers/peer_zero_bubble.py (step time). Every run's loss must equal megatorch 1F1B's at the
same m (1e-5 relative): a fast wrong answer is reported as one. Each configuration runs
--rounds times, interleaved with the others; the table gives the median step time.

Writes OUT/results.json and OUT/report.md and prints the report. About 15 minutes on an
idle 2-core machine with the defaults; it waits first while the machine is busy.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE / "peers"))
from machine_load import OtherLoad, wait_until_idle  # noqa: E402

sys.path.insert(0, str(HERE))
from bench_util import cpu_name  # noqa: E402

MEGATORCH = [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 2), ("dualpipev", 2)]
TORCH = ["Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble",
         "ScheduleDualPipeV"]
P = 4


def run(cmd, out_json: Path, extra_env=None):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE / "peers"), **(extra_env or {}))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if done.returncode != 0 or not out_json.exists():
        # A rank's exception line ("[rank0]: ValueError: ..."), not the launcher's summary.
        lines = [l.split("]: ", 1)[-1].split("] ", 1)[-1] for l in (done.stdout + done.stderr).splitlines()
                 if l.startswith("[rank") and ("Error:" in l or "Exception:" in l or "megatorch:" in l)]
        return {"error": (lines[0] if lines else f"exit {done.returncode}")[:300]}
    return json.loads(out_json.read_text())


def torchrun(*args):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={P}", *args]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "runs" / "pipeline_schedules"))
    ap.add_argument("--microbatches", default="4,8,16")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rules", default="gloo,nccl", help="megatorch's posting: gloo (tags), nccl (channels)")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    timeline = Path(os.environ.get("MEGATORCH_BIN_DIR", ROOT / "build" / "bin")) / "pipeline_timeline"
    if not os.environ.get("MEGATORCH_BENCH_NO_WAIT"):
        wait_until_idle()
    records = []
    with OtherLoad() as other:
        for rnd in range(a.rounds):
            for m in [int(x) for x in a.microbatches.split(",")]:
                for schedule, v in MEGATORCH:
                    for rules in a.rules.split(","):
                        js = out / f"mt_{schedule}_{m}_{rnd}_{rules}.json"
                        js.unlink(missing_ok=True)
                        r = run(torchrun("--no-python", str(timeline), "--pipeline-model-parallel-size", str(P),
                                         "--num-microbatches", str(m), "--schedule", schedule,
                                         "--virtual-pipeline-model-parallel-size", str(v), "--steps", str(a.steps),
                                         "--json", str(js)), js, {"MEGATORCH_NCCL_CHECK": "1" if rules == "nccl" else "0"})
                        system = "megatorch" if rules == "gloo" else "megatorch, NCCL rules"
                        records.append({"system": system, "schedule": schedule, "m": m, "round": rnd, **r})
                        print(json.dumps(records[-1]), flush=True)
                for name in TORCH:
                    js = out / f"torch_{name}_{m}_{rnd}.json"
                    js.unlink(missing_ok=True)
                    r = run(torchrun(str(HERE / "peers" / "peer_zero_bubble.py"), "--schedule", name,
                                     "--num-microbatches", str(m), "--steps", str(a.steps), "--json", str(js)), js)
                    records.append({"system": "torch", "schedule": name, "m": m, "round": rnd, **r})
                    print(json.dumps(records[-1]), flush=True)
    result = {"cpu": cpu_name(), "p": P, "steps": a.steps, "rounds": a.rounds, "other_load": other.share,
              "records": records}
    (out / "results.json").write_text(json.dumps(result, indent=1))
    report = render(result)
    (out / "report.md").write_text(report)
    print(report)


def render(result) -> str:
    rows = {}
    for r in result["records"]:
        rows.setdefault((r["m"], r["system"], r["schedule"]), []).append(r)
    lines = [f"p = {result['p']} CPU ranks ({result['cpu']}), median of {result['rounds']} runs of "
             f"{result['steps']} steps; other processes used {result['other_load']:.0%} of the machine.", "",
             "| m | system | schedule | step (s) | vs megatorch 1F1B | measured bubble | simulated from measured "
             "F/B/W | F / B / W (ms) | loss |",
             "|---|---|---|---|---|---|---|---|---|"]
    for m in sorted({k[0] for k in rows}):
        ref_runs = rows.get((m, "megatorch", "1f1b"), [])
        ref_step = statistics.median(r["step_s"] for r in ref_runs if "step_s" in r) if ref_runs else None
        ref_loss = next((r["loss"] for r in ref_runs if "loss" in r), None)
        for (mm, system, schedule), runs in rows.items():
            if mm != m:
                continue
            ok = [r for r in runs if "step_s" in r]
            if not ok:
                lines.append(f"| {m} | {system} | {schedule} | failed: {runs[0].get('error', '?')} | | | | | |")
                continue
            step = statistics.median(r["step_s"] for r in ok)
            loss = ok[0]["loss"]
            same = ref_loss is not None and abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
            bubble = statistics.median(r["measured_bubble"] for r in ok) if "measured_bubble" in ok[0] else None
            sim = ok[0].get("predicted_bubble")
            cost = ok[0].get("cost_s", {})
            fbw = " / ".join(f"{cost[k] * 1e3:.1f}" for k in ("forward", "backward", "backward_input",
                                                                "backward_weight") if k in cost)
            lines.append(f"| {m} | {system} | {schedule} | {step:.3f} | "
                         f"{ref_step / step:.2f}x | " + (f"{bubble:.3f}" if bubble is not None else "") + " | " +
                         (f"{sim:.3f}" if sim is not None else "") + f" | {fbw} | {loss:.6f}" +
                         ("" if same else " (DIFFERS)") + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
