#!/usr/bin/env python3
"""Seeded fuzzing of megatorch's file readers: mutated .idx/.bin datasets, safetensors
shards (header and length prefix) and checkpoint metadata.json documents.

Builds valid inputs first (a small dataset with build/bin/megatorch-preprocess; a checkpoint
of a tiny GPTModel with megatorch.cpp.save_checkpoint), then mutates them: bit flips, byte
overwrites with 0/0xff/0x7f/0x80 and boundary integers, truncation, extension, and
JSON-aware changes (keys deleted, values of the wrong type, huge or negative numbers, path
strings such as "../x"). Every mutated input goes to the readers in child processes:

  .idx/.bin     megatorch-dataset info PREFIX  /  megatorch-dataset docs PREFIX (alternating)
  checkpoint    megatorch.cpp.load_checkpoint (a forked child of a Python server that
                imported megatorch.cpp once), and megatorch-hf export --load on every
                --export-every'th case

A run FAILS when the child dies by a signal, runs past --timeout, or prints
"Exception raised from" (a C++ backtrace reached the user). Any other exit status is a
refusal, which is what a damaged file should get. Case i of seed S is generated from
random.Random(f"{S}:{i}") alone, so `--seed S --only i` reproduces one case; every failing
input is copied to --out with the command and its output.

  python scripts/fuzz_inputs.py --seed 1 --count 150 [--out fuzz-failures] [--only 17]
Exit status: 0 when no run failed, 1 otherwise.
"""
import argparse
import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("idx", "safetensors", "metadata")
CONFIG = dict(hidden_size=32, num_attention_heads=4, num_layers=1, seq_length=8, vocab_size=64)
ITER_DIR = "iter_0000003"
SHARD = "rank_00000.safetensors"
BACKTRACE = "Exception raised from"

# Interesting values: single bytes, and little-endian integers at the edges of their types.
BYTES = (0x00, 0xFF, 0x7F, 0x80)
INTS = (0, 1, -1, 2**31 - 1, -2**31, 2**32 - 1, 2**63 - 1, -2**63, 2**62, 255, 65535, 65536)
JSON_VALUES = (None, True, False, 0, -1, 1, 2**31, 2**63 - 1, 2**63, 2**64 + 5, -2**63, -2**64,
               1e308, -1e308, 0.5, "", "x", "../x", "../../etc/passwd", "/etc/passwd", "a/b",
               "rank_00000.safetensors", "F16", "BF16", "I64", "U8", "F99", [], [1], [-1], [2**40, 2**40],
               {}, {"a": 1})


# ---- byte-level mutations -------------------------------------------------------------

