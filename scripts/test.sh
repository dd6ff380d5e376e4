#!/usr/bin/env bash
# The README's test command: setup, configure, build, then every test through CTest
# (Catch2 single- and multi-rank under torchrun, pytest, the find_package consumer).
# Exits non-zero when anything fails.
# --sanitize (first argument): instead, the tests that parse files under AddressSanitizer and
# UndefinedBehaviorSanitizer, from build-sanitize/ (scripts/build.sh --sanitize); not part of
# the default run.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
if [[ "${1:-}" == "--sanitize" ]]; then
  shift
  start=$(date +%s)
  "$MT_ROOT/scripts/setup.sh"
  "$MT_ROOT/scripts/build.sh" --sanitize
  SAN_BUILD="${MEGATORCH_SANITIZE_BUILD_DIR:-$MT_ROOT/build-sanitize}"
  export OMP_NUM_THREADS=1 MEGATORCH_COMM_TIMEOUT_S=60 MEGATORCH_BIN_DIR="$SAN_BUILD/bin"
  # Leak checking is off: libtorch's process-lifetime allocations would be reported.
  export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=0:protect_shadow_gap=0:abort_on_error=1}"
  export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
  status=0
  mt_log "sanitized: megatorch_unit_tests [data],[loader],[safetensors],[tokenizer]"
  "$SAN_BUILD/bin/megatorch_unit_tests" "[data],[loader],[safetensors],[tokenizer]" "$@" || status=1
  # The checkpoint tests need two ranks (TP2 saves, other layouts load; damaged shards).
  mt_log "sanitized: megatorch_mp_tests [ckpt] on 2 ranks"
  "$(mt_python)" -m torch.distributed.run --standalone --nproc-per-node=2 --no-python \
    "$SAN_BUILD/bin/megatorch_mp_tests" "[ckpt]" || status=1
  mt_log "sanitized build + tests took $(( $(date +%s) - start )) s"
  exit $status
fi
start=$(date +%s)
"$MT_ROOT/scripts/setup.sh"
"$MT_ROOT/scripts/build.sh"
cd "$MT_BUILD"
export OMP_NUM_THREADS=1
mt_log "running CTest"
status=0
ctest --output-on-failure --timeout 900 "$@" 2>&1 | tee ctest.out || status=$?  # pipefail: ctest's status
# What each CTest entry ran inside (Catch2 test cases, pytest tests), from CTest's log.
mt_log "inside each CTest test:"
awk '/^[0-9]+\/[0-9]+ Testing: /{name=$3}
     /All tests passed \(|test cases:|^[0-9]+ passed|passed, [0-9]+ skipped|[0-9]+ failed/{
       line=$0; sub(/^\[default[0-9]+\]:/, "", line); sub(/ in [0-9.]+s.*$/, "", line); key=name line
       if (!(key in seen)) { seen[key]=1; printf "  %-22s %s\n", name, line } }' \
  Testing/Temporary/LastTest.log 2>/dev/null || true
mt_log "setup + build + tests took $(( $(date +%s) - start )) s"
total=$(sed -n 's/.*tests failed out of \([0-9]*\).*/\1/p' ctest.out | tail -1)
failed=$(sed -n 's/.*, \([0-9]*\) tests failed out of.*/\1/p' ctest.out | tail -1)
[[ -n "$total" ]] && echo "ctest: $(( total - failed )) passed, $failed failed"
exit $status
