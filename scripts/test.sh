#!/usr/bin/env bash
# The README's test command: setup, configure, build, then every test through CTest
# (Catch2 single- and multi-rank under torchrun, pytest, the find_package consumer).
# Exits non-zero when anything fails.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
start=$(date +%s)
"$MT_ROOT/scripts/setup.sh"
"$MT_ROOT/scripts/build.sh"
cd "$MT_BUILD"
export OMP_NUM_THREADS=1
mt_log "running CTest"
ctest --output-on-failure --timeout 900 "$@"
mt_log "setup + build + tests took $(( $(date +%s) - start )) s"
