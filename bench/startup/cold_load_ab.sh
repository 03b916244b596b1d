#!/bin/bash
# Engine.load (the weights' placement, no compile) of two checkouts, each in a fresh process after
# IDLE seconds of sleep, alternated round by round: what a restart's load costs on a host whose
# idle memory went back to its hypervisor (bench/startup/first_touch.py). The model file is read
# once before each run, so its pages are in the page cache as a restart finds them.
#   bash bench/startup/cold_load_ab.sh OLD_DIR NEW_DIR GGUF [ROUNDS=3] [IDLE=40]
OLD=$1; NEW=$2; GGUF=$3; ROUNDS=${4:-3}; IDLE=${5:-40}
PY=${PYTHON:-$(cd "$(dirname "$0")/../.." && pwd)/.venv/bin/python}
for r in $(seq 1 $ROUNDS); do
  if [ $((r % 2)) = 1 ]; then order="old new"; else order="new old"; fi
  for side in $order; do
    dir=$OLD; [ $side = new ] && dir=$NEW
    sleep $IDLE
    cat "$GGUF" > /dev/null
    (cd "$dir" && "$PY" -c "
import json, time
from ferrox_jax.config import EngineConfig
from ferrox_jax.engine import Engine
t = time.perf_counter()
e = Engine.load(EngineConfig(model='$GGUF', quantization='auto', kv_cache_dtype='float16', max_seqs=8, max_context=1024))
print(json.dumps({'side': '$side', 'round': $r, 'load_s': round(e.load_s, 2), 'total_s': round(time.perf_counter() - t, 2),
                  'load_avg': float(open('/proc/loadavg').read().split()[0])}), flush=True)
" 2>/dev/null)
  done
done
