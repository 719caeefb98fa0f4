"""Whole 22-layer fastbert forward on the A/B cell's batch: wall time per forward, optional torch.profiler table."""
import os
import resource
import sys
import time

import torch

from bench import harness

mode = sys.argv[1] if len(sys.argv) > 1 else "time"
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 2
bank = harness.ModelBank()
cell = harness._varlen(16, 64, 2048)
batch = bank.batch("modernbert-base", cell, "cpu")
m = bank.fastbert("modernbert-base", torch.float32, "cpu").set_kernels("torch")
print("threads", torch.get_num_threads(), "real", batch.real_tokens, flush=True)


def faults():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_minflt, r.ru_utime, r.ru_stime


with torch.inference_mode():
    if mode == "time":
        for i in range(reps):
            f0 = faults()
            t0 = time.perf_counter()
            out = m(**batch.inputs)
            dt = time.perf_counter() - t0
            f1 = faults()
            print(f"forward {i}: {dt:.2f} s wall, user {f1[1]-f0[1]:.2f} s, sys {f1[2]-f0[2]:.2f} s, "
                  f"minor faults {f1[0]-f0[0]}, load {os.getloadavg()[0]:.2f}", flush=True)
    else:
        m(**batch.inputs)
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU], profile_memory=(mode == "mem")) as p:
            t0 = time.perf_counter()
            m(**batch.inputs)
            print("profiled forward", time.perf_counter() - t0)
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
