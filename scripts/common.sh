# Shared by every script: repo paths, the Python interpreter and the build folder.
# Sourced, not run.
set -euo pipefail
MT_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MT_BUILD="${MEGATORCH_BUILD_DIR:-$MT_ROOT/build}"
MT_VENV="$MT_ROOT/.venv"
MT_JOBS="${MEGATORCH_JOBS:-2}"

# MEGATORCH_PYTHON=/path/to/python3 uses that interpreter's torch instead of the venv
# (the GPU machine ships torch + CUDA in its own python3).
mt_python() {
  # An absolute path: CMake's FindPython does not search PATH for a bare name.
  if [[ -n "${MEGATORCH_PYTHON:-}" ]]; then command -v "$MEGATORCH_PYTHON" || echo "$MEGATORCH_PYTHON"
  else echo "$MT_VENV/bin/python"; fi
}
mt_log() { printf '\033[1m[megatorch]\033[0m %s\n' "$*" >&2; }
