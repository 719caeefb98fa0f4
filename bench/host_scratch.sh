#!/usr/bin/env bash
# Instructions callgrind counts from the start of bench/host_scratch.py's launches to its exit:
#   bench/host_scratch.sh before|after N [COMMIT]   -> "<variant> <N> <instructions>"
# (COMMIT: the source of "before", default HEAD)
set -euo pipefail
variant=$1 n=$2 commit=${3:-HEAD}
out=$(mktemp -d)
coproc RUN { exec env PYTHONHASHSEED=0 valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$out/cg.out" \
    python "$(dirname "$0")/host_scratch.py" --variant "$variant" --commit "$commit" -n "$n" --wait 2>"$out/valgrind.log"; }
read -r ready <&"${RUN[0]}"
callgrind_control -i on "$RUN_PID" >/dev/null
echo go >&"${RUN[1]}"
wait "$RUN_PID"
echo "$variant $n $(awk '/^(summary|totals):/ {print $2; exit}' "$out/cg.out")"
[ -n "${KEEP:-}" ] && echo "$out" || rm -rf "$out"
