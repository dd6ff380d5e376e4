"""The fault-injection suite: gpt_pretrain under torchrun on CPU ranks, with the faults a
cluster has (a preemption's SIGTERM, a kill while an asynchronous save writes, a NaN in
one rank's gradients, a slow rank, a full disk). Each run must end in a defined state:
resumed with the final checkpoint byte-identical to an uninterrupted run's, or stopped
with an error naming the fault; and the last complete checkpoint is never lost.
docs/reliability.md has the table these cases fill."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from binaries import children

ROOT = Path(__file__).resolve().parents[3]
BIN = Path(os.environ.get("MEGATORCH_BIN_DIR", ROOT / "build" / "bin"))
TRAIN = BIN / "gpt_pretrain"
DATA = ROOT / "data" / "default" / "stdlib_docs_text_document"
ITERS = 12
# TP2 x DP2 with ZeRO-1 and dropout: the random generators resume too.
ARGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
        "--vocab-size", "257", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "3e-3",
        "--lr-warmup-iters", "2", "--data-path", str(DATA), "--eval-iters", "0", "--log-interval", "1",
        "--seed", "7", "--tensor-model-parallel-size", "2", "--use-distributed-optimizer",
        "--hidden-dropout", "0.1", "--train-iters", str(ITERS), "--save-interval", "4"]


def without_tp(args):
    tp = args.index("--tensor-model-parallel-size")
    return [*args[:tp], *args[tp + 2:]]


def command(args, restarts=0):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
            f"--max-restarts={restarts}", "--no-python", str(TRAIN), *args]


def environment(faults=""):
    env = dict(os.environ, OMP_NUM_THREADS="1", MEGATORCH_COMM_TIMEOUT_S="60")
    env.pop("MEGATORCH_NCCL_CHECK", None)
    if faults:
        env["MEGATORCH_FAULT_INJECTION"] = faults
    return env


def train(args, faults="", **kw):
    return subprocess.run(command(args), capture_output=True, text=True, timeout=600, env=environment(faults), **kw)


def losses(path):
    return {r["iteration"]: r["loss"] for r in map(json.loads, Path(path).read_text().splitlines())}


def latest(ckpt):
    return int((ckpt / "latest_checkpointed_iteration.txt").read_text())


def same_checkpoint(a, b, iteration):
    """Every rank's shard and the metadata of `iteration` byte-identical in both runs."""
    name = f"iter_{iteration:07d}"
    files = sorted(p.name for p in (a / name).iterdir())
    assert files == sorted(p.name for p in (b / name).iterdir())
    for f in files:
        assert (a / name / f).read_bytes() == (b / name / f).read_bytes(), f"{name}/{f} differs"


def start(args, faults="", restarts=0):
    return subprocess.Popen(command(args, restarts), env=environment(faults), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)


