#!/usr/bin/env bash
# Where a chain's host time goes on a GPU host: Linux perf over bench/perf_chain.py, streamdag's
# chain against the same launches straight through PyTorch, and per shared object and per symbol
# the CPU time per op of each and the difference (bench/perf_diff.py).
#
# The lent GPU machines have no perf; one copied there with its libraries runs (user space, with
# perf_event_paranoid 2): PERF=path/to/perf, PERF_LIBS=folder of its shared libraries.
# PERF_CALLGRAPH=1: also frame-pointer call graphs, and per symbol the time spent in it and what it
# calls (children.txt; build the hot path with STREAMDAG_CFLAGS=-fno-omit-frame-pointer for that).
# Usage: PERF=... PERF_LIBS=... PYTHONPATH=src bash bench/perf_chain.sh [ops] [out folder]
set -euo pipefail
ops=${1:-150000}
out=${2:-bench/results/perf_chain}
perf_bin=${PERF:-perf}
export LD_LIBRARY_PATH=${PERF_LIBS:-}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1  # no idle BLAS threads in the profile
mkdir -p "$out"
python3 bench/perf_chain.py chain 2000 > /dev/null  # builds (once) what the first runtime needs
work=$(mktemp -d)
for mode in chain torch; do
  mkfifo "$work/ctl" "$work/ack"
  PERF_CTL=$work/ctl PERF_ACK=$work/ack "$perf_bin" record -e cpu-clock -F 5000 -D -1 \
    ${PERF_CALLGRAPH:+--call-graph fp} \
    --control "fifo:$work/ctl,$work/ack" -o "$work/$mode.data" -- python3 bench/perf_chain.py "$mode" "$ops" \
    | tee "$out/$mode.wall.txt"
  for sort in dso dso,sym pid,dso pid,dso,sym; do
    "$perf_bin" report -i "$work/$mode.data" --no-children --sort "$sort" --stdio 2>/dev/null \
      > "$out/$mode.${sort//,/_}.txt"
  done
  if [ -n "${PERF_CALLGRAPH:-}" ]; then
    "$perf_bin" report -i "$work/$mode.data" --children --sort sym -g none --stdio 2>/dev/null \
      > "$out/$mode.children.txt"
  fi
  rm -f "$work/ctl" "$work/ack"
done
python3 bench/perf_diff.py "$out" "$ops" | tee "$out/diff.txt"
rm -rf "$work"
