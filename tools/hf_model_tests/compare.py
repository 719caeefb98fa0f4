"""Compare the junit results of the stock and fastbert runs: counts, and every test whose outcome differs.

    python compare.py [results-dir]
"""
import json
import os
import re
import sys
import xml.etree.ElementTree as ET

RESULTS = sys.argv[1] if len(sys.argv) > 1 else "results"
FAMILIES = ("bert", "roberta", "electra", "distilbert", "mpnet")
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


def swapped(jsonl):
    info = {}
    if os.path.exists(jsonl):
        for line in open(jsonl):
            row = json.loads(line)
            info[row["nodeid"].split("::", 1)[1]] = row
    return info


def main():
    table = []
    diffs = {}
    for family in FAMILIES:
        runs = {}
        for mode in MODES:
            path = os.path.join(RESULTS, f"{mode}-{family}.xml")
            if os.path.exists(path):
                runs[mode] = outcomes(path)
        for mode, res in runs.items():
            counts = {k: sum(v == k for v in res.values()) for k in ("passed", "failed", "skipped")}
            row = f"| {family} | {mode} | {counts['passed']} | {counts['failed']} | {counts['skipped']} |"
            if mode != "stock":
                info = swapped(os.path.join(RESULTS, f"{mode}-{family}.jsonl"))
                ran = sum(1 for t, r in info.items() if r["swapped"] and res.get(t) != "skipped")
                refused = sum(1 for t, r in info.items() if r["refused"] and not r["swapped"]
                              and res.get(t) != "skipped")
                row += f" {ran} | {refused} |"
            else:
                row += " - | - |"
            table.append(row)
        stock = runs.get("stock", {})
        for mode in MODES[1:]:
            if mode not in runs:
                continue
            sub = subfailures(os.path.join(RESULTS, f"{mode}-{family}.log"))
            for test, outcome in sorted(runs[mode].items()):
                before = stock.get(test)
                if before != outcome:
                    where = f" [{', '.join(sorted(sub[test]))}]" if test in sub else ""
                    diffs.setdefault((mode, family), []).append(f"{test}: stock {before} -> {outcome}{where}")
    print("| family | run | passed | failed | skipped | non-skipped tests where fastbert ran | "
          "non-skipped tests where fastbert refused every model (ran stock) |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(table))
    for (mode, family), lines in diffs.items():
        print(f"\n## {mode} {family}: outcomes that differ from stock ({len(lines)})")
        print("\n".join(f"- {line}" for line in lines))


if __name__ == "__main__":
    main()
