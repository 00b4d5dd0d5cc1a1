#!/usr/bin/env bash
# One GPU session, in the order that matters if time runs out: the 886M comparison with
# FSDP2 (eager, optimizers and offload, then compiled), the small example model, then the tests that need a
# GPU. Every part writes its log under $OUT as it goes, so a cut session keeps what ran.
#
#   OUT=runs/gpu bash benchmarks/gpu_session.sh          # on a GPU machine
#   OUT=runs/gpu bash benchmarks/gpu_session.sh --cpu    # the same commands on gloo, tiny sizes
#   PYTHON=.venv/bin/python ...                          # another interpreter
#
# A machine without network access and without optree: put optree's wheel in runs/whl/ (it
# is unpacked onto PYTHONPATH, nothing is installed).
set -u
PY=${PYTHON:-python}
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
CPU=""
[ "${1:-}" = "--cpu" ] && CPU="--cpu"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import optree" 2>/dev/null; then
    for w in runs/whl/optree-*.whl; do "$PY" -m zipfile -e "$w" runs/pydeps; done
    export PYTHONPATH="$PWD/runs/pydeps:$PYTHONPATH"
fi

part() {  # part NAME SECONDS CMD...: run, log to $OUT/NAME.txt, show the tail
    local name=$1 secs=$2; shift 2
    local t0=$SECONDS
    echo "== $name: $*"
    timeout "$secs" "$@" > "$OUT/$name.txt" 2>&1
    local rc=$?
    echo "rc=$rc seconds=$((SECONDS - t0))" >> "$OUT/$name.txt"
    tail -n 45 "$OUT/$name.txt"
}

part env 60 "$PY" -c "import torch, optree, vfsdp; print(torch.__version__, torch.version.cuda, \
torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU', optree.__version__, vfsdp.__version__)"
part large 330 "$PY" benchmarks/gpu_vs_fsdp2.py $CPU --configs large --systems vfsdp fsdp2 torch \
    vfsdp_offload fsdp2_offload --timeout 200 --json "$OUT/large.json"
part large_compiled 190 "$PY" benchmarks/gpu_vs_fsdp2.py $CPU --configs large --systems vfsdp_compiled \
    --timeout 180 --json "$OUT/large_compiled.json"
part small 80 "$PY" benchmarks/gpu_vs_fsdp2.py $CPU --configs small --timeout 70 --json "$OUT/small.json"
part tests 60 "$PY" -m pytest -q -p no:cacheprovider -o addopts="" tests/test_devices.py
