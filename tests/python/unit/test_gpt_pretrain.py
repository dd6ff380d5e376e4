"""build/bin/gpt_pretrain end to end, as real torchrun launches on the bundled data:
the same losses at every parallel layout, two simulated nodes, bad configurations
failing fast, and an interrupted run resumed bit for bit."""
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from binaries import children

ROOT = Path(__file__).resolve().parents[3]
BIN = Path(os.environ.get("MEGATORCH_BIN_DIR", ROOT / "build" / "bin"))
TRAIN = BIN / "gpt_pretrain"
DATA = ROOT / "data" / "default" / "stdlib_docs_text_document"
MODEL = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
         "--vocab-size", "257", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "3e-3",
         "--lr-warmup-iters", "2", "--min-lr", "3e-4", "--data-path", str(DATA), "--eval-iters", "1",
         "--log-interval", "5", "--seed", "11"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc, args, extra=(), timeout=600, env=None):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *extra,
           "--no-python", str(TRAIN), *args]
    e = dict(os.environ, OMP_NUM_THREADS="1", MEGATORCH_COMM_TIMEOUT_S="60", **(env or {}))
    start = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=e)
    return out, time.monotonic() - start


def losses(path):
    return {r["iteration"]: r["loss"] for r in map(json.loads, Path(path).read_text().splitlines())}


def test_same_losses_at_every_layout(tmp_path):
    """TP2 x PP2, DP4 with ZeRO-3, PP2 interleaved x DP2 with ZeRO-3, PP4, TP2 + SP x DP2
    with ZeRO-2, PP2 zb-h1 x DP2 with ZeRO-2, TP2 x PP2 zb-v with ZeRO-1, TP2 + SP x PP2
    dualpipev with ZeRO-2 and one rank: the same 20 losses (fp32, 1e-5)."""
    runs = {
        "tp2pp2": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
        "dp4zero3": (4, ["--zero-stage", "3"]),
        # ZeRO-3 units gathered by the hooks of two model chunks per stage, interleaved.
        "pp2v2dp2zero3": (4, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
                               "--zero-stage", "3"]),
        # The tied embedding's copies on stages 0 and 3 summed by the optimizer over PP.
        "pp4zero1": (4, ["--pipeline-model-parallel-size", "4", "--zero-stage", "1"]),
        # SP's partial sums added by the optimizer after its overlapped DP reduction (ZeRO-2).
        "tp2spdp2zero2": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--zero-stage", "2"]),
        # Zero-bubble's split backward: W's gradients reduced over DP by ZeRO-2's buckets;
        # the recomputed layers' weight gradients come in B.
        "pp2dp2zbh1zero2": (4, ["--pipeline-model-parallel-size", "2", "--schedule", "zb-h1", "--zero-stage", "2",
                                "--recompute-granularity", "full"]),
        # The V schedules: rank 0 holds the embedding and the head (the tie on one rank) and
        # computes the loss; 4 micro-batches fill the V of two stages.
        "tp2pp2zbvzero1": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                               "--schedule", "zb-v", "--zero-stage", "1"]),
        "tp2sppp2dualpipevzero2": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                       "--pipeline-model-parallel-size", "2", "--schedule", "dualpipev",
                                       "--zero-stage", "2"]),
        "single": (1, []),
    }
    got = {}
    for name, (n, layout) in runs.items():
        log = tmp_path / f"{name}.json"
        out, _ = torchrun(n, [*MODEL, "--train-iters", "20", *layout, "--log-json", str(log)])
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        got[name] = losses(log)
        assert sorted(got[name]) == list(range(1, 21))
    ref = got["single"]
    assert ref[20] < ref[1]  # it learns
    for name in ("tp2pp2", "dp4zero3", "pp2v2dp2zero3", "pp4zero1", "tp2spdp2zero2", "pp2dp2zbh1zero2",
                 "tp2pp2zbvzero1", "tp2sppp2dualpipevzero2"):
        for it, loss in ref.items():
            assert got[name][it] == pytest.approx(loss, rel=1e-5), (name, it)


