"""save_checkpoint after crashed or colliding saves (single process).

`latest` naming an iteration that is missing or unfinished loads the newest complete one
(with a warning on stderr), or fails naming both when there is none; leftovers of failed
saves (iter_*.tmp*, iter_*.old) are cleared by the next save; a lock file with the
saver's host and pid refuses a second saver into the same directory, and one left by a
dead process is taken over.
"""
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

import megatorch.cpp as mt

CONFIG = dict(hidden_size=32, num_attention_heads=4, num_layers=1, seq_length=8, vocab_size=64)
LATEST = "latest_checkpointed_iteration.txt"
LOCK = ".megatorch_save.lock"


def model(seed):
    return mt.GPTModel(mt.TransformerConfig(**CONFIG, seed=seed))


def same_weights(a, b):
    ref = dict(b.named_parameters())
    return all(torch.equal(p, ref[name]) for name, p in a.named_parameters())


def loads_as(ckpt, seed, iteration=-1):
    """The iteration load_checkpoint reports, after checking it loaded the weights of `seed`."""
    m = model(99)
    got = mt.load_checkpoint(m, str(ckpt), iteration)
    assert same_weights(m, model(seed)), f"loaded iteration {got} does not hold the weights of seed {seed}"
    return got


def test_seeds_differ():
    # Guards loads_as: the weights tell the saved models apart.
    assert not same_weights(model(1), model(2))


# ---- `latest` naming nothing loadable

@pytest.fixture
def two_saves(tmp_path):
    """Iterations 2 (seed 1) and 4 (seed 2); `latest` says 4."""
    ckpt = tmp_path / "ckpt"
    mt.save_checkpoint(model(1), str(ckpt), 2)
    mt.save_checkpoint(model(2), str(ckpt), 4)
    assert (ckpt / LATEST).read_text().strip() == "4"
    return ckpt


def test_latest_naming_a_missing_iteration_loads_the_newest_complete_one(two_saves, capfd):
    (two_saves / LATEST).write_text("7\n")
    assert loads_as(two_saves, 2) == 4
    err = capfd.readouterr().err
    assert "warning" in err and "iter_0000007" in err and "does not exist" in err and "using iter_0000004" in err, err


def test_latest_naming_an_unfinished_iteration_loads_the_previous_one(two_saves, capfd):
    (two_saves / "iter_0000004" / "metadata.json").unlink()
    assert loads_as(two_saves, 1) == 2
    err = capfd.readouterr().err
    assert "has no metadata.json" in err and "using iter_0000002" in err, err
    assert mt.checkpoint_config(str(two_saves)).num_layers == 1  # read_metadata agrees with load


def test_latest_naming_a_missing_iteration_with_none_complete_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    mt.save_checkpoint(model(1), str(ckpt), 4)
    subprocess.run(["rm", "-r", str(ckpt / "iter_0000004")], check=True)
    os.mkdir(ckpt / "iter_0000003")  # incomplete: no metadata.json, so not a candidate
    m = model(99)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    with pytest.raises(RuntimeError) as e:
        mt.load_checkpoint(m, str(ckpt))
    msg = str(e.value)
    assert LATEST in msg and "iter_0000004" in msg and "no other complete iteration" in msg, msg
    assert all(torch.equal(p, before[n]) for n, p in m.named_parameters())


# ---- leftovers of failed saves

def test_stale_temporary_directories_are_cleared_by_the_next_save(tmp_path):
    ckpt = tmp_path / "ckpt"
    mt.save_checkpoint(model(1), str(ckpt), 1)
    stale = [ckpt / "iter_0000005.tmp", ckpt / "iter_0000005.tmp.4242", ckpt / "iter_0000003.tmp"]
    for d in stale:
        os.makedirs(d)
        (d / "rank_00000.safetensors").write_bytes(b"\x10\x00\x00")  # a truncated shard
    keep = ckpt / "notes.tmp"  # not a save's: left alone
    keep.write_text("mine")
    mt.save_checkpoint(model(2), str(ckpt), 6)
    for d in stale:
        assert not d.exists(), d
    assert keep.read_text() == "mine"
    assert loads_as(ckpt, 2) == 6
    assert loads_as(ckpt, 1, 1) == 1


def test_saving_an_iteration_again_replaces_it_and_leaves_nothing_behind(tmp_path):
    ckpt = tmp_path / "ckpt"
    mt.save_checkpoint(model(1), str(ckpt), 3)
    mt.save_checkpoint(model(2), str(ckpt), 3)
    assert loads_as(ckpt, 2) == 3
    assert sorted(os.listdir(ckpt)) == ["iter_0000003", LATEST]


