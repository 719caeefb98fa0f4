"""Per-run medians and ratios of the alternating A/B (ab_alternating.sh), and the median ratio of each build.
usage: python ab_summary.py OUT_DIR [CELL]"""
import glob
import json
import re
import statistics
import sys

out, cell = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "host"
ratios = {}  # (cell, build) -> ratios
for path in sorted(glob.glob(f"{out}/{cell}-*-*.json"), key=lambda p: (int(re.findall(r"-(\d+)\.json$", p)[0]), p)):
    build = re.findall(rf"{cell}-(old|new)-", path)[0]
    for bench in json.load(open(path))["benchmarks"]:
        info = bench["extra_info"]
        fb = info["fastbert-torch_median_s"]
        hf_key = next(k for k in info if k.endswith("_median_s") and not k.startswith("fastbert"))
        ratio = info[hf_key] / fb
        ratios.setdefault((info["cell"], build), []).append(ratio)
        print(f"{path.rsplit('/', 1)[1]:32s} {info['cell']:14s} fastbert {fb * 1e3:9.3f} ms  "
              f"{hf_key[:-9]} {info[hf_key] * 1e3:9.3f} ms  ratio {ratio:.3f}")
for (cell_name, build), r in sorted(ratios.items()):
    print(f"{cell_name} {build}: median ratio {statistics.median(r):.3f} over {len(r)} runs "
          f"(min {min(r):.3f}, max {max(r):.3f})")
