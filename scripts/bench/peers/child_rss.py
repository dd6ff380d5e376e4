"""Runs a command as a child process and records the child's peak resident set size.

torchrun starts this on every rank in place of gpt_pretrain (`... child_rss.py OUT --
build/bin/gpt_pretrain FLAGS`), so megatorch's peak RSS per rank is read exactly as the
Python peers' is: getrusage's ru_maxrss, here of the finished child. Writes OUT.<RANK>
as JSON and exits with the child's status.
"""
import json
import os
import resource
import subprocess
import sys


def main():
    out, sep, cmd = sys.argv[1], sys.argv[2], sys.argv[3:]
    assert sep == "--", "usage: child_rss.py OUT -- COMMAND [ARGS...]"
    rc = subprocess.call(cmd)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux
    with open(f"{out}.{os.environ.get('RANK', '0')}", "w") as f:
        json.dump({"peak_rss_bytes": peak, "returncode": rc}, f)
    sys.exit(rc)


if __name__ == "__main__":
    main()
