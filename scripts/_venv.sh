# Shared by scripts/bench and scripts/test: a project-local venv (.venv) with streamdag installed
# editable (setup.py compiles the hot path in place: src/streamdag/native/_speedups*.so).
#
# PyTorch's build (CPU or CUDA) is chosen by the index a wheel comes from, not by a version pin:
# constraints.txt pins the version only. On Linux, PyPI's torch is the CUDA build (GBs of CUDA
# libraries), so a machine without an NVIDIA GPU gets the CPU build from PyTorch's CPU index.
# STREAMDAG_TORCH_INDEX overrides the choice (an index URL; empty: the default index).
TORCH_CPU_INDEX="https://download.pytorch.org/whl/cpu"

# the index to install torch from here: the CPU index without a working nvidia-smi, else the default
torch_index() {
  if [ -n "${STREAMDAG_TORCH_INDEX+set}" ]; then
    echo "$STREAMDAG_TORCH_INDEX"
  elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo ""  # a GPU: PyPI's default build carries CUDA
  else
    echo "$TORCH_CPU_INDEX"
  fi
}

venv_install() {
  local python="${PYTHON:-python3}" log=.venv/pip-install.log
  if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
  fi
  : >"$log"
  if [[ "$1" == *torch* ]] && ! .venv/bin/python -c "import torch" 2>/dev/null; then
    local index
    index=$(torch_index)
    if [ -n "$index" ]; then
      # torch alone from that index (its dependencies come with streamdag's install, below)
      echo "installing torch from $index" | tee -a "$log"
      if ! .venv/bin/python -m pip install --disable-pip-version-check -c constraints.txt --no-deps \
          --index-url "$index" torch >>"$log" 2>&1; then
        cat "$log" >&2
        echo "installing torch from $index failed (log above); set STREAMDAG_TORCH_INDEX to another" \
             "index, or to '' for the default one" >&2
        exit 1
      fi
    fi
  fi
  if ! .venv/bin/python -m pip install --disable-pip-version-check -c constraints.txt -e "$1" \
      >>"$log" 2>&1; then
    cat "$log" >&2
    echo "installing streamdag$1 failed (log above)" >&2
    exit 1
  fi
  if [[ "$1" == *torch* ]]; then
    .venv/bin/python -c "import torch; print(f'torch {torch.__version__}:',
      f'CUDA {torch.version.cuda} build' if torch.version.cuda else 'CPU build')"
  fi
}
