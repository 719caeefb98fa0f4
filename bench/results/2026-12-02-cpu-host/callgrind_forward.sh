#!/bin/bash
# Instructions per forward of the host cell (callgrind_forward.py), from the repository root:
#   bash bench/results/2026-12-02-cpu-host/callgrind_forward.sh TAG fb|hf [PYTHONPATH of the build to measure]
tag=$1; which=$2; pp=$3
rm -f /tmp/cg-$tag.*
PYTHONPATH=$pp valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file=/tmp/cg-$tag.cg python bench/results/2026-12-02-cpu-host/callgrind_forward.py $which $tag > /tmp/cg-$tag.log 2>&1 &
vpid=$!
while [ ! -f /tmp/cg-$tag.ready ]; do sleep 1; done
callgrind_control -i on $vpid > /dev/null; touch /tmp/cg-$tag.go
while [ ! -f /tmp/cg-$tag.done ]; do sleep 1; done
callgrind_control -i off $vpid > /dev/null; touch /tmp/cg-$tag.end
wait $vpid
grep -m1 "^totals" /tmp/cg-$tag.cg | awk -v t=$tag '{printf "%s Ir per forward: %.0f\n", t, $2/50}'