def test_an_iteration_moved_aside_by_a_crashed_replacement_is_put_back(tmp_path):
    # What a crash between the two renames of a replacement leaves (filesystems without
    # an atomic swap): the published iteration as iter_N.old, `latest` naming iter_N.
    ckpt = tmp_path / "ckpt"
    mt.save_checkpoint(model(1), str(ckpt), 3)
    os.rename(ckpt / "iter_0000003", ckpt / "iter_0000003.old")
    with pytest.raises(RuntimeError, match="iter_0000003"):
        mt.load_checkpoint(model(99), str(ckpt))
    mt.save_checkpoint(model(2), str(ckpt), 5)
    assert not (ckpt / "iter_0000003.old").exists()
    assert loads_as(ckpt, 1, 3) == 3
    assert loads_as(ckpt, 2) == 5


# ---- two savers into one directory

def write_lock(ckpt, host, pid):
    os.makedirs(ckpt, exist_ok=True)
    (ckpt / LOCK).write_text(json.dumps({"host": host, "pid": pid, "iteration": 9}) + "\n")


def test_a_live_saver_s_lock_refuses_the_save_and_touches_nothing(tmp_path):
    ckpt = tmp_path / "ckpt"
    mt.save_checkpoint(model(1), str(ckpt), 1)
    # This process is alive: as if another thread of it were saving.
    host, pid = socket.gethostname(), os.getpid()
    write_lock(ckpt, host, pid)
    (ckpt / "iter_0000002.tmp").mkdir()  # the live saver's work in progress
    with pytest.raises(RuntimeError) as e:
        mt.save_checkpoint(model(2), str(ckpt), 2)
    msg = str(e.value)
    assert f"host {host}" in msg and f"pid {pid}" in msg and LOCK in msg, msg
    assert (ckpt / "iter_0000002.tmp").is_dir()  # not cleared: it is not ours
    assert (ckpt / LOCK).exists()  # the owner's lock stays
    assert (ckpt / LATEST).read_text().strip() == "1"
    assert loads_as(ckpt, 1) == 1


def test_another_host_s_lock_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    write_lock(ckpt, "other-host.invalid", 1)
    with pytest.raises(RuntimeError, match=r"host other-host\.invalid, pid 1, another host"):
        mt.save_checkpoint(model(1), str(ckpt), 1)
    assert not (ckpt / LATEST).exists()


def test_an_unreadable_lock_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    os.makedirs(ckpt)
    (ckpt / LOCK).write_text("")  # a saver between creating and writing it
    with pytest.raises(RuntimeError, match="not a saver's host and pid"):
        mt.save_checkpoint(model(1), str(ckpt), 1)


def test_a_dead_saver_s_lock_is_taken_over(tmp_path):
    ckpt = tmp_path / "ckpt"
    p = subprocess.Popen(["true"])
    p.wait()  # exited and reaped: its pid names no process
    write_lock(ckpt, socket.gethostname(), p.pid)
    (ckpt / "iter_0000002.tmp").mkdir()  # what that saver left
    mt.save_checkpoint(model(2), str(ckpt), 2)
    assert not (ckpt / LOCK).exists()  # released when the save ended
    assert not (ckpt / "iter_0000002.tmp").exists()
    assert loads_as(ckpt, 2) == 2


def test_a_save_releases_its_lock_when_it_fails(tmp_path):
    # A full disk (RLIMIT_FSIZE, in a child) fails the shard write, after the lock (a few
    # dozen bytes) was taken: the lock goes, and the next save goes through.
    ckpt = tmp_path / "ckpt"
    code = ("import resource, signal, sys, megatorch.cpp as mt\n"
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.RLIM_INFINITY))\n"
            f"m = mt.GPTModel(mt.TransformerConfig(**{CONFIG!r}, seed=1))\n"
            "try:\n"
            f"    mt.save_checkpoint(m, {str(ckpt)!r}, 6)\n"
            "except RuntimeError as e:\n"
            "    print(e); sys.exit(3)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 3, f"status {out.returncode}\n{out.stdout}\n{out.stderr}"
    assert (ckpt / "iter_0000006.tmp").is_dir(), "the save did not get as far as its shards"
    assert not (ckpt / LOCK).exists()
    mt.save_checkpoint(model(1), str(ckpt), 6)
    assert loads_as(ckpt, 1) == 6
    assert sorted(os.listdir(ckpt)) == ["iter_0000006", LATEST]