def read_until(proc, pattern, timeout=300):
    """The process's output up to the first line matching `pattern` (which must come)."""
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if re.search(pattern, line):
            return "".join(seen)
    proc.kill()
    raise AssertionError(f"never printed {pattern!r}:\n" + "".join(seen)[-4000:])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: its checkpoints (4, 8, 12) and per-iteration losses."""
    d = tmp_path_factory.mktemp("reference")
    out = train([*ARGS, "--save", str(d / "ckpt"), "--log-json", str(d / "log.json")])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return d / "ckpt", losses(d / "log.json")


def test_async_save_writes_the_same_checkpoints(tmp_path, reference):
    ref_ckpt, ref_losses = reference
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.json"
    out = train([*ARGS, "--async-save", "--save", str(ckpt), "--log-json", str(log)])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.count("in the background") == 3, out.stdout[-3000:]
    assert losses(log) == ref_losses
    assert latest(ckpt) == ITERS
    for it in (4, 8, 12):
        same_checkpoint(ref_ckpt, ckpt, it)


def test_preemption_saves_exits_zero_and_resumes_bit_for_bit(tmp_path, reference):
    """SIGTERM to one rank mid-run (a preemption notice): every rank finishes the iteration,
    saves and exits 0; the rerun resumes there and ends where the uninterrupted run did."""
    ref_ckpt, ref_losses = reference
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.json"
    args = [*ARGS, "--exit-signal-handler", "--save", str(ckpt), "--load", str(ckpt), "--log-json", str(log)]
    proc = start(args)
    read_until(proc, r"iteration +5/")
    os.kill(children(proc.pid)[1], signal.SIGTERM)
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, output[-4000:]
    stopped = re.search(r"stopping after iteration (\d+) of 12 \(signal SIGTERM\), checkpoint saved", output)
    assert stopped, output[-4000:]
    at = int(stopped.group(1))
    assert 5 <= at < ITERS and latest(ckpt) == at
    out = train(args)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"(iteration {at}," in out.stdout
    assert losses(log) == ref_losses
    same_checkpoint(ref_ckpt, ckpt, ITERS)


def test_kill_during_an_async_write_keeps_the_previous_checkpoint(tmp_path, reference):
    """SIGKILL while iteration 8's save is written (a slow disk): `latest` still names 4,
    which loads, and the rerun from it ends byte-identical to the uninterrupted run."""
    ref_ckpt, ref_losses = reference
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.json"
    args = [*ARGS, "--async-save", "--save", str(ckpt), "--load", str(ckpt), "--log-json", str(log)]
    proc = start(args, faults="slow_save@4000")
    read_until(proc, r"saving checkpoint at iteration 8 .* in the background")
    os.kill(children(proc.pid)[0], signal.SIGKILL)
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode != 0, output[-4000:]
    assert latest(ckpt) == 4
    assert not (ckpt / "iter_0000008").exists()
    out = train(args)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "(iteration 4," in out.stdout
    assert losses(log) == ref_losses
    same_checkpoint(ref_ckpt, ckpt, ITERS)


def test_nan_in_one_ranks_gradients_stops_naming_iteration_rank_and_parameter(tmp_path):
    ckpt = tmp_path / "ckpt"
    out = train([*ARGS, "--save", str(ckpt)], faults="nan_grad@6:1")
    assert out.returncode != 0
    err = out.stderr
    assert "iteration 6: the reduced gradients are not finite" in err, err[-3000:]
    assert re.search(r"not finite \(norm [^)]+\), on rank \d: [\w.]+", err), err[-3000:]
    assert "--skip-nan-steps" in err
    assert "Exception raised from" not in err  # one line per rank, no C++ backtrace
    assert latest(ckpt) == 4  # nothing after the last complete save was published


def test_skip_nan_steps_skips_and_logs_then_goes_on(tmp_path):
    log = tmp_path / "log.json"
    out = train([*ARGS, "--skip-nan-steps", "1", "--log-json", str(log), "--save-interval", "0"], faults="nan_grad@6:1")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "iteration 6: the reduced gradients are not finite" in out.stdout
    assert "step skipped, nothing applied (1 of --skip-nan-steps 1)" in out.stdout
    rows = {r["iteration"]: r for r in map(json.loads, log.read_text().splitlines())}
    assert rows[6]["skipped"] and not any(rows[i]["skipped"] for i in rows if i != 6)


def test_straggler_report_names_the_slow_rank(tmp_path):
    log = tmp_path / "log.json"
    # DP4 without TP: a rank's compute time is its own (no TP collectives inside it).
    out = train([*without_tp(ARGS), "--log-straggler", "--log-json", str(log), "--save-interval", "0", "--train-iters", "4"],
                faults="slow_rank@2:100")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert all(r["straggler"]["slowest_rank"] == 2 for r in rows), [r["straggler"] for r in rows]
    for r in rows:
        s = r["straggler"]
        assert len(s["rank_ms"]) == 4 and s["min_ms"] <= s["median_ms"] <= s["max_ms"] == max(s["rank_ms"])
        assert s["max_ms"] >= 100  # the injected sleep is inside rank 2's backward
    assert "(slowest rank 2)" in out.stdout


def test_rerun_tells_a_transient_fault_from_a_reproducible_one(tmp_path, reference):
    """--rerun-mode validate_results: rank 3 adds 1000 to its share of iteration 6's loss.
    On the first run only (transient), the rerun differs: rank 3 is named and the rerun's
    step kept, so every loss and the final checkpoint equal the uninterrupted run's. On
    every run (reproducible), the rerun agrees: a data or model fault naming the step's
    samples, and the spiking step is applied."""
    ref_ckpt, ref_losses = reference
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.json"
    out = train([*ARGS, "--rerun-mode", "validate_results", "--save", str(ckpt), "--log-json", str(log)],
                faults="loss_spike@6:3")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert re.search(r"rerun: iteration 6's loss \S+ became \S+ on a rerun from the same state: a transient fault "
                     r"\(ranks whose own share of the loss differed: 3\); the rerun's step is kept", out.stdout), out.stdout
    rows = {r["iteration"]: r for r in map(json.loads, log.read_text().splitlines())}
    assert rows[6]["rerun"] == "transient" and all("rerun" not in rows[i] for i in rows if i != 6)
    assert losses(log) == ref_losses
    same_checkpoint(ref_ckpt, ckpt, ITERS)

    log2 = tmp_path / "log2.json"
    out = train([*ARGS, "--rerun-mode", "validate_results", "--log-json", str(log2), "--save-interval", "0"],
                faults="loss_spike_persistent@6:3")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "came out the same on a rerun from the same state: a data or model fault" in out.stdout
    assert "the step's samples are [40, 48) of the training order" in out.stdout
    rows = {r["iteration"]: r for r in map(json.loads, log2.read_text().splitlines())}
    assert rows[6]["rerun"] == "reproducible" and rows[6]["loss"] > 100 and not rows[6]["skipped"]


@pytest.mark.parametrize("flag,value,reason", [("--exit-interval", "3", "exit interval 3"),
                                               ("--exit-duration-in-mins", "1e-9", "exit duration 1e-09 min")])
def test_exit_interval_and_duration_save_and_exit_zero(tmp_path, flag, value, reason):
    ckpt = tmp_path / "ckpt"
    out = train([*ARGS, flag, value, "--save", str(ckpt), "--save-interval", "0"])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    stopped = re.search(r"stopping after iteration (\d+) of 12 \((.*)\), checkpoint saved", out.stdout)
    assert stopped and stopped.group(2) == reason, out.stdout[-3000:]
    assert latest(ckpt) == int(stopped.group(1)) == (3 if flag == "--exit-interval" else 1)


def test_full_disk_during_a_save_stops_and_keeps_the_previous_checkpoint(tmp_path, reference):
    """Iteration 4 saved; the run resumed under a file size limit smaller than one shard
    (writes fail with EFBIG, as on a full disk) fails naming the shard, and 4 still loads."""
    ckpt = tmp_path / "ckpt"
    out = train([*ARGS, "--save", str(ckpt), "--exit-interval", "4"])  # the reference's schedule, stopped at 4
    assert out.returncode == 0, out.stderr[-3000:]
    limit = min(p.stat().st_size for p in (ckpt / "iter_0000004").glob("rank_*.safetensors")) // 2
    preexec = lambda: (signal.signal(signal.SIGXFSZ, signal.SIG_IGN),  # noqa: E731
                       __import__("resource").setrlimit(__import__("resource").RLIMIT_FSIZE, (limit, limit)))
    for flags in ([], ["--async-save"]):
        out = train([*ARGS, *flags, "--save", str(ckpt), "--load", str(ckpt)],
                    preexec_fn=preexec)
        assert out.returncode != 0
        assert re.search(r"writing '[^']*/iter_0000008\.tmp/rank_0000\d\.safetensors' failed: File too large; is the "
                         r"disk full\?", out.stderr), out.stderr[-3000:]
        assert latest(ckpt) == 4 and not (ckpt / "iter_0000008").exists()
    out = train([*ARGS, "--save", str(ckpt), "--load", str(ckpt)])
    assert out.returncode == 0 and "(iteration 4," in out.stdout, out.stderr[-3000:]
    same_checkpoint(reference[0], ckpt, ITERS)


def single_rank(faults=""):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return dict(environment(faults), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_checkpoint_is_refused_by_name_and_the_one_before_resumes(tmp_path, reference, damage):
    """A shard of the newest checkpoint (8) truncated, or one byte flipped (a bad disk, a partial
    copy): resuming fails on every rank naming the file, before any weight changes;
    --ckpt-step 4 names the save before it, which resumes and ends byte-identical."""
    import shutil
    ref_ckpt, ref_losses = reference
    ckpt = tmp_path / "ckpt"
    shutil.copytree(ref_ckpt, ckpt)
    shutil.rmtree(ckpt / "iter_0000012")  # as if the run had stopped after saving 8
    (ckpt / "latest_checkpointed_iteration.txt").write_text("8\n")
    shard = ckpt / "iter_0000008" / "rank_00001.safetensors"
    data = bytearray(shard.read_bytes())
    if damage == "truncate":
        shard.write_bytes(data[: len(data) // 2])
    else:
        data[len(data) // 2] ^= 0x10
        shard.write_bytes(data)
    out = train([*ARGS, "--save", str(ckpt), "--load", str(ckpt)])
    assert out.returncode != 0
    expected = "the file is truncated or damaged" if damage == "truncate" else "fails its checksum"
    assert re.search(r"iter_0000008/rank_00001\.safetensors'.*" + expected, out.stderr), out.stderr[-3000:]
    assert latest(ckpt) == 8 and not (ckpt / "iter_0000012").exists()  # nothing was saved over it
    out = train([*ARGS, "--save", str(ckpt), "--load", str(ckpt), "--ckpt-step", "4"])
    assert out.returncode == 0 and "(iteration 4," in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]
    same_checkpoint(ref_ckpt, ckpt, ITERS)


def test_bad_flags_are_refused_by_name():
    for args, message in [(["--exit-interval", "-1"], "--exit-interval >= 0"),
                          (["--skip-nan-steps", "-2"], "--skip-nan-steps >= 0"),
                          (["--exit-duration-in-mins", "nan"], "--exit-duration-in-mins to be a finite number"),
                          (["--async-save"], "--async-save needs --save DIR"),
                          (["--spike-threshold", "1"], "--spike-threshold to be a finite number > 1"),
                          (["--rerun-mode", "report_stats"], "--rerun-mode"),
                          (["--ckpt-step", "3"], "--ckpt-step needs --load DIR")]:
        out = subprocess.run([str(TRAIN), *without_tp(ARGS)[:-4], *args], capture_output=True, text=True, timeout=120,
                             env=single_rank())
        assert out.returncode == 1 and message in out.stderr, (args, out.stderr[-2000:])
    out = subprocess.run([str(TRAIN), *without_tp(ARGS)[:-4]], capture_output=True, text=True, timeout=120,
                         env=single_rank("nan_grad@0:1"))
    assert out.returncode == 1 and "iterations count from 1" in out.stderr, out.stderr[-2000:]


def test_a_hung_rank_times_out_naming_the_collective_and_the_job_restarts(tmp_path, reference):
    """SIGSTOP to one worker (a hang: a stuck driver, a dead NIC): the others' next
    collective times out with an error naming the group, the operation and its sequence
    number; torchrun stops every worker (SIGKILL reaches the stopped one) and restarts
    them from the last checkpoint, and the job ends byte-identical to the uninterrupted run."""
    ref_ckpt, ref_losses = reference
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.json"
    args = [*ARGS, "--save", str(ckpt), "--load", str(ckpt), "--log-json", str(log)]
    env = dict(environment("slow_rank@0:100"), MEGATORCH_COMM_TIMEOUT_S="10")
    proc = subprocess.Popen(command(args, restarts=1), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and (not log.exists() or len(log.read_text().splitlines()) < 6):
        time.sleep(0.1)
    os.kill(children(proc.pid)[2], signal.SIGSTOP)
    output = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, output[-4000:]
    assert re.search(r"collective \w+ #\d+ on group '[^']+'.*timeout 10 s", output), output[-4000:]
    assert output.count("gpt_pretrain: world 4") == 2, output[-4000:]
    for r in map(json.loads, log.read_text().splitlines()):
        assert r["loss"] == ref_losses[r["iteration"]], r["iteration"]
    same_checkpoint(ref_ckpt, ckpt, ITERS)


def test_three_kills_at_random_iterations_under_max_restarts(tmp_path, reference):
    """A random rank SIGKILLed at a random iteration, three times in one job: torchrun
    restarts every rank from the last checkpoint each time, and the job ends byte-identical
    to the uninterrupted run, every logged loss equal to its."""
    import random
    ref_ckpt, ref_losses = reference
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.json"
    args = [*ARGS, "--save", str(ckpt), "--load", str(ckpt), "--log-json", str(log)]
    # Rank 0 sleeps 150 ms in each backward, so the kills land while the job runs.
    proc = start(args, faults="slow_rank@0:150", restarts=3)
    rng = random.Random(20261207)
    logged = 0
    for _ in range(3):
        logged += rng.randint(1, 3)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and (not log.exists() or len(log.read_text().splitlines()) < logged):
            time.sleep(0.1)
        os.kill(rng.choice(children(proc.pid)), signal.SIGKILL)
        # The agent notices, stops the others and starts new workers.
        deadline = time.monotonic() + 120
        old = set(children(proc.pid))
        while time.monotonic() < deadline and (len(children(proc.pid)) < 4 or set(children(proc.pid)) & old):
            time.sleep(0.1)
    output = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, output[-4000:]
    assert output.count("gpt_pretrain: world 4") == 4, output[-4000:]  # the first start and 3 restarts
    for r in map(json.loads, log.read_text().splitlines()):
        assert r["loss"] == ref_losses[r["iteration"]], r["iteration"]
    same_checkpoint(ref_ckpt, ckpt, ITERS)
