#!/bin/bash
# Wall clock of the host cell (bench/test_bench_ab.py -k host: fastbert and HF sdpa alternating call by call, 300
# rounds), the same benchmark code against two builds of fastbert, the builds alternating run by run.
#   bash ab_alternating.sh OLD_CHECKOUT NEW_CHECKOUT RUNS OUT_DIR [CELL]
# Each build is imported through a folder holding only a link to its fastbert/ (so that nothing else of that
# checkout is on the path); the benchmark code is a copy of this checkout's bench/. CELL: the -k expression (host).
old=$1; new=$2; runs=$3; out=$4; cell=${5:-host}
here=$(cd "$(dirname "$0")/../../.." && pwd)
work=$(mktemp -d)
mkdir -p "$work/pkg-old" "$work/pkg-new" "$work/code" "$out"
ln -s "$old/fastbert" "$work/pkg-old/fastbert"
ln -s "$new/fastbert" "$work/pkg-new/fastbert"
cp -r "$here/bench" "$here/pytest.ini" "$work/code/"
(while true; do echo "$(date +%T) $(cut -d' ' -f1-3 /proc/loadavg)"; sleep 5; done > "$out/loadavg-$cell.txt") &
sampler=$!
for i in $(seq 1 "$runs"); do
  for b in old new; do
    (cd "$work/code" && PYTHONPATH="$work/pkg-$b" python -m pytest bench/test_bench_ab.py -k "$cell" \
        -p no:cacheprovider -q --benchmark-json="$out/$cell-$b-$i.json" > "$out/$cell-$b-$i.log" 2>&1)
  done
done
kill $sampler
rm -rf "$work"