def test_split_backward_with_zero3_under_the_nccl_check(tmp_path):
    """zb-h1, zb-v and dualpipev with ZeRO-3 at PP2 x DP2 give ZeRO-0's 10 losses (fp32,
    1e-5), every step replayed under NCCL's rules (MEGATORCH_NCCL_CHECK=1: the transfers on
    per-channel communicators, the checker on every rank)."""
    pp2 = ["--pipeline-model-parallel-size", "2", "--global-batch-size", "16"]
    runs = {
        "zbh1zero0": ["--schedule", "zb-h1", "--zero-stage", "0"],
        "zbh1zero3": ["--schedule", "zb-h1", "--zero-stage", "3"],
        "zbvzero3": ["--schedule", "zb-v", "--zero-stage", "3"],
        "dualpipevzero3": ["--schedule", "dualpipev", "--zero-stage", "3", "--recompute-granularity", "full"],
    }
    got = {}
    for name, args in runs.items():
        log = tmp_path / f"{name}.json"
        out, _ = torchrun(4, [*MODEL, "--train-iters", "10", *pp2, *args, "--log-json", str(log)],
                          env={"MEGATORCH_NCCL_CHECK": "1"})
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        got[name] = losses(log)
    for name in ("zbh1zero3", "zbvzero3", "dualpipevzero3"):
        for it, loss in got["zbh1zero0"].items():
            assert got[name][it] == pytest.approx(loss, rel=1e-5), (name, it)


def replaced(base, args):
    """`base` without the flags `args` gives (each with the value after it): the bad value
    replaces the good one (a flag given twice is an error)."""
    base = list(base)
    for flag in args:
        if flag in base:
            i = base.index(flag)
            del base[i:i + 2]
    return base


def fails_fast(base, args, message):
    """4 ranks under torchrun stop within seconds, naming the problem."""
    out, took = torchrun(4, [*base, "--train-iters", "2", *args], timeout=120)
    assert out.returncode != 0
    assert message in out.stderr, out.stderr[-3000:]
    assert took < 60


@pytest.mark.parametrize("args, message", [
    (["--tensor-model-parallel-size", "3"], "to divide the world size 4"),
    (["--context-parallel-size", "3"], "context x pipeline parallel size (1 x 3 x 1 = 3) to divide the world size 4"),
    (["--context-parallel-size", "4", "--seq-length", "36", "--lr-warmup-iters", "0"], "divisible by 2 x the context-parallel size"),
    (["--global-batch-size", "6"], "to be a multiple of --micro-batch-size x data-parallel size"),
    (["--pipeline-model-parallel-size", "4", "--num-layers", "2"], "expected at least one layer per pipeline stage"),
    (["--bf16", "--fp16"], "contradict"),
    (["--schedule", "zb-v", "--pipeline-model-parallel-size", "4", "--lr-warmup-iters", "0"],
     "expected at least 8, got 4; raise --global-batch-size to 16 or more"),
    (["--schedule", "dualpipev", "--pipeline-model-parallel-size", "2", "--num-layers", "6", "--lr-warmup-iters", "0"],
     "expected --num-layers to be a multiple of 4, got 6"),
    (["--no-such-flag"], "--no-such-flag"),
    (["--sync-debug-iters", "6-4"], "expected --sync-debug-iters to be an iteration or a range FIRST-LAST"),
    # No GPU on this machine: asking for one fails before anything connects (the warm-up
    # flag only makes the rest of this configuration valid).
    (["--device", "cuda", "--lr-warmup-iters", "0"], "no CUDA device is visible"),
    (["--device", "cpu", "--distributed-backend", "nccl", "--lr-warmup-iters", "0"],
     "--distributed-backend nccl needs CUDA tensors"),
])
def test_bad_configuration_fails_fast_on_every_rank(args, message):
    if args[:2] == ["--device", "cuda"] and torch.cuda.is_available():
        pytest.skip("a GPU is visible here, so --device cuda is not an error")
    base = replaced(MODEL, args)
    # Under torchrun: the launch fails within seconds, naming the problem.
    fails_fast(base, args, message)
    # Every rank on its own (torchrun stops the others once one fails, so it cannot show
    # this): each of the 4 exits non-zero with the message, none waits for the others.
    port = free_port()
    procs = [subprocess.Popen([str(TRAIN), *base, "--train-iters", "2", *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, OMP_NUM_THREADS="1", RANK=str(r), LOCAL_RANK=str(r),
                                       WORLD_SIZE="4", LOCAL_WORLD_SIZE="4", MASTER_ADDR="127.0.0.1",
                                       MASTER_PORT=str(port), MEGATORCH_COMM_TIMEOUT_S="30"))
             for r in range(4)]
    for p in procs:
        _, err = p.communicate(timeout=30)
        assert p.returncode != 0
        assert err.count(message) == 1, err[-2000:]


