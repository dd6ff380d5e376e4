#!/usr/bin/env bash
# Configure (once) and build into build/ with Ninja, ccache and a precompiled header.
# Extra arguments go to the configure step, e.g. -DMEGATORCH_BUILD_TESTS=OFF.
# MEGATORCH_TARGETS="megatorch ..." builds only those targets (default: all).
# --sanitize (first argument): AddressSanitizer + UndefinedBehaviorSanitizer build of the
# test binaries that parse files (megatorch_unit_tests, megatorch_mp_tests) in build-sanitize/
# (MEGATORCH_SANITIZE_BUILD_DIR), separate from build/; scripts/test.sh --sanitize runs them.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
sanitize_args=()
if [[ "${1:-}" == "--sanitize" ]]; then
  shift
  MT_BUILD="${MEGATORCH_SANITIZE_BUILD_DIR:-$MT_ROOT/build-sanitize}"
  # vptr is off: libtorch itself is not instrumented, so its classes would be reported falsely.
  san="-fsanitize=address,undefined -fno-sanitize=vptr -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g"
  sanitize_args=(-DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS=$san" "-DCMAKE_EXE_LINKER_FLAGS=$san"
                 "-DCMAKE_SHARED_LINKER_FLAGS=$san" -DMEGATORCH_BUILD_EXAMPLES=OFF)
  MEGATORCH_TARGETS="${MEGATORCH_TARGETS:-megatorch_unit_tests megatorch_mp_tests}"
fi
PY="$(mt_python)"
TORCH_PREFIX="$("$PY" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')"
NCCL_HINT="$("$PY" -c 'import os, nvidia.nccl as n; print(os.path.join(list(n.__path__)[0], "include"))' 2>/dev/null || true)"
# ccache and precompiled headers: these let ccache hash the .gch instead of refusing it.
export CCACHE_SLOPPINESS="pch_defines,time_macros,include_file_mtime,include_file_ctime"
export CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-5G}"
# Paths under the checkout hashed relative to it: two checkouts (a clean clone, a worktree)
# share cache entries.
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$MT_ROOT}"
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
if [[ ! -f "$MT_BUILD/build.ninja" || "$#" -gt 0 || "$(cat "$MT_BUILD/.python" 2>/dev/null)" != "$PY" ]]; then
  mt_log "configuring $MT_BUILD (torch from $PY)"
  cmake -S "$MT_ROOT" -B "$MT_BUILD" -G Ninja \
    -DCMAKE_PREFIX_PATH="$TORCH_PREFIX" -DMEGATORCH_PYTHON="$PY" \
    -DMEGATORCH_NCCL_HINT="$NCCL_HINT" -DCMAKE_CUDA_COMPILER="${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}" \
    "${launcher[@]}" "${sanitize_args[@]}" "$@" >"$MT_BUILD.configure.log" 2>&1 || { cat "$MT_BUILD.configure.log"; exit 1; }
  echo "$PY" > "$MT_BUILD/.python"
fi
mt_log "building with $MT_JOBS jobs"
targets=()
[[ -n "${MEGATORCH_TARGETS:-}" ]] && targets=(--target ${MEGATORCH_TARGETS})
cmake --build "$MT_BUILD" -j "$MT_JOBS" "${targets[@]}"
