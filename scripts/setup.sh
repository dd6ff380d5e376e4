#!/usr/bin/env bash
# One-time (idempotent) setup: Debian build packages, then the project's virtual
# environment at .venv/ with the pinned torch and the megatorch Python package.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

# libgloo-dev: headers only, for ProcessGroupGloo.hpp (the torch wheel does not ship them).
DEB_PACKAGES=(catch2 ccache ninja-build cmake g++ libcli11-dev nlohmann-json3-dev pybind11-dev libgloo-dev)
missing=()
for p in "${DEB_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  mt_log "installing Debian packages: ${missing[*]}"
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

if [[ -n "${MEGATORCH_PYTHON:-}" ]]; then
  mt_log "using $MEGATORCH_PYTHON and its torch (MEGATORCH_PYTHON is set); not creating .venv"
  "$MEGATORCH_PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  "$MEGATORCH_PYTHON" -m pip install -q pytest expecttest numpy 2>/dev/null || true
  exit 0
fi

if [[ ! -x "$MT_VENV/bin/python" ]]; then
  mt_log "creating $MT_VENV"
  python3 -m venv "$MT_VENV"
  "$MT_VENV/bin/pip" install -q --upgrade pip
fi
stamp="$MT_VENV/.requirements.sha"
want="$(sha256sum "$MT_ROOT/requirements.txt" "$MT_ROOT/torch_ext/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
  mt_log "installing requirements.txt into .venv (first time: several GB of CUDA wheels)"
  "$MT_VENV/bin/pip" install -q -r "$MT_ROOT/requirements.txt"
  # Editable: `import megatorch` works from any directory and finds build/lib.
  "$MT_VENV/bin/pip" install -q --no-deps -e "$MT_ROOT/torch_ext"
  echo "$want" > "$stamp"
fi
"$MT_VENV/bin/python" -c "import torch; print('[megatorch] torch', torch.__version__, 'cuda', torch.version.cuda)"