def test_cuda_graph_and_sync_check_say_why_they_do_nothing_on_a_cpu(tmp_path):
    """--cuda-graph and --sync-debug-iters on CPU ranks: each says once why it does nothing
    here (the capture needs CUDA work; there is no device to wait for), and the run's losses
    are those of a run without them, bit for bit."""
    base = [*MODEL, "--train-iters", "4", "--hidden-dropout", "0", "--attention-dropout", "0"]
    runs = {}
    for name, flags in (("plain", []), ("flags", ["--cuda-graph", "--sync-debug-iters", "2-3"])):
        log = tmp_path / f"{name}.jsonl"
        out, _ = torchrun(1, [*base, "--log-json", str(log), *flags], timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        runs[name] = (losses(log), out.stdout)
    assert runs["flags"][0] == runs["plain"][0]
    said = runs["flags"][1]
    assert said.count("cuda graph: not captured, the layers run eagerly: the layers run on cpu") == 1, said[-3000:]
    assert said.count("sync debug: the step runs on cpu, not CUDA") == 1, said[-3000:]
    assert "cuda graph" not in runs["plain"][1] and "sync debug" not in runs["plain"][1]


def test_two_nodes_tp_within_pp_across(tmp_path):
    """Two torchrun launchers (--nnodes=2, c10d rendezvous on 127.0.0.1), 2 ranks each:
    TP=2 inside a node, PP=2 across; the losses equal a one-node run's."""
    port = free_port()
    cmd = lambda log: [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
                       "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=megatorch-2nodes",
                       "--no-python", str(TRAIN), *MODEL, "--train-iters", "4", "--tensor-model-parallel-size", "2",
                       "--pipeline-model-parallel-size", "2", "--log-json", str(log)]
    env = dict(os.environ, OMP_NUM_THREADS="1", MEGATORCH_COMM_TIMEOUT_S="60")
    logs = [tmp_path / "node0.json", tmp_path / "node1.json"]
    procs = [subprocess.Popen(cmd(log), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for log in logs]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-2000:] for o in outs)
    written = [log for log in logs if log.exists()]
    assert len(written) == 1  # only the last global rank logs
    ref_log = tmp_path / "one_node.json"
    out, _ = torchrun(4, [*MODEL, "--train-iters", "4", "--tensor-model-parallel-size", "2",
                          "--pipeline-model-parallel-size", "2", "--log-json", str(ref_log)])
    assert out.returncode == 0, out.stderr[-3000:]
    assert losses(written[0]) == losses(ref_log)


def test_killed_rank_resumes_bit_for_bit(tmp_path):
    """A rank is SIGKILLed mid-run; torchrun --max-restarts restarts every rank, which
    load the last checkpoint: every logged loss equals the uninterrupted run's, bit for bit."""
    # Dropout on: the default generator and the TP tracker's streams resume too.
    args = [*MODEL, "--train-iters", "16", "--tensor-model-parallel-size", "2", "--zero-stage", "2",
            "--save-interval", "3", "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    ref_log = tmp_path / "ref.json"
    out, _ = torchrun(4, [*args, "--save", str(tmp_path / "ref_ckpt"), "--log-json", str(ref_log)])
    assert out.returncode == 0, out.stderr[-3000:]
    ref = losses(ref_log)

    log, ckpt = tmp_path / "run.json", tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", "--max-restarts=1",
           "--no-python", str(TRAIN), *args, "--save", str(ckpt), "--load", str(ckpt), "--log-json", str(log)]
    env = dict(os.environ, OMP_NUM_THREADS="1", MEGATORCH_COMM_TIMEOUT_S="30")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and (not log.exists() or len(log.read_text().splitlines()) < 8):
        time.sleep(0.2)
    workers = children(proc.pid)
    assert workers, "no worker processes found"
    os.kill(sorted(workers)[1], 9)
    output = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, output[-4000:]
    resumed = re.search(r"loaded checkpoint .* \(iteration (\d+)", output)
    assert resumed, output[-4000:]
    assert int(resumed.group(1)) < 16  # the kill came mid-run
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert {r["iteration"] for r in rows} == set(range(1, 17))
    # Iterations between the last checkpoint and the kill (if any) ran twice: both equal.
    for r in rows:
        assert r["loss"] == ref[r["iteration"]], r["iteration"]


