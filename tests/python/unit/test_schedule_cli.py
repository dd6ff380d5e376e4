"""build/bin/megatorch-schedule: the documented flags, --json fields, --svg, and the tensor between
stages under context parallelism."""
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


def test_context_parallel_one_changes_nothing():
    base = ["--schedule", "interleaved", "--pipeline-model-parallel-size", "4", "--num-microbatches", "8",
            "--virtual-pipeline-model-parallel-size", "2"]
    for extra in ([], ["--json"]):
        plain, cp1 = run(*base, *extra), run(*base, *extra, "--context-parallel-size", "1", "--cp-comm-type", "p2p")
        assert plain.returncode == 0 and plain.stdout == cp1.stdout


@pytest.mark.parametrize("sp", [False, True])
def test_stage_tensor_is_the_cp_share(sp):
    args = ["--pipeline-model-parallel-size", "4", "--num-microbatches", "8", "--seq-length", "8192",
            "--hidden-size", "4096", "--micro-batch-size", "2", "--tensor-model-parallel-size", "4", "--json"]
    if sp:
        args.append("--sequence-parallel")
    reports = {}
    for c in (1, 2, 4):
        out = run(*args, "--context-parallel-size", str(c))
        assert out.returncode == 0, out.stderr
        reports[c] = json.loads(out.stdout)
    t = 4 if sp else 1
    for c, report in reports.items():
        tokens = 8192 // c // t
        assert report["stage_tensor"]["shape"] == [tokens, 2, 4096]
        assert report["stage_tensor"]["bytes"] == tokens * 2 * 4096 * 2
        # 1F1B: every rank but the last sends m activations, every rank but the first m gradients.
        assert report["p2p_sends_per_rank"] == [8, 16, 16, 8]
        assert report["p2p_send_bytes_per_rank"] == [n * tokens * 2 * 4096 * 2 for n in [8, 16, 16, 8]]
        assert ("context_parallel_size" in report) == (c > 1)
    assert reports[2]["p2p_send_bytes_per_rank"][1] * 2 == reports[1]["p2p_send_bytes_per_rank"][1]
    assert reports[4]["cp_comm_type"] == "p2p"
    # The simulation itself does not change: costs are given per chunk, with c in them.
    assert reports[1]["makespan"] == reports[4]["makespan"]


def test_context_parallel_share_in_the_summary_and_errors():
    out = run("-p", "2", "-m", "4", "--context-parallel-size", "2", "--cp-comm-type", "a2a", "--seq-length", "4096",
              "--hidden-size", "1024")
    assert out.returncode == 0, out.stderr
    assert "context parallel 2 (a2a): each pipeline rank holds S/2 of every sequence (chunks r and 3-r of 4)" in out.stdout
    assert "tensor between stages, per rank: [2048, 1, 1024] = 4194304 bytes" in out.stdout
    out = run("-p", "2", "-m", "4", "--context-parallel-size", "3", "--seq-length", "4096", "--hidden-size", "1024")
    assert out.returncode != 0 and "divisible by 2 x --context-parallel-size (6)" in out.stderr
    out = run("-p", "2", "-m", "4", "--context-parallel-size", "2", "--cp-comm-type", "ring")
    assert out.returncode != 0 and "'p2p' or 'a2a'" in out.stderr


def test_zero_bubble_h1_with_split_costs(tmp_path):
    """--schedule zb-h1 with --f-cost/--b-cost/--w-cost: every rank idles (p-1)(F+B-W) against
    1F1B's (p-1)(F+B+W) (whose backward is B + W when --backward-cost is not given), holds
    at most p micro-batches, and draws B and W boxes of their own."""
    costs = ["--f-cost", "2", "--b-cost", "2", "--w-cost", "1"]
    base = ["--pipeline-model-parallel-size", "4", "--num-microbatches", "8", *costs, "--json"]
    svg = tmp_path / "zb.svg"
    zb, ofob = run("--schedule", "zb-h1", *base, "--svg", str(svg)), run("--schedule", "1f1b", *base)
    assert zb.returncode == 0 and ofob.returncode == 0, zb.stderr + ofob.stderr
    zb, ofob = json.loads(zb.stdout), json.loads(ofob.stdout)
    assert zb["costs"] == {"forward": 2, "backward": 3, "p2p": 0, "backward_input": 2, "backward_weight": 1}
    assert zb["idle"] == [3 * (2 + 2 - 1)] * 4 and ofob["idle"] == [3 * (2 + 2 + 1)] * 4
    assert zb["matches_formula"] and zb["formula_bubble_fraction_exact"] == "9/40"
    assert zb["peak_inflight"] == [4, 4, 4, 4]
    text = svg.read_text()
    assert "backward (input)" in text and "backward (weight)" in text
    # W dearer than F: the schedule still simulates, the formula does not apply.
    heavy = json.loads(run("--schedule", "zb-h1", "-p", "4", "-m", "8", "--w-cost", "3", "--json").stdout)
    assert heavy["formula_bubble_fraction"] is None and not heavy["matches_formula"]
