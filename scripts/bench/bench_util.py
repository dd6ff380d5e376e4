"""Small helpers the CPU benchmark scripts share."""
import platform
import statistics


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (the platform's guess elsewhere)."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def quartiles(xs):
    """The 25th and 75th percentiles (the one value twice for a single sample)."""
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]
