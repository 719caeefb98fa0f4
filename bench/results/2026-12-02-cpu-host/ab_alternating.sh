#!/bin/bash
# The host cell, alternating two builds, two runs each: /tmp/wt-old a checkout of 8a36b86 (before the contract
# work), /tmp/wt-new one of d0485b2 (this change); each run imports its own checkout through PYTHONPATH
out=/work/main/bench/results/2026-12-02-cpu-host
(while true; do echo "$(date +%T) $(cut -d' ' -f1-3 /proc/loadavg)"; sleep 5; done > $out/loadavg.txt) &
sampler=$!
for i in 1 2; do
  (cd /tmp/wt-old && PYTHONPATH=/tmp/wt-old /work/venv/bin/python -m pytest bench/test_bench_ab.py -k host -p no:cacheprovider -q --benchmark-json=$out/before-$i.json > $out/before-$i.log 2>&1)
  (cd /tmp/wt-new && PYTHONPATH=/tmp/wt-new /work/venv/bin/python -m pytest bench/test_bench_ab.py -k host -p no:cacheprovider -q --benchmark-json=$out/after-$i.json > $out/after-$i.log 2>&1)
done
kill $sampler