def check_reload_matches(tmp_path, ckpt, layouts, saving, model=MODEL):
    """Loads the 4-iteration checkpoint `ckpt` of `model` at each of `layouts` ({name:
    (ranks, flags)}): evaluated, the validation loss of the layout named `saving` (1e-6);
    trained two more steps, its losses (1e-5)."""
    val, cont = {}, {}
    for name, (n, layout) in layouts.items():
        log = tmp_path / f"{name}_eval.json"
        out, _ = torchrun(n, [*model, "--train-iters", "4", *layout, "--load", str(ckpt), "--eval-only",
                              "--log-json", str(log)])
        assert out.returncode == 0, (name, out.stdout[-3000:] + out.stderr[-3000:])
        val[name] = json.loads(log.read_text().splitlines()[-1])["val_loss"]
        log = tmp_path / f"{name}_cont.json"
        out, _ = torchrun(n, [*model, "--train-iters", "6", *layout, "--load", str(ckpt), "--log-json", str(log)])
        assert out.returncode == 0, (name, out.stdout[-3000:] + out.stderr[-3000:])
        assert "loaded checkpoint" in out.stdout
        cont[name] = losses(log)
        assert sorted(cont[name]) == [5, 6]
    for name in layouts:
        assert val[name] == pytest.approx(val[saving], rel=1e-6, abs=1e-6), name
        for it in (5, 6):
            assert cont[name][it] == pytest.approx(cont[saving][it], rel=1e-5), (name, it)


def test_checkpoint_reshards_to_other_layouts(tmp_path):
    """Saved at TP2 x PP2 with 1f1b (4 ranks, ZeRO-1 optimizer state), loaded at TP1 x PP1,
    TP4, DP2 x ZeRO-3, PP4 with zb-h1, PP2 with zb-v and with dualpipev (chunks in a V) and
    PP2 zb-v with ZeRO-3:
    the same validation loss (1e-6), and two more training steps give the losses the saving
    layout gives — the optimizer state was resharded too, and the split-backward schedules
    continue the other's run."""
    ckpt = tmp_path / "ckpt"
    saving = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--zero-stage", "1"]
    out, _ = torchrun(4, [*MODEL, "--train-iters", "4", *saving, "--save", str(ckpt)])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    layouts = {
        "tp2pp2": (4, saving),
        "tp1": (1, []),
        "tp4": (4, ["--tensor-model-parallel-size", "4"]),
        "dp2zero3": (2, ["--zero-stage", "3"]),
        "pp4zbh1": (4, ["--pipeline-model-parallel-size", "4", "--schedule", "zb-h1", "--zero-stage", "1"]),
        "pp2zbv": (2, ["--pipeline-model-parallel-size", "2", "--schedule", "zb-v", "--zero-stage", "1"]),
        "pp2dualpipev": (2, ["--pipeline-model-parallel-size", "2", "--schedule", "dualpipev"]),
        # ZeRO-3 under a split backward: its units freed as B moves on (W reads no weight).
        "pp2zbvzero3": (2, ["--pipeline-model-parallel-size", "2", "--schedule", "zb-v", "--zero-stage", "3"]),
    }
    check_reload_matches(tmp_path, ckpt, layouts, "tp2pp2")


def test_v_schedule_checkpoint_loads_at_other_layouts(tmp_path):
    """Saved under PP2 zb-v (rank 0 holds the embedding and its tied copy in the head, and
    writes the pair once), loaded at one rank and at PP2 1f1b: the same validation loss and
    the same two further losses."""
    ckpt = tmp_path / "ckpt"
    saving = ["--pipeline-model-parallel-size", "2", "--schedule", "zb-v", "--zero-stage", "1"]
    out, _ = torchrun(2, [*MODEL, "--train-iters", "4", *saving, "--save", str(ckpt)])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    layouts = {"pp2zbv": (2, saving), "single": (1, []), "pp2": (2, ["--pipeline-model-parallel-size", "2"])}
    check_reload_matches(tmp_path, ckpt, layouts, "pp2zbv")


