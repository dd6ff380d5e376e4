"""megatorch-verify-layout: a shrunk copy of a gpt_pretrain configuration at its layout
(under the NCCL check) against one rank."""
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
TOOL = Path(os.environ.get("MEGATORCH_BIN_DIR", ROOT / "build" / "bin")) / "megatorch-verify-layout"

# A user's flags for a large model: the tool keeps the structure and shrinks the sizes.
USER = ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32", "--seq-length", "4096",
        "--micro-batch-size", "1", "--global-batch-size", "512", "--position-embedding-type", "rope",
        "--swiglu", "--normalization", "RMSNorm", "--bf16", "--lr", "3e-3", "--train-iters", "500000",
        "--data-path", "/data/my_corpus_text_document"]


def verify(*args, flags=()):
    return subprocess.run([str(TOOL), *args, "--", *USER, *flags], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_tp2_pp2_zb_v_zero3_matches_one_rank(tmp_path):
    out = verify("--steps", "2", "--data-parallel-size", "1", "--keep", str(tmp_path),
                 flags=["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                        "--sequence-parallel", "--schedule", "zb-v", "--zero-stage", "3"])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "layout run: 4 Gloo ranks under the NCCL check" in out.stdout
    assert "--schedule zb-v" in out.stdout and "--num-layers 4" in out.stdout and "--bf16" not in out.stdout
    steps = [l.split() for l in out.stdout.splitlines() if l.strip()[:1].isdigit() and len(l.split()) == 5]
    assert [s[0] for s in steps] == ["1", "2"]
    for s in steps:
        assert float(s[3]) < 1e-4 and float(s[4]) < 1e-4
    rows = {l.split()[0]: l.split()[1:] for l in out.stdout.splitlines() if l.startswith("  layers.")}
    assert "layers.3.mlp.fc1.weight" in rows  # every parameter, by its whole-model name
    # value and gradient: "|d| (relative)" each, the gradient (of the last step) 1e-5 apart
    assert all(float(r[3].strip("()")) < 1e-4 for r in rows.values())
    assert "same: losses and gradient norms within" in out.stdout
    assert (tmp_path / "layout_ckpt").is_dir() and (tmp_path / "single.json").is_file()


def test_a_layout_that_cannot_run_exits_2_with_the_reason():
    out = verify("--steps", "1", flags=["--num-experts", "3", "--expert-model-parallel-size", "2"])
    assert out.returncode == 2
    assert "layout run failed" in out.stderr
    assert "expected --num-experts (3) to be divisible by --expert-model-parallel-size (2)" in out.stderr


def test_a_tolerance_below_the_rounding_fails():
    out = verify("--steps", "1", "--data-parallel-size", "1", "--tolerance", "0",
                 flags=["--tensor-model-parallel-size", "2"])
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert "DIFFERENT: losses and gradient norms within" in out.stdout
