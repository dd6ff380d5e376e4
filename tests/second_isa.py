"""Runs a test command on a second CPU rounding path: another ATen CPU capability and the
matching MKL and oneDNN code paths.

Usage: python tests/second_isa.py COMMAND [ARGS...]

A parity test that passes only on the machine's own path is tied to one CPU's rounding:
another CPU (an AMD EPYC, say) sums in another order. So CI runs the parity suites once
more here: under AVX2 where the machine's default is AVX-512, under the scalar 'default'
path where its default is AVX2. Where neither applies (a CPU with no AVX2) there is no
second x86 path to take: the run is skipped with that reason (exit 77, which CTest counts
as skipped, never as passed).
"""
import os
import subprocess
import sys

SKIP = 77

# The machine's default capability -> (ATEN_CPU_CAPABILITY, MKL_ENABLE_INSTRUCTIONS, ONEDNN_MAX_CPU_ISA).
SECOND_PATH = {
    "AVX512": ("avx2", "AVX2", "AVX2"),
    "AVX2": ("default", "SSE4_2", "SSE41"),
}


def capability(env):
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                         env=env, check=True, capture_output=True, text=True)
    return out.stdout.strip()


def main(argv):
    if not argv:
        sys.exit(__doc__)
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS",
                                                              "ONEDNN_MAX_CPU_ISA")}
    default = capability(env)
    if default not in SECOND_PATH:
        print(f"skipped: this CPU's default ATen capability is {default}; there is no second x86 path "
              f"({', '.join(SECOND_PATH)} have one)", flush=True)
        return SKIP
    aten, mkl, onednn = SECOND_PATH[default]
    env.update(ATEN_CPU_CAPABILITY=aten, MKL_ENABLE_INSTRUCTIONS=mkl, ONEDNN_MAX_CPU_ISA=onednn)
    taken = capability(env)
    if taken == default:
        sys.exit(f"ATEN_CPU_CAPABILITY={aten} left ATen on {default}: the second path did not take effect")
    print(f"second rounding path: ATen {taken} (the machine's default is {default}), "
          f"MKL_ENABLE_INSTRUCTIONS={mkl}, ONEDNN_MAX_CPU_ISA={onednn}", flush=True)
    return subprocess.call(argv, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
