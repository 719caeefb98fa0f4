"""Compare the junit results of the stock and fastbert runs: counts, the forward check, and every test whose
outcome differs from stock.

    python compare.py [results-dir] [family ...]

Columns of a fastbert run: the non-skipped tests where fastbert was swapped in, those where at least one fastbert
forward ran, those where fastbert refused every model (they ran stock); then the forward check (fastbert_plugin.py):
the forwards checked against transformers' encoder, the tests with a mismatch, and the largest difference seen.
"""
import json
import math
import os
import re
import sys
import xml.etree.ElementTree as ET

MODES = ("stock", "fb", "fbpf")


def outcomes(path):
    """test id -> passed / failed / skipped (an error in setup or teardown counts as failed)."""
    result = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname').split('.')[-1]}::{case.get('name')}"
        tags = {child.tag for child in case}
        outcome = "failed" if tags & {"failure", "error"} else "skipped" if "skipped" in tags else "passed"
        if result.get(name) != "failed":
            result[name] = outcome
    return result


def subfailures(log):
    """test id -> the subtests that failed ([BertModel], ...), from the -rA summary."""
    found = {}
    if not os.path.exists(log):
        return found
    for line in open(log):
        m = re.match(r"SUBFAILED\[(.*?)\] \S+::(\S+::\S+)", line)
        if m:
            found.setdefault(m.group(2), set()).add(m.group(1).replace("<class '", "").replace("'>", "")
                                                     .split(".")[-1])
    return found


def failure_lines(log):
    """test id -> the one-line reason of the -rA summary (FAILED a::b::c - reason)."""
    found = {}
    if not os.path.exists(log):
        return found
    for line in open(log):
        m = re.match(r"(?:FAILED|ERROR) \S+?::(\S+::\S+)(?: - (.*))?", line)
        if m:
            found.setdefault(m.group(1), (m.group(2) or "").strip()[:160])
    return found


def plugin_rows(jsonl):
    info = {}
    if os.path.exists(jsonl):
        for line in open(jsonl):
            row = json.loads(line)
            info[row["nodeid"].split("::", 1)[1]] = row
    return info


def _diff(value):
    return "-" if value is None else "inf" if math.isinf(value) else f"{value:.1e}"


def main(results="results", families=None):
    if families is None:
        families = sorted({name.split("-", 1)[1][:-4] for name in os.listdir(results) if name.endswith(".xml")})
    table, diffs, mismatches = [], {}, {}
    for family in families:
        runs = {}
        for mode in MODES:
            path = os.path.join(results, f"{mode}-{family}.xml")
            if os.path.exists(path):
                runs[mode] = outcomes(path)
        stock = runs.get("stock", {})
        for mode, res in runs.items():
            counts = {k: sum(v == k for v in res.values()) for k in ("passed", "failed", "skipped")}
            row = f"| {family} | {mode} | {counts['passed']} / {counts['failed']} / {counts['skipped']} |"
            if mode == "stock":
                table.append(row + " - | - | - | - | - | - |")
                continue
            info = plugin_rows(os.path.join(results, f"{mode}-{family}.jsonl"))
            live = {t: r for t, r in info.items() if res.get(t) not in (None, "skipped")}
            swapped = sum(1 for r in live.values() if r["swapped"])
            ran = sum(1 for r in live.values() if r.get("forwards"))
            refused = sum(1 for r in live.values() if r["refused"] and not r["swapped"])
            checked = sum(r["check"]["checked"] for r in live.values() if "check" in r)
            bad = {t: r["check"] for t, r in live.items() if r.get("check", {}).get("mismatches")}
            top = max((c["max_diff"] for c in bad.values()), default=None)
            row += f" {swapped} | {ran} | {refused} | {checked} | {len(bad)} | {_diff(top)} |"
            table.append(row)
            for test, c in sorted(bad.items()):
                mismatches.setdefault((mode, family), []).append(
                    f"{test}: {c['mismatches']} of {c['checked']} forwards, up to {_diff(c['max_diff'])} at "
                    f"{c['worst']}")
            sub = subfailures(os.path.join(results, f"{mode}-{family}.log"))
            why = failure_lines(os.path.join(results, f"{mode}-{family}.log"))
            for test, outcome in sorted(res.items()):
                before = stock.get(test)
                if before != outcome:
                    where = f" [{', '.join(sorted(sub[test]))}]" if test in sub else ""
                    reason = f": {why[test]}" if outcome == "failed" and why.get(test) else ""
                    diffs.setdefault((mode, family), []).append(f"{test}: stock {before} -> {outcome}{where}{reason}")
    print("| family | run | passed / failed / skipped | fastbert swapped in | a fastbert forward ran | "
          "fastbert refused every model | forwards checked | tests with a forward mismatch | largest mismatch |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(table))
    for (mode, family), lines in diffs.items():
        print(f"\n## {mode} {family}: outcomes that differ from stock ({len(lines)})")
        print("\n".join(f"- {line}" for line in lines))
    for (mode, family), lines in mismatches.items():
        print(f"\n## {mode} {family}: forward mismatches against transformers' encoder ({len(lines)} tests)")
        print("\n".join(f"- {line}" for line in lines))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "results", sys.argv[2:] or None)
