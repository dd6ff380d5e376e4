"""Runs one of the examples under torchrun, as CTest's example_* tests do:

    python tests/python/examples/check_example.py {bert_classifier,vit,custom_loop} BINARY

First the same iterations on one rank and at TP2 x PP2 (4 ranks), fp32 and no dropout:
every iteration's loss must agree within 1e-5 (|ref| + max |ref|), max over the compared
iterations (tests/python/tolerance.py: the model starts from the same numbers and sees
the same batches at every layout; only the summation order differs). Then the example's
main configuration: the BERT classifier at TP2 x PP2 to a held-out accuracy clearly above chance (and its checkpoint,
saved at TP2 x PP2, resumed on one rank as if uninterrupted), the ViT at TP2 x DP2
with ZeRO-3 (its losses equal to one rank's with the same global batch, and above-chance
accuracy), the GPT loop at PP2 x DP2 with ZeRO-1 and dropout, whose loss must fall."""
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/python: run as a script
from tolerance import close_report  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
DATA = ROOT / "data" / "default" / "stdlib_docs_text_document"
RTOL = 1e-5  # |got - ref| <= RTOL (|ref| + max |ref|) over an example's losses


def run(exe, nproc, args, log):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "--no-python", str(exe), *args, "--log-json", str(log)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.setdefault("MEGATORCH_COMM_TIMEOUT_S", "60")
    start = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    seconds = time.monotonic() - start
    print(f"$ {' '.join(cmd[2:])}\n  exit {out.returncode} after {seconds:.1f} s", flush=True)
    if out.returncode != 0:
        sys.exit(f"FAILED: {' '.join(cmd)}\n--- stdout ---\n{out.stdout[-4000:]}\n--- stderr ---\n{out.stderr[-4000:]}")
    return out.stdout


def losses(log):
    rows = [json.loads(line) for line in Path(log).read_text().splitlines() if line.strip()]
    return {r["iteration"]: r["loss"] for r in rows}


def compare(name, ref, got, iters):
    assert sorted(ref)[:iters] == list(range(1, iters + 1)), f"{name}: reference iterations {sorted(ref)}"
    assert sorted(got)[:iters] == list(range(1, iters + 1)), f"{name}: iterations {sorted(got)}"
    its = range(1, iters + 1)
    worst = max(abs(ref[i] - got[i]) for i in its)
    report = close_report([got[i] for i in its], [ref[i] for i in its], RTOL)
    assert report is None, f"{name}: losses {[got[i] for i in its]}, one rank {[ref[i] for i in its]}: {report}"
    print(f"  {name}: {iters} losses equal to one rank's (largest difference {worst:.2e})", flush=True)


def accuracy(label, stdout, minimum):
    m = re.search(r"held-out: loss ([0-9.]+), accuracy ([0-9.]+) over (\d+)", stdout)
    assert m, f"no held-out accuracy line in:\n{stdout[-3000:]}"
    acc = float(m.group(2))
    assert acc >= minimum and int(m.group(3)) > 0, m.group(0)
    print(f"  {label}: {m.group(0)} (required {minimum})", flush=True)


def parity(exe, tmp, args, iters=3):
    """One rank against TP2 x PP2, the first `iters` iterations."""
    common = [*args, "--iters", str(iters), "--dropout", "0"]
    run(exe, 1, [*common, "--tp", "1", "--pp", "1"], tmp / "one.json")
    run(exe, 4, [*common, "--tp", "2", "--pp", "2"], tmp / "tp2pp2.json")
    compare("TP2 x PP2", losses(tmp / "one.json"), losses(tmp / "tp2pp2.json"), iters)


def bert_classifier(exe, tmp):
    parity(exe, tmp, ["--min-accuracy", "0", "--eval-iters", "1"], iters=6)
    # Checkpoints reshard: saved at TP2 x PP2 after iteration 3, resumed on one rank.
    short = ["--min-accuracy", "0", "--eval-iters", "1", "--iters", "6", "--dropout", "0"]
    run(exe, 4, [*short, "--tp", "2", "--pp", "2", "--save", str(tmp / "ckpt"), "--save-interval", "3"], tmp / "s.json")
    (tmp / "ckpt" / "latest_checkpointed_iteration.txt").write_text("3\n")  # resume from iteration 3
    run(exe, 1, [*short, "--load", str(tmp / "ckpt")], tmp / "resumed.json")
    resumed = losses(tmp / "resumed.json")
    assert sorted(resumed) == [4, 5, 6], sorted(resumed)
    one = losses(tmp / "one.json")
    worst = max(abs(one[i] - resumed[i]) for i in resumed)
    # Not bit for bit: iterations 1-3 ran at TP2 x PP2, the uninterrupted run on one rank.
    report = close_report([resumed[i] for i in resumed], [one[i] for i in resumed], RTOL)
    assert report is None, f"resumed losses {resumed}, uninterrupted {one}: {report}"
    print(f"  resumed on one rank from TP2 x PP2's checkpoint: iterations 4-6 as uninterrupted ({worst:.2e})")
    out = run(exe, 4, ["--tp", "2", "--pp", "2", "--min-accuracy", "0.75"], tmp / "main.json")
    accuracy("TP2 x PP2", out, 0.75)
    ls = losses(tmp / "main.json")
    assert ls[max(ls)] < 0.5 * ls[1], f"the loss did not fall: {ls[1]} -> {ls[max(ls)]}"


def vit(exe, tmp):
    parity(exe, tmp, ["--min-accuracy", "0", "--eval-iters", "1"])
    # TP2 x DP2 with ZeRO-3: 2 micro-batches per DP rank, the global batch of one rank's 4.
    one = run(exe, 1, ["--tp", "1", "--micro-batches", "4", "--zero", "0", "--min-accuracy", "0.5"], tmp / "v1.json")
    out = run(exe, 4, ["--tp", "2", "--micro-batches", "2", "--zero", "3", "--min-accuracy", "0.5"], tmp / "main.json")
    accuracy("one rank", one, 0.5)
    accuracy("TP2 x DP2 ZeRO-3", out, 0.5)
    compare("TP2 x DP2 ZeRO-3", losses(tmp / "v1.json"), losses(tmp / "main.json"), 20)


def custom_loop(exe, tmp):
    data = ["--data-path", str(DATA), "--seq-length", "32", "--hidden", "32"]
    parity(exe, tmp, data)
    out = run(exe, 4, [*data, "--pp", "2", "--zero", "1", "--iters", "30"], tmp / "main.json")
    ls = losses(tmp / "main.json")
    assert sorted(ls) == list(range(1, 31)), sorted(ls)
    assert ls[30] < ls[1] - 1.0, f"the loss did not fall: {ls[1]} -> {ls[30]}"
    m = re.search(r"validation loss at iteration 30 \| lm loss value: (\S+)", out)
    assert m and float(m.group(1)) < ls[1] - 1.0, out[-3000:]
    print(f"  PP2 x DP2 ZeRO-1: loss {ls[1]:.3f} -> {ls[30]:.3f}, validation {float(m.group(1)):.3f}", flush=True)


def main():
    if len(sys.argv) != 3 or sys.argv[1] not in ("bert_classifier", "vit", "custom_loop"):
        sys.exit(__doc__)
    name, exe = sys.argv[1], Path(sys.argv[2])
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"mt_{name}_") as tmp:
        globals()[name](exe, Path(tmp))
    print(f"{name}: ok in {time.monotonic() - start:.1f} s")


if __name__ == "__main__":
    main()
