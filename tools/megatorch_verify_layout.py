#!@MEGATORCH_PYTHON@
"""megatorch-verify-layout: checks, before a GPU job, that a gpt_pretrain layout computes what
one rank computes.

    build/bin/megatorch-verify-layout [--steps 3] [--data-parallel-size D] [--tolerance 1e-4] \\
        -- <gpt_pretrain flags>

Runs a shrunk copy of the model the flags describe (the same structure: layers per stage and
per virtual stage, attention kind, normalization, experts, schedule, ZeRO stage, recompute,
sequence and context parallelism; fewer layers, hidden 8 per head, a short sequence, the
bundled data and its 257-token vocabulary, fp32) at the flags' TP x PP x CP x EP x DP layout
on Gloo CPU ranks under the NCCL-semantics check (MEGATORCH_NCCL_CHECK=1: every rank's
collectives and transfers replayed under NCCL's rules), and the same model on one rank. Prints
the loss and gradient-norm difference per step, and for every parameter the largest
difference of its value after the last step and of the gradient that step applied (both
runs' final checkpoints, saved with --save-grads, read whole in one process). Exits 1 when a
loss or gradient norm differs by more than --tolerance, or a parameter or gradient by more
than --tensor-tolerance (relative to its largest magnitude), 2 when a run fails (the NCCL
check's report, a refused layout).

Adam normalizes each gradient by its own running magnitude, so a gradient that is rounding
noise (an attention key bias's, exactly zero in exact arithmetic) moves its parameter by
about the learning rate in a direction the rounding decides: such parameters differ between
any two layouts by up to lr x steps, which --tensor-tolerance allows for a few steps.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

BIN = Path(__file__).resolve().parent
SOURCE = Path("@PROJECT_SOURCE_DIR@")
DATA = SOURCE / "data" / "default" / "stdlib_docs_text_document"

# Flags the shrunk copy sets itself (their values dropped), and switches it drops.
RESIZED = {"--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads", "--num-query-groups",
           "--kv-channels", "--seq-length", "--max-position-embeddings", "--vocab-size", "--micro-batch-size",
           "--global-batch-size", "--train-iters", "--train-samples", "--lr-warmup-iters", "--lr-warmup-fraction",
           "--lr-decay-iters", "--eval-iters", "--eval-interval", "--log-interval", "--save", "--load",
           "--save-interval", "--data-path", "--split", "--tokenizer-type", "--tokenizer-model", "--vocab-file",
           "--merge-file", "--log-json", "--timeline", "--moe-ffn-hidden-size", "--seed", "--device",
           "--distributed-backend", "--num-layers-per-virtual-pipeline-stage", "--fp8-format", "--fp8-recipe",
           "--fp8-amax-history-len", "--fp8-amax-compute-algo", "--fp8-margin", "--num-layers-at-start-in-bf16",
           "--num-layers-at-end-in-bf16", "--data-cache-path"}
DROPPED_SWITCHES = {"--bf16", "--fp16", "--first-last-layers-bf16", "--finetune", "--no-load-rng", "--eval-only",
                    "--no-load-optim"}
# What the one-rank reference leaves out: the layout itself.
LAYOUT = {"--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
          "--expert-model-parallel-size", "--expert-tensor-parallel-size", "--schedule", "--zero-stage",
          "--cp-comm-type"}
LAYOUT_SWITCHES = {"--sequence-parallel", "--use-distributed-optimizer"}


def parse_flags(argv):
    """[(flag, value or None)] in order: a flag takes the next token unless it starts with --."""
    out, i = [], 0
    while i < len(argv):
        flag = argv[i]
        if not flag.startswith("--"):
            raise SystemExit(f"megatorch-verify-layout: expected a gpt_pretrain flag, got '{flag}'")
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out.append((flag, argv[i + 1]))
            i += 2
        else:
            out.append((flag, None))
            i += 1
    return out


def value(flags, name, default=None, kind=int):
    found = [v for f, v in flags if f == name]
    return kind(found[-1]) if found else default


def lcm(a, b):
    return a * b // math.gcd(a, b)


def shrunk(flags, steps, dp):
    """The shrunk copy's flags at the layout (layout=True) and for one rank."""
    tp, pp = value(flags, "--tensor-model-parallel-size", 1), value(flags, "--pipeline-model-parallel-size", 1)
    cp = value(flags, "--context-parallel-size", 1)
    ep, etp = value(flags, "--expert-model-parallel-size", 1), value(flags, "--expert-tensor-parallel-size", 1)
    schedule = value(flags, "--schedule", "1f1b", str)
    per_virtual = value(flags, "--num-layers-per-virtual-pipeline-stage")
    layers = value(flags, "--num-layers", 2)
    while (tp * cp * dp) % (ep * etp):
        dp *= 2  # the experts fold into the stage's TP x CP x DP ranks
    kept = [(f, v) for f, v in flags if f not in RESIZED and f not in DROPPED_SWITCHES]
    heads = 2 * tp * cp
    size = ["--num-attention-heads", str(heads), "--hidden-size", str(8 * heads), "--ffn-hidden-size",
            str(32 * heads), "--seq-length", str(8 * lcm(2 * cp, tp) * 2)]
    if value(flags, "--num-query-groups") is not None:
        size += ["--num-query-groups", str(tp)]
    if value(flags, "--moe-ffn-hidden-size") is not None:
        size += ["--moe-ffn-hidden-size", str(16 * heads)]
    if per_virtual:
        vp = max(1, layers // (pp * per_virtual))
        size += ["--num-layers", str(pp * vp), "--num-layers-per-virtual-pipeline-stage", "1"]
    elif schedule in ("zb-v", "dualpipev"):
        size += ["--num-layers", str(2 * pp)]
    else:
        size += ["--num-layers", str(pp if pp > 1 else 2)]
    microbatches = 2 * pp if pp > 1 else 2
    common = [*size, "--micro-batch-size", "1", "--global-batch-size", str(dp * microbatches), "--train-iters",
              str(steps), "--lr-warmup-iters", "0", "--log-interval", "1", "--eval-iters", "0", "--seed", "1234",
              "--data-path", str(DATA), "--device", "cpu", "--save-interval", str(steps)]
    flat = [x for f, v in kept for x in ((f,) if v is None else (f, v))]
    single = [x for f, v in kept if f not in LAYOUT and f not in LAYOUT_SWITCHES
              for x in ((f,) if v is None else (f, v))]
    return tp * pp * cp * dp, [*flat, *common], [*single, *common, "--zero-stage", "0"]


def run(nproc, flags, workdir, name):
    log, ckpt = workdir / f"{name}.json", workdir / f"{name}_ckpt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "--no-python", str(BIN / "gpt_pretrain"), *flags, "--log-json", str(log), "--save", str(ckpt),
           "--save-grads"]
    env = dict(os.environ, OMP_NUM_THREADS="1", MEGATORCH_NCCL_CHECK="1")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        # Every rank says the same: each line once.
        lines = list(dict.fromkeys(l for l in (done.stdout + done.stderr).splitlines() if "megatorch" in l or "Error" in l))
        print(f"{name} run failed (exit {done.returncode}):\n  " + "\n  ".join(lines[-12:]), file=sys.stderr)
        print("command: " + " ".join(cmd), file=sys.stderr)
        sys.exit(2)
    records = {}
    for line in log.read_text().splitlines():
        r = json.loads(line)
        if "loss" in r:
            records[r["iteration"]] = r
    return records, ckpt