def mutate_bytes(rng, data, hot=None):
    """1-4 byte-level changes; `hot` = (begin, end) biases positions into a header region."""
    data = bytearray(data)
    ops = []
    for _ in range(rng.randint(1, 4)):
        op = rng.choice(("flip", "byte", "int", "truncate", "extend", "flip", "int"))
        if not data:
            op = "extend"
        lo, hi = (0, len(data))
        if hot and rng.random() < 0.8:
            lo, hi = max(0, hot[0]), max(1, min(len(data), hot[1]))
        pos = rng.randrange(lo, hi) if hi > lo else 0
        if op == "flip":
            bit = rng.randrange(8)
            data[pos] ^= 1 << bit
            ops.append(f"flip bit {bit} at {pos}")
        elif op == "byte":
            v = rng.choice(BYTES)
            data[pos] = v
            ops.append(f"byte {v:#x} at {pos}")
        elif op == "int":
            width = rng.choice((1, 2, 4, 8))
            v = rng.choice(INTS) & ((1 << (8 * width)) - 1)
            pos = (pos // width) * width if rng.random() < 0.7 else pos
            chunk = v.to_bytes(width, "little")
            data[pos:pos + width] = chunk
            ops.append(f"int{8 * width} {v:#x} at {pos}")
        elif op == "truncate":
            n = rng.choice((0, 1, pos, len(data) - 1, rng.randrange(len(data))))
            n = max(0, min(n, len(data)))
            del data[n:]
            ops.append(f"truncate to {n}")
        else:  # extend
            n = rng.choice((1, 7, 8, 64, 4096))
            tail = bytes(rng.choice((0, 0xFF, rng.randrange(256))) for _ in range(n))
            data.extend(tail)
            ops.append(f"extend by {n}")
    return bytes(data), ops


# ---- JSON-aware mutations -------------------------------------------------------------

def json_paths(node, path=()):
    yield path
    if isinstance(node, dict):
        for k, v in node.items():
            yield from json_paths(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from json_paths(v, path + (i,))


def mutate_json(rng, doc):
    """1-3 changes to a parsed JSON document (in place, returned)."""
    ops = []
    for _ in range(rng.randint(1, 3)):
        paths = [p for p in json_paths(doc) if p]
        if not paths:
            return rng.choice(JSON_VALUES), ops + ["replace the document"]
        path = rng.choice(paths)
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        key = path[-1]
        old = parent[key]
        op = rng.choice(("delete", "replace", "replace", "number", "string", "duplicate", "empty"))
        if op == "delete":
            if isinstance(parent, dict):
                del parent[key]
            else:
                parent.pop(key)
        elif op == "replace":
            parent[key] = rng.choice(JSON_VALUES)
        elif op == "number":
            parent[key] = rng.choice((2**63 - 1, 2**63, 2**64, -2**63, -1, -(2**40), 2**40, 1e308, 1.5,
                                      (old + rng.choice((-1, 1))) if isinstance(old, int) and
                                      not isinstance(old, bool) else 0))
        elif op == "string":
            parent[key] = rng.choice(("../x", "../../x.safetensors", "/tmp", "", ".", "..", "a\u0000b",
                                      "rank_00001.safetensors", "x" * 5000))
        elif op == "duplicate" and isinstance(old, list) and old:
            old.append(old[rng.randrange(len(old))])
        elif isinstance(old, (list, dict)):
            parent[key] = type(old)()
        else:
            parent[key] = [old]
        ops.append(f"{op} {'/'.join(map(str, path))}")
    return doc, ops


def mutate_json_text(rng, text):
    """Usually JSON-aware; sometimes raw text damage (truncation, stray bytes)."""
    if rng.random() < 0.8:
        doc, ops = mutate_json(rng, json.loads(text))
        return json.dumps(doc).encode(), ops
    data, ops = mutate_bytes(rng, text.encode())
    return data, ["raw: " + "; ".join(ops)]


# ---- valid seed inputs ----------------------------------------------------------------

def build_seeds(work, bin_dir, python):
    """A dataset PREFIX (.bin/.idx) and a checkpoint directory, both valid."""
    work.mkdir(parents=True, exist_ok=True)
    jsonl = work / "docs.jsonl"
    seed_rng = random.Random(0)  # fixed text: the seed inputs are the same for every --seed
    jsonl.write_text("".join(json.dumps({"text": " ".join(seed_rng.choice(("alpha", "beta", "gamma", "delta"))
                                                          for _ in range(3 + 4 * i))}) + "\n" for i in range(6)))
    subprocess.run([str(bin_dir / "megatorch-preprocess"), "--input", str(jsonl), "--output-prefix",
                    str(work / "data"), "--json-keys", "text", "--tokenizer-type", "ByteLevel", "--append-eod"],
                   check=True, capture_output=True, timeout=120)
    code = (f"import megatorch.cpp as mt; mt.save_checkpoint(mt.GPTModel(mt.TransformerConfig(**{CONFIG!r}, seed=1)), "
            f"{str(work / 'ckpt')!r}, 3)")
    subprocess.run([python, "-c", code], check=True, capture_output=True, timeout=300)
    return work / "data_text_document", work / "ckpt"


# ---- the load_checkpoint server -------------------------------------------------------

SERVER = r"""
import json, os, signal, sys, time, traceback
import megatorch.cpp as mt
config = json.loads(sys.argv[1])
model = mt.GPTModel(mt.TransformerConfig(**config, seed=2))
out = sys.stdout
print("ready", file=out, flush=True)
for line in sys.stdin:
    req = json.loads(line)
    log = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    pid = os.fork()
    if pid == 0:
        os.dup2(log, 1); os.dup2(log, 2)
        try:
            mt.load_checkpoint(model, req["ckpt"])
            code = 0
        except Exception:
            traceback.print_exc()
            code = 1
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(code)
    os.close(log)
    deadline = time.monotonic() + req["timeout"]
    result = None
    while result is None:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            result = {"rc": os.waitstatus_to_exitcode(status)}
        elif time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL); os.waitpid(pid, 0)
            result = {"rc": None}
        else:
            time.sleep(0.005)
    print(json.dumps(result), file=out, flush=True)
"""


class LoadServer:
    def __init__(self, python):
        self.python = python
        self.proc = None

    def start(self):
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen([self.python, "-c", SERVER, json.dumps(CONFIG)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the load_checkpoint server did not start")

    def load(self, ckpt, log, timeout):
        """(returncode or None on a hang, output)."""
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        self.proc.stdin.write(json.dumps({"ckpt": str(ckpt), "log": str(log), "timeout": timeout}) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout + 30)
        if not ready:  # the server itself stuck: count as a hang, start a new one next time
            self.close()
            return None, "load_checkpoint server did not answer"
        rc = json.loads(self.proc.stdout.readline())["rc"]
        return rc, Path(log).read_text(errors="replace") if Path(log).exists() else ""

    def close(self):
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            self.proc = None


# ---- running one case -----------------------------------------------------------------

def run_tool(cmd, timeout):
    try:
        out = subprocess.run([str(c) for c in cmd], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))
        return out.returncode, out.stderr.decode(errors="replace")
    except subprocess.TimeoutExpired as e:
        return None, (e.stderr or b"").decode(errors="replace")


def verdict(rc, text):
    if rc is None:
        return "hang"
    if rc < 0:
        return f"signal {signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else -rc}"
    if BACKTRACE in text:
        return "backtrace"
    return None


def make_case(seed, i, dataset, ckpt, case_dir):
    """Write case i's mutated input under case_dir; returns (kind, target, description)."""
    rng = random.Random(f"{seed}:{i}")
    kind = KINDS[i % len(KINDS)]
    if kind == "idx":
        prefix = case_dir / "data"
        shutil.copy(f"{dataset}.idx", f"{prefix}.idx")
        shutil.copy(f"{dataset}.bin", f"{prefix}.bin")
        which = "idx" if rng.random() < 0.85 else "bin"
        path = Path(f"{prefix}.{which}")
        data = path.read_bytes()
        # The .idx header is 34 bytes (magic, version, dtype, counts); the arrays follow.
        data, ops = mutate_bytes(rng, data, hot=(0, 34) if which == "idx" and rng.random() < 0.5 else None)
        path.write_bytes(data)
        return kind, prefix, f".{which}: " + "; ".join(ops)
    target = case_dir / "ckpt"
    shutil.copytree(ckpt, target)
    it = target / ITER_DIR
    if kind == "safetensors":
        shard = it / SHARD
        data = shard.read_bytes()
        n = int.from_bytes(data[:8], "little")
        if rng.random() < 0.5:  # JSON-aware header change, length prefix rewritten to match
            header, ops = mutate_json(rng, json.loads(data[8:8 + n]))
            blob = json.dumps(header).encode()
            data = len(blob).to_bytes(8, "little") + blob + data[8 + n:]
            ops = ["header: " + "; ".join(ops)]
        else:  # bytes of the length prefix and header (sometimes anywhere)
            data, ops = mutate_bytes(rng, data, hot=(0, 8 + n))
        shard.write_bytes(data)
        # Usually keep metadata.json's size and CRC in step, so the shard's header parser
        # is reached instead of the CRC check refusing the file first.
        if rng.random() < 0.75:
            meta = json.loads((it / "metadata.json").read_text())
            meta["files"][SHARD] = {"bytes": len(data), "crc32": zlib.crc32(data)}
            (it / "metadata.json").write_text(json.dumps(meta))
            ops.append("metadata bytes/crc32 updated")
        return kind, target, "shard " + "; ".join(ops)
    if rng.random() < 0.1:
        path = target / "latest_checkpointed_iteration.txt"
    else:
        path = it / "metadata.json"
    data, ops = mutate_json_text(rng, path.read_text()) if path.name.endswith(".json") else \
        mutate_bytes(rng, path.read_bytes())
    path.write_bytes(data)
    return kind, target, f"{path.name}: " + "; ".join(ops)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--count", type=int, default=150, help="mutated inputs, spread over the three kinds")
    ap.add_argument("--only", type=int, action="append", help="run only this case index (repeatable)")
    ap.add_argument("--timeout", type=float, default=20.0, help="per child run, seconds")
    ap.add_argument("--export-every", type=int, default=3,
                    help="also run megatorch-hf export --load on every N'th checkpoint case (1 = all)")
    ap.add_argument("--out", default="fuzz-failures", help="failing inputs are copied here")
    ap.add_argument("--bin-dir", default=os.environ.get("MEGATORCH_BIN_DIR", str(ROOT / "build" / "bin")))
    ap.add_argument("--python", default=sys.executable, help="the Python with megatorch.cpp")
    ap.add_argument("--json", help="write the counts here as JSON")
    args = ap.parse_args(argv)
    bin_dir = Path(args.bin_dir)
    start = time.monotonic()
    counts = {"cases": 0, "runs": 0, "refused": 0, "accepted": 0, "failures": 0,
              "by_kind": {k: 0 for k in KINDS}, "by_reader": {}}
    failures = []
    server = LoadServer(args.python)
    with tempfile.TemporaryDirectory(prefix="megatorch-fuzz-") as tmp:
        tmp = Path(tmp)
        dataset, ckpt = build_seeds(tmp / "seed", bin_dir, args.python)
        cases = args.only if args.only else range(args.count)
        try:
            for i in cases:
                case_dir = tmp / f"case_{i}"
                case_dir.mkdir()
                kind, target, desc = make_case(args.seed, i, dataset, ckpt, case_dir)
                counts["cases"] += 1
                counts["by_kind"][kind] += 1
                runs = []
                if kind == "idx":
                    sub = "info" if i % 2 == 0 else "docs"
                    runs.append((f"megatorch-dataset {sub}", [bin_dir / "megatorch-dataset", sub, target]))
                else:
                    runs.append(("load_checkpoint", None))
                    if (i // len(KINDS)) % max(1, args.export_every) == 0:
                        runs.append(("megatorch-hf export", [bin_dir / "megatorch-hf", "export", "--load", target,
                                                             "--hf-dir", case_dir / "hf"]))
                for reader, cmd in runs:
                    if cmd is None:
                        rc, text = server.load(target, case_dir / "load.log", args.timeout)
                        shown = f"{args.python} -c 'import megatorch.cpp as mt; mt.load_checkpoint(" \
                                f"mt.GPTModel(mt.TransformerConfig(**{CONFIG!r})), CKPT)'"
                    else:
                        rc, text = run_tool(cmd, args.timeout)
                        shown = " ".join(map(str, cmd))
                    counts["runs"] += 1
                    counts["by_reader"][reader] = counts["by_reader"].get(reader, 0) + 1
                    bad = verdict(rc, text)
                    if bad:
                        counts["failures"] += 1
                        dest = Path(args.out) / f"seed{args.seed}_case{i}_{kind}"
                        shutil.rmtree(dest, ignore_errors=True)
                        shutil.copytree(case_dir, dest, ignore=shutil.ignore_patterns("hf", "load.log"))
                        (dest / "repro.txt").write_text(
                            f"{bad}: {reader}\nreproduce: python scripts/fuzz_inputs.py --seed {args.seed} "
                            f"--only {i}\nmutation: {desc}\ncommand: {shown}\n--- output ---\n{text[-20000:]}\n")
                        failures.append(f"case {i} ({kind}, {reader}): {bad}; {desc}")
                        print(f"FAIL seed {args.seed} case {i} ({kind}, {reader}): {bad}; {desc}", flush=True)
                    elif rc == 0:
                        counts["accepted"] += 1
                    else:
                        counts["refused"] += 1
                shutil.rmtree(case_dir, ignore_errors=True)
        finally:
            server.close()
    counts["seed"] = args.seed
    counts["seconds"] = round(time.monotonic() - start, 1)
    print(f"fuzz seed {args.seed}: {counts['cases']} inputs ({', '.join(f'{k} {v}' for k, v in counts['by_kind'].items())}), "
          f"{counts['runs']} reader runs ({', '.join(f'{k} {v}' for k, v in counts['by_reader'].items())}): "
          f"{counts['refused']} refused, {counts['accepted']} accepted, {counts['failures']} failed "
          f"(signal, hang or backtrace) in {counts['seconds']} s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(counts, failure_list=failures), indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
