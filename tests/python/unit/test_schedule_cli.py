"""build/bin/megatorch-schedule: the documented flags, --json fields and --svg."""
import json
import os
import subprocess
from pathlib import Path

import pytest

BIN = Path(os.environ.get("MEGATORCH_BIN_DIR", Path(__file__).resolve().parents[3] / "build" / "bin"))
CLI = str(BIN / "megatorch-schedule")


def run(*args):
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("schedule, v, bubble", [("gpipe", None, 3 / 8), ("1f1b", None, 3 / 8),
                                                  ("interleaved", 2, 3 / 16)])
def test_json_reports_the_formula_bubble(schedule, v, bubble):
    args = ["--schedule", schedule, "--pipeline-model-parallel-size", "4", "--num-microbatches", "8", "--json"]
    if v:
        args += ["--virtual-pipeline-model-parallel-size", str(v)]
    out = run(*args)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["bubble_fraction"] == pytest.approx(bubble, abs=0)
    assert len(report["peak_inflight"]) == 4
    assert report["makespan"] == (8 * (v or 1) + 3) * 3
    if schedule == "1f1b":
        assert report["peak_inflight"] == [4, 3, 2, 1]
    if schedule == "gpipe":
        assert report["peak_inflight"] == [8, 8, 8, 8]


def test_costs_and_svg(tmp_path):
    svg = tmp_path / "t.svg"
    out = run("--schedule", "1f1b", "--pipeline-model-parallel-size", "2", "--num-microbatches", "4",
              "--forward-cost", "2", "--backward-cost", "3", "--json", "--svg", str(svg))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["makespan"] == (4 + 1) * 5
    text = svg.read_text()
    assert text.startswith("<svg") or "<svg" in text[:200]
    assert text.count("<rect") >= 2 * 2 * 4  # a box per forward and backward on each rank


def test_interleaved_rejects_m_not_multiple_of_p():
    out = run("--schedule", "interleaved", "--pipeline-model-parallel-size", "4", "--num-microbatches", "7",
              "--virtual-pipeline-model-parallel-size", "2")
    assert out.returncode != 0
    assert "multiple" in out.stderr