def tensors(ckpt, prefix):
    """The checkpoint's tensors under `prefix`, whole, by the rest of their key."""
    import megatorch.cpp as mt
    return {k[len(prefix):]: t.float() for k, t in mt.read_checkpoint_tensors(str(ckpt), prefix).items()}


def relative(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def main():
    ap = argparse.ArgumentParser(prog="megatorch-verify-layout", description=__doc__.split("\n\n")[0],
                                 usage="megatorch-verify-layout [options] -- <gpt_pretrain flags>")
    ap.add_argument("--steps", type=int, default=3, help="training steps of each run (default 3)")
    ap.add_argument("--data-parallel-size", type=int, default=None,
                    help="DP ranks next to the flags' TP x PP x CP (default: 2 with --zero-stage > 0, else 1)")
    ap.add_argument("--tolerance", type=float, default=1e-4,
                    help="largest relative difference of a loss or a gradient norm (default 1e-4)")
    ap.add_argument("--tensor-tolerance", type=float, default=1e-3,
                    help="largest difference of a parameter or its gradient, relative to its largest magnitude "
                         "(default 1e-3)")
    ap.add_argument("--keep", metavar="DIR", help="keep the runs' logs and checkpoints in DIR")
    argv = sys.argv[1:]
    own, flags = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    a = ap.parse_args(own)
    if a.steps < 1:
        ap.error(f"expected --steps >= 1, got {a.steps}")
    user = parse_flags(flags)
    dp = a.data_parallel_size or (2 if value(user, "--zero-stage", 0) > 0 else 1)
    world, layout, single = shrunk(user, a.steps, dp)
    workdir = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="megatorch_verify_"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"layout run: {world} Gloo ranks under the NCCL check: gpt_pretrain {' '.join(layout)}")
    got, got_ckpt = run(world, layout, workdir, "layout")
    print(f"reference: one rank: gpt_pretrain {' '.join(single)}")
    ref, ref_ckpt = run(1, single, workdir, "single")
    worst, worst_tensor = 0.0, 0.0
    print(f"\n{'step':>4}  {'loss (layout)':>14}  {'loss (1 rank)':>14}  {'rel. diff':>9}  {'grad norm rel. diff':>19}")
    for it in sorted(ref):
        l, r = got[it], ref[it]
        dl, dg = relative(l["loss"], r["loss"]), relative(l["grad_norm"], r["grad_norm"])
        worst = max(worst, dl, dg)
        print(f"{it:>4}  {l['loss']:>14.8f}  {r['loss']:>14.8f}  {dl:>9.2e}  {dg:>19.2e}")
    params = tensors(got_ckpt, "model/"), tensors(ref_ckpt, "model/")
    grads = tensors(got_ckpt, "optim/grad/"), tensors(ref_ckpt, "optim/grad/")
    print(f"\nafter step {a.steps}, largest |difference| (relative to the largest |value|):")
    print(f"  {'parameter':<44} {'value':>21}  {'gradient of the step':>21}")
    for name, ref_p in params[1].items():
        row = []
        for mine, theirs in (params, grads):
            if name not in theirs:
                row.append(f"{'-':>21}")  # no gradient: not a trained parameter
                continue
            d = (mine[name] - theirs[name]).abs().max().item()
            rel = d / max(theirs[name].abs().max().item(), 1e-30)
            worst_tensor = max(worst_tensor, rel)
            row.append(f"{d:>10.3e} ({rel:.2e})")
        print(f"  {name:<44} {row[0]}  {row[1]}")
    ok = worst <= a.tolerance and worst_tensor <= a.tensor_tolerance
    print(f"\n{'same' if ok else 'DIFFERENT'}: losses and gradient norms within {worst:.2e} (tolerance "
          f"{a.tolerance:g}), parameters and gradients within {worst_tensor:.2e} (tolerance {a.tensor_tolerance:g}); "
          "NCCL check: passed on every step")
    if not a.keep:
        print(f"(runs in {workdir})")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
