#!/usr/bin/env bash
# The GPU checks of a change, in one run on the GPU machine (about 5 minutes on an H100): the cuda
# tests, the per-op and per-copy host cost (bench/overhead.py --native), an A/B of the copy path
# against another version (bench/ab_submit.py --workload copy, if A_SRC is given), the
# copy/compute overlap (bench/overlap.py) and the host<->device transfers (bench/transfers.py). What
# each prints and its JSON go to $OUT (at most nine files), which the lent machine's tool brings back.
#
# Usage, from the repository root: OUT=/some/folder bash bench/gpu_checks.sh [A_SRC]
#   A_SRC: the src folder of the version to compare with (e.g. `git archive <rev> src | tar -x -C ab`)
set -u
out=${OUT:?set OUT to the folder for the results}
mkdir -p "$out"
export PYTHONPATH=src
newest() { ls -t bench/results/"$1"_*.json 2>/dev/null | head -1; }

STREAMDAG_NATIVE=1 timeout 300 python3 -m pytest -q -m cuda -p no:cacheprovider -rfs tests/ \
    > "$out/cuda_tests.txt" 2>&1
tail -4 "$out/cuda_tests.txt"

timeout 200 python3 bench/overhead.py --native > "$out/overhead.txt" 2>&1 \
    && cp "$(newest overhead)" "$out/overhead.json"
tail -16 "$out/overhead.txt"

if [ $# -ge 1 ]; then
    timeout 200 python3 bench/ab_submit.py "$1" src --labels base change --device cuda \
        --workload copy --rounds 150 --ops 250 --workers 4 > "$out/ab_copy.txt" 2>&1 \
        && cp "$(newest ab_submit)" "$out/ab_copy.json"
    tail -3 "$out/ab_copy.txt"
fi

timeout 200 python3 bench/overlap.py > "$out/overlap.txt" 2>&1 \
    && cp "$(newest overlap)" "$out/overlap.json"
grep -v "^CaptureStatistics" "$out/overlap.txt" | tail -31

timeout 200 python3 bench/transfers.py > "$out/transfers.txt" 2>&1 \
    && cp "$(newest transfers)" "$out/transfers.json"
grep -E "MiB|streamdag|PyTorch" "$out/transfers.txt" | tail -26
