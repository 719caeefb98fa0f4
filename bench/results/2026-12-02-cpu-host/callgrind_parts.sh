#!/bin/bash
# Instructions per call of each part of the host cell (callgrind_parts.py), from the repository root:
#   bash bench/results/2026-12-02-cpu-host/callgrind_parts.sh TAG [PYTHONPATH of the build to measure]
tag=$1; pp=$2
rm -f /tmp/ph-$tag.*
PYTHONPATH=$pp valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file=/tmp/ph-$tag.cg python bench/results/2026-12-02-cpu-host/callgrind_parts.py $tag > /tmp/ph-$tag.log 2>&1 &
vpid=$!
for ph in start prepare resolve encode finish forward; do
  while [ ! -f /tmp/ph-$tag.$ph ]; do sleep 0.5; done
  if [ $ph = start ]; then callgrind_control -i on $vpid >/dev/null; else callgrind_control --dump=$ph $vpid > /dev/null; fi
  touch /tmp/ph-$tag.$ph.ok
done
wait $vpid
for f in /tmp/ph-$tag.cg.*; do echo "$tag $(grep -m1 '^desc: Trigger' $f | sed 's/.*Trigger: //') $(grep -m1 '^totals' $f | awk '{printf "%.0f", $2/50}')"; done
