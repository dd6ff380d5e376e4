"""build/bin's programs from a test: one process, or several under torchrun (one intra-op
thread each, a 60 s communication timeout), output captured."""
import os
import subprocess
import sys
from pathlib import Path

BIN = Path(os.environ.get("MEGATORCH_BIN_DIR", Path(__file__).resolve().parents[2] / "build" / "bin"))
ENV = dict(os.environ, OMP_NUM_THREADS="1", MEGATORCH_COMM_TIMEOUT_S="60")


def launch(*args, nproc=1, torchrun=False, timeout=600):
    """build/bin/args[0] with args[1:]; under torchrun when more than one process or asked."""
    cmd = [str(BIN / args[0])]
    if nproc > 1 or torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "--no-python", *cmd]
    return subprocess.run([*cmd, *map(str, args[1:])], capture_output=True, text=True, errors="replace",
                          timeout=timeout, env=ENV)


def run(*args, nproc=1, torchrun=False, timeout=600):
    """launch(), which must succeed; its stdout."""
    out = launch(*args, nproc=nproc, torchrun=torchrun, timeout=timeout)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return out.stdout


def children(pid):
    """The pids whose parent is `pid` (torchrun's workers), from /proc."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(d.name))
    return sorted(out)
