# Shared by scripts/bench and scripts/test: a project-local venv with PyTorch pinned to the CPU build.
# The editable install compiles the hot path in place (setup.py): src/streamdag/native/_speedups*.so.
venv_install() {
  local python="${PYTHON:-python3}"
  if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
  fi
  if ! .venv/bin/python -m pip install --disable-pip-version-check -c constraints.txt -e "$1" \
      >.venv/pip-install.log 2>&1; then
    cat .venv/pip-install.log >&2
    echo "installing streamdag$1 failed (log above)" >&2
    exit 1
  fi
}
