"""How much of the machine something other than the benchmark used while a run timed.

The benchmark machine may be shared (here: 2 cores, with builds and tests of the same
project starting at any time). A run that shares its cores with a compiler measures the
compiler. So the suite waits for the machine to be idle before each run, and measures,
during the run, the CPU time spent by processes outside the run:

    other = (busy CPU time of the whole machine, /proc/stat) - (CPU time of the run's
            process tree, getrusage(RUSAGE_CHILDREN) once it has been waited for)

as a share of the machine's capacity over the run's wall time. The report shows it next
to every step time, so a disturbed number is visible as such.
"""
import os
import resource
import time

_HZ = os.sysconf("SC_CLK_TCK")


def _busy_seconds() -> float:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / _HZ


def _own_seconds() -> float:
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        r = resource.getrusage(who)
        total += r.ru_utime + r.ru_stime
    return total


def busy_share(seconds: float = 2.0) -> float:
    """The machine's busy share over `seconds` (0 = idle, 1 = every core busy)."""
    b0, t0 = _busy_seconds(), time.time()
    time.sleep(seconds)
    return (_busy_seconds() - b0) / ((time.time() - t0) * os.cpu_count())


def wait_until_idle(threshold: float = 0.15, max_wait: float = 900.0, log=print) -> float:
    """Waits (up to max_wait seconds) for the machine's busy share to fall below
    `threshold`; returns the seconds waited."""
    t0 = time.time()
    share = busy_share()
    while share > threshold and time.time() - t0 < max_wait:
        log(f"[cpu_peers]   machine busy ({share:.0%} of {os.cpu_count()} cores, not this benchmark); waiting")
        time.sleep(20)
        share = busy_share()
    return time.time() - t0


class OtherLoad:
    """`with OtherLoad() as o: subprocess.run(...)` then `o.share`: the CPU share that
    processes outside the waited-for child tree used during the block."""

    def __enter__(self):
        self._t, self._busy, self._own = time.time(), _busy_seconds(), _own_seconds()
        return self

    def __exit__(self, *exc):
        wall = time.time() - self._t
        other = (_busy_seconds() - self._busy) - (_own_seconds() - self._own)
        self.share = max(0.0, other / (wall * os.cpu_count()))
        return False