def test_context_parallel_same_losses_and_resume_across_c(tmp_path):
    """--context-parallel-size: ring attention at c = 2 and 4, Ulysses at c = 2, c = 2 with
    TP2 + SP, with PP2 and next to DP2 with ZeRO-3 give the single rank's 10 losses (fp32,
    1e-5), for learned positions and for RoPE + GQA. A checkpoint saved at c = 2 loads at
    c = 1 and c = 4: the same validation loss, and two more steps give the saving layout's
    losses."""
    rope_gqa = ["--position-embedding-type", "rope", "--group-query-attention", "--num-query-groups", "2"]
    cp2 = ["--context-parallel-size", "2"]
    runs = {
        "single": (1, []),
        "cp4": (4, ["--context-parallel-size", "4"]),
        "cp2dp2zero3": (4, [*cp2, "--zero-stage", "3"]),
        "cp2tp2sp": (4, [*cp2, "--tensor-model-parallel-size", "2", "--sequence-parallel"]),
        "cp2pp2": (4, [*cp2, "--pipeline-model-parallel-size", "2"]),
        "rope_single": (1, rope_gqa),
        "rope_cp2": (2, [*rope_gqa, *cp2]),
        "rope_cp2a2a": (2, [*rope_gqa, *cp2, "--cp-comm-type", "a2a"]),
        "rope_cp4": (4, [*rope_gqa, "--context-parallel-size", "4"]),
    }
    got = {}
    for name, (n, layout) in runs.items():
        log = tmp_path / f"{name}.json"
        out, _ = torchrun(n, [*MODEL, "--train-iters", "10", *layout, "--log-json", str(log)])
        assert out.returncode == 0, (name, out.stdout[-3000:] + out.stderr[-3000:])
        got[name] = losses(log)
        assert sorted(got[name]) == list(range(1, 11)), name
        if "--context-parallel-size" in layout:
            cp_bytes = [json.loads(line)["comm_bytes"]["cp"] for line in log.read_text().splitlines()]
            assert all(b > 0 for b in cp_bytes), name  # attention crossed the CP ranks
    for name in runs:
        ref = got["rope_single" if name.startswith("rope") else "single"]
        for it, loss in ref.items():
            assert got[name][it] == pytest.approx(loss, rel=1e-5), (name, it)

    ckpt = tmp_path / "ckpt"
    out, _ = torchrun(4, [*MODEL, "--train-iters", "4", *cp2, "--tensor-model-parallel-size", "2", "--save", str(ckpt)])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    layouts = {"cp2tp2": (4, [*cp2, "--tensor-model-parallel-size", "2"]), "cp1": (1, []),
               "cp4": (4, ["--context-parallel-size", "4"])}
    check_reload_matches(tmp_path, ckpt, layouts, "cp2tp2")


def test_attention_dropout_under_context_parallelism_is_one_mask(tmp_path):
    """--attention-dropout under CP draws its mask by position and global head: c = 2
    (ring and Ulysses), c = 4 and TP2 x c = 2 give the same 6 losses (1e-5), and the
    mask moves them away from the run without dropout."""
    drop = ["--attention-dropout", "0.2", "--train-iters", "6"]
    cp2 = ["--context-parallel-size", "2"]
    runs = {"cp2": (2, [*drop, *cp2]), "cp2a2a": (2, [*drop, *cp2, "--cp-comm-type", "a2a"]),
            "cp4": (4, [*drop, "--context-parallel-size", "4"]),
            "cp2tp2": (4, [*drop, *cp2, "--tensor-model-parallel-size", "2"]),
            "cp2_no_dropout": (2, ["--train-iters", "6", *cp2])}
    got = {}
    for name, (n, layout) in runs.items():
        log = tmp_path / f"{name}.json"
        out, _ = torchrun(n, [*MODEL, *layout, "--log-json", str(log)])
        assert out.returncode == 0, (name, out.stdout[-3000:] + out.stderr[-3000:])
        got[name] = losses(log)
    for name in ("cp2a2a", "cp4", "cp2tp2"):
        for it, loss in got["cp2"].items():
            assert got[name][it] == pytest.approx(loss, rel=1e-5), (name, it)
    assert any(got["cp2_no_dropout"][it] != pytest.approx(loss, rel=1e-4) for it, loss in got["cp2"].items())


