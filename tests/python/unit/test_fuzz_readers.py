"""Seeded fuzzing of the file readers (scripts/fuzz_inputs.py): mutated .idx/.bin datasets,
safetensors shards and checkpoint metadata.json go to megatorch-dataset info/docs,
megatorch.cpp.load_checkpoint and megatorch-hf export --load in child processes. Every run
must end in an exit status (a refusal or a load), never a signal, a hang or a C++ backtrace.
A failure prints the seed and case index; `python scripts/fuzz_inputs.py --seed S --only I`
reproduces it. The runner's own verdicts are checked first, so the fuzz test can fail."""
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
BIN = Path(os.environ.get("MEGATORCH_BIN_DIR", ROOT / "build" / "bin"))
SEED = 20261203
COUNT = 96  # 32 per kind; about 30 s on two busy cores

spec = importlib.util.spec_from_file_location("fuzz_inputs", ROOT / "scripts" / "fuzz_inputs.py")
fuzz = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fuzz)

pytestmark = pytest.mark.skipif(not all((BIN / t).exists() for t in ("megatorch-dataset", "megatorch-hf",
                                                                       "megatorch-preprocess")),
                                reason=f"tools in {BIN} not built (scripts/build.sh)")


def test_the_runner_counts_signals_hangs_and_backtraces_as_failures():
    py = sys.executable
    rc, text = fuzz.run_tool([py, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"], 20)
    assert fuzz.verdict(rc, text) == "signal SIGSEGV"
    rc, text = fuzz.run_tool([py, "-c", "import time; time.sleep(30)"], 1)
    assert fuzz.verdict(rc, text) == "hang"
    rc, text = fuzz.run_tool([py, "-c", "import sys; sys.exit('Exception raised from load at x.cpp:1')"], 20)
    assert fuzz.verdict(rc, text) == "backtrace"
    rc, text = fuzz.run_tool([py, "-c", "import sys; sys.exit('megatorch: bad file')"], 20)
    assert fuzz.verdict(rc, text) is None


def test_the_mutations_depend_on_the_seed_and_case_only(tmp_path):
    data = bytes(range(256)) * 4
    a = fuzz.mutate_bytes(fuzz.random.Random(f"{SEED}:7"), data)
    b = fuzz.mutate_bytes(fuzz.random.Random(f"{SEED}:7"), data)
    c = fuzz.mutate_bytes(fuzz.random.Random(f"{SEED}:8"), data)
    assert a == b and a != c


def test_mutated_inputs_never_crash_or_hang_a_reader(tmp_path):
    report = tmp_path / "counts.json"
    status = fuzz.main(["--seed", str(SEED), "--count", str(COUNT), "--out", str(tmp_path / "failures"),
                        "--bin-dir", str(BIN), "--json", str(report)])
    counts = json.loads(report.read_text())
    print(json.dumps({k: v for k, v in counts.items() if k != "failure_list"}))
    assert counts["cases"] == COUNT and all(n > 0 for n in counts["by_kind"].values())
    assert set(counts["by_reader"]) == {"megatorch-dataset info", "megatorch-dataset docs", "load_checkpoint",
                                        "megatorch-hf export"}
    assert counts["failures"] == 0 and status == 0, \
        "\n".join(counts["failure_list"]) + f"\n(inputs under {tmp_path / 'failures'})"
    # The damage must mostly be refused: a fuzzer whose inputs all load tests nothing.
    assert counts["refused"] > counts["runs"] // 2, counts