# A Mixtral-style model: 4 experts, top-2 over the softmax of all experts, SwiGLU experts,
# RMSNorm, RoPE, no biases; Switch's auxiliary loss and the z-loss on.
MIXTRAL = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-router-pre-softmax", "--moe-ffn-hidden-size", "48",
           "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear",
           "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001"]


def test_mixture_of_experts_same_losses_and_resume_across_ep(tmp_path):
    """--num-experts with --expert-model-parallel-size: EP2 x TP2 + SP, EP2 x expert-TP2
    over TP2 + SP, EP4 over DP with ZeRO-1, EP2 x PP2 and the all-gather dispatcher at EP2
    give the single rank's 10 losses (fp32, 1e-5); the log has every layer's auxiliary and z
    losses and its tokens per expert (T·k assignments in all). With a capacity, EP2 drops
    the same tokens as one rank. A checkpoint saved at EP2 x ETP2 x TP2 loads at EP1 and
    EP4: the same validation loss, and two more steps give the saving layout's losses."""
    ep2tp2 = ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    ep2etp2 = [*ep2tp2, "--expert-tensor-parallel-size", "2"]
    runs = {
        "single": (1, []),
        "ep2tp2": (4, ep2tp2),
        "ep2etp2tp2": (4, ep2etp2),
        "ep4zero1": (4, ["--expert-model-parallel-size", "4", "--zero-stage", "1"]),
        "ep2pp2": (4, ["--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
        "ep2allgather": (2, ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "allgather"]),
    }
    got = {}
    for name, (n, layout) in runs.items():
        log = tmp_path / f"{name}.json"
        out, _ = torchrun(n, [*MODEL, *MIXTRAL, "--train-iters", "10", *layout, "--log-json", str(log)])
        assert out.returncode == 0, (name, out.stdout[-3000:] + out.stderr[-3000:])
        assert "load balancing loss:" in out.stdout and "tokens per expert min/max/mean" in out.stdout
        got[name] = losses(log)
        assert sorted(got[name]) == list(range(1, 11)), name
        records = [json.loads(line) for line in log.read_text().splitlines()]
        for r in records:
            layers = r["moe"]["layers"]
            assert [l["layer"] for l in layers] == [0, 1, 2, 3]
            for l in layers:
                # 8 samples x 32 tokens, 2 experts each, over the 4 experts.
                assert l["tokens_per_expert_mean"] * 4 == 8 * 32 * 2
                assert l["aux_loss"] > 0 and l["z_loss"] > 0 and l["dropped"] == 0
            if "--expert-model-parallel-size" in layout:
                assert r["comm_bytes"]["ep"] > 0, name  # tokens crossed the EP ranks
            if "--expert-tensor-parallel-size" in layout:
                assert r["comm_bytes"]["etp"] > 0, name  # and the expert-TP ranks
        got[name + "_moe"] = [r["moe"]["aux_loss"] for r in records]
    ref = got["single"]
    assert ref[10] < ref[1]  # it learns
    for name in runs:
        for it, loss in ref.items():
            assert got[name][it] == pytest.approx(loss, rel=1e-5), (name, it)
        assert got[name + "_moe"] == pytest.approx(got["single_moe"], rel=1e-4), name

    # A capacity of half the mean load drops tokens, counted in the log; it is decided on each
    # rank's own tokens before dispatch, so EP 2 drops (and learns) exactly as one rank.
    capped = {}
    for name, (n, layout) in {"cap_single": (1, []), "cap_ep2": (2, ["--expert-model-parallel-size", "2"])}.items():
        log = tmp_path / f"{name}.json"
        out, _ = torchrun(n, [*MODEL, *MIXTRAL, "--train-iters", "4", "--moe-expert-capacity-factor", "0.5", *layout,
                              "--log-json", str(log)])
        assert out.returncode == 0, (name, out.stdout[-3000:] + out.stderr[-3000:])
        records = [json.loads(line) for line in log.read_text().splitlines()]
        assert all(r["moe"]["dropped"] > 0 for r in records), name
        capped[name] = [(r["loss"], r["moe"]["dropped"]) for r in records]
    for (a, da), (b, db) in zip(capped["cap_single"], capped["cap_ep2"]):
        assert a == pytest.approx(b, rel=1e-5) and da == db

    ckpt = tmp_path / "ckpt"
    out, _ = torchrun(4, [*MODEL, *MIXTRAL, "--train-iters", "4", *ep2etp2, "--zero-stage", "1", "--save", str(ckpt)])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    layouts = {"ep2etp2tp2": (4, [*ep2etp2, "--zero-stage", "1"]), "ep1": (1, []),
               "ep4": (4, ["--expert-model-parallel-size", "4"])}
    check_reload_matches(tmp_path, ckpt, layouts, "ep2etp2tp2", model=[*MODEL, *MIXTRAL])


@pytest.mark.parametrize("args, message", [
    (["--expert-model-parallel-size", "3"], "(3 x 1) to divide the ranks of a pipeline stage"),
    (["--expert-model-parallel-size", "4", "--num-experts", "2"], "--num-experts (2) to be divisible by "
                                                                  "--expert-model-parallel-size (4)"),
    (["--moe-router-topk", "5"], "--moe-router-topk in [1, 4]"),
    (["--expert-tensor-parallel-size", "4", "--expert-model-parallel-size", "2"],
     "--expert-model-parallel-size x --expert-tensor-parallel-size (2 x 4) to divide the ranks of a pipeline stage"),
    (["--expert-tensor-parallel-size", "4", "--moe-ffn-hidden-size", "50"],
     "to be divisible by --expert-tensor-parallel-size (4)"),
    (["--zero-stage", "3"], "ZeRO-3 does not shard expert parameters"),
])
def test_bad_moe_configuration_fails_fast(args, message):
    fails_fast(replaced([*MODEL, *MIXTRAL], [*args, "--lr-warmup-iters", "0"]), [*args, "--lr-warmup-iters", "0"],
               message)


def test_expert_bias_moves_and_resumes_exactly(tmp_path):
    """DeepSeek-V3's auxiliary-loss-free balancing: with --moe-router-enable-expert-bias the
    routing changes from the second step on (the bias moved), and a run resumed from the
    checkpoint of iteration 4 (the biases are model state) continues with the uninterrupted
    run's losses and loads, bit for bit."""
    # The learning rate decays over 6 iterations in every run, the one stopped at 4 too.
    bias = [*MODEL, *MIXTRAL, "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.05",
            "--moe-router-score-function", "sigmoid", "--moe-router-norm-topk-prob", "--expert-model-parallel-size", "2",
            "--lr-decay-iters", "6"]
    plain_log, full_log, resumed_log = (tmp_path / f"{n}.json" for n in ("plain", "full", "resumed"))
    out, _ = torchrun(2, [*MODEL, *MIXTRAL, "--moe-router-score-function", "sigmoid", "--moe-router-norm-topk-prob",
                          "--expert-model-parallel-size", "2", "--train-iters", "6", "--log-json", str(plain_log)])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    out, _ = torchrun(2, [*bias, "--train-iters", "6", "--log-json", str(full_log)])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ckpt = tmp_path / "ckpt"
    out, _ = torchrun(2, [*bias, "--train-iters", "4", "--save", str(ckpt)])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    out, _ = torchrun(2, [*bias, "--train-iters", "6", "--load", str(ckpt), "--log-json", str(resumed_log)])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "loaded checkpoint" in out.stdout
    loads = lambda path: {r["iteration"]: [l["tokens_per_expert_max"] for l in r["moe"]["layers"]]
                          for r in map(json.loads, Path(path).read_text().splitlines())}
    plain, full, resumed = loads(plain_log), loads(full_log), loads(resumed_log)
    assert plain[1] == full[1]  # the first step routes before any update
    assert any(plain[i] != full[i] for i in range(2, 7))  # then the biases steer it
    # Bit for bit: the same layout and ranks, the model (biases included), optimizer, RNG and
    # data position from the checkpoint (as test_killed_rank_resumes_bit_for_bit).
    for it in (5, 6):
        assert resumed[it] == full[it], it
        assert losses(resumed_log)[it] == losses(full_log)[it], it
