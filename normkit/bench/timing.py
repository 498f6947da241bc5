"""Timers: the median time of one call, on a CUDA GPU (events) or on the host clock (CPU).

GPU timing: each timed call gets its own pair of CUDA events, and a GPU-side spin
(torch.cuda._sleep) is queued before it, long enough for the host to enqueue the whole call
behind it; so the events measure the GPU's work, not Python's launch overhead (which is
measured separately, per call, by host_overheads). The cache is kept out by the caller: it passes
several input sets ("the ring") whose total exceeds a few times the L2 size and the calls rotate
through them. The result is the median over all timed calls after a warm-up.
"""
from __future__ import annotations

import functools
import math
import statistics
import time

import torch

MIN_REPS = {"cuda": 20, "cpu": 5}
MAX_REPS = 2000
MAX_WARMUP = 1000
SPIN_SLACK_MS = 0.01  # spin this much longer than twice the host's time per call
MAX_SPIN_MS = 2.0


def _counts(est_ms: float, warmup_ms: float, rep_ms: float, min_reps: int) -> tuple[int, int]:
    est_ms = max(est_ms, 1e-4)
    n_warm = min(MAX_WARMUP, max(1, math.ceil(warmup_ms / est_ms)))
    n_rep = min(MAX_REPS, max(min_reps, math.ceil(rep_ms / est_ms)))
    return n_warm, n_rep


class CpuTimer:
    device = "cpu"
    about = "host clock (time.perf_counter) around each call, median"

    def sync(self):
        pass

    def median_ms(self, calls, warmup_ms: float, rep_ms: float) -> tuple[float, int]:
        """(median ms of one call, number of timed calls); calls rotate through the list."""
        k = len(calls)
        t0 = time.perf_counter()
        for i in range(3):
            calls[i % k]()
        n_warm, n_rep = _counts((time.perf_counter() - t0) * 1e3 / 3, warmup_ms, rep_ms, MIN_REPS["cpu"])
        for i in range(n_warm):
            calls[i % k]()
        times = []
        for i in range(n_rep):
            t0 = time.perf_counter()
            calls[i % k]()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times), n_rep


def spin_cycles_per_ms() -> float:
    """How many torch.cuda._sleep cycles the GPU spins per millisecond."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    cycles = 10_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    torch.cuda.synchronize()
    return cycles / max(start.elapsed_time(end), 1e-3)


class CudaTimer:
    device = "cuda"
    about = ("CUDA events around each call behind a GPU spin that hides host overhead, "
             "rotating input sets over 4x L2, median")

    def __init__(self):
        self.cycles_per_ms = spin_cycles_per_ms()

    def sync(self):
        torch.cuda.synchronize()

    def median_ms(self, calls, warmup_ms: float, rep_ms: float) -> tuple[float, int]:
        """(median ms of one call, number of timed calls); calls rotate through the list."""
        k = len(calls)
        Event = torch.cuda.Event
        torch.cuda.synchronize()
        start, end = Event(enable_timing=True), Event(enable_timing=True)
        host0 = time.perf_counter()
        start.record()
        for i in range(5):
            calls[i % k]()
        end.record()
        host_ms = (time.perf_counter() - host0) * 1e3 / 5
        torch.cuda.synchronize()
        n_warm, n_rep = _counts(start.elapsed_time(end) / 5, warmup_ms, rep_ms, MIN_REPS["cuda"])
        spin = int(self.cycles_per_ms * min(MAX_SPIN_MS, 2 * host_ms + SPIN_SLACK_MS))
        for i in range(n_warm):
            calls[i % k]()
        starts = [Event(enable_timing=True) for _ in range(n_rep)]
        ends = [Event(enable_timing=True) for _ in range(n_rep)]
        for i in range(n_rep):
            torch.cuda._sleep(spin)  # the GPU waits here while the host enqueues the call
            starts[i].record()
            calls[(n_warm + i) % k]()
            ends[i].record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)), n_rep


def make_timer(device: str):
    return CudaTimer() if device == "cuda" else CpuTimer()


COPY_BYTES = 1 << 30  # the copy ceiling copies a 1 GiB buffer


def copy_ceiling_gbps(timer: CudaTimer, warmup_ms: float, rep_ms: float, nbytes: int = COPY_BYTES) -> float:
    """Device-to-device copy bandwidth, bytes read plus written, in GB/s."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").fill_(1.0)
    dst = torch.empty_like(src)
    ms, _ = timer.median_ms([functools.partial(dst.copy_, src)], warmup_ms, rep_ms)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / (ms * 1e6)


def host_overheads(calls: dict, sync, budget_s: float = 0.1, latency_trials: int = 30,
                   rounds: int = 5) -> dict:
    """Per key of calls: (microseconds per call in a back-to-back loop, median latency in
    microseconds of one call + sync).

    Meant for tiny inputs, where the device finishes each call before the host has launched the
    next, so the loop measures what the host spends per call. The calls take turns, so that a
    drift of the host (other processes, clocks) falls on all alike: `rounds` rounds in which each
    runs one loop of about budget_s / rounds (the median over rounds is kept; one more round
    first, untimed, as a warm-up), then the latency trials interleaved the same way."""
    loops = {}
    for key, call in calls.items():
        # a key's first calls (kernel compiles, the host path's plan) are not its cost per call: left out of the
        # estimate that sizes its loops (the host table's first key got its loops sized by its compile
        # and read 1.5-2.5x its time when measured later in the table; runs S23-4 / S23-5, fixed in S23-6)
        for _ in range(3):
            call()
        sync()
        t0 = time.perf_counter()
        for _ in range(20):
            call()
        sync()
        per = max((time.perf_counter() - t0) / 20, 1e-7)
        loops[key] = min(2000, max(10, int(budget_s / rounds / per)))
    per_call = {key: [] for key in calls}
    lat = {key: [] for key in calls}
    for r in range(rounds + 1):  # round 0 untimed: the first rows of a process warm up its caches and clocks
        for key, call in calls.items():
            sync()
            t0 = time.perf_counter()
            for _ in range(loops[key]):
                call()
            sync()
            if r:
                per_call[key].append((time.perf_counter() - t0) / loops[key] * 1e6)
    for _ in range(latency_trials):
        for key, call in calls.items():
            sync()
            t0 = time.perf_counter()
            call()
            sync()
            lat[key].append((time.perf_counter() - t0) * 1e6)
    return {key: (statistics.median(per_call[key]), statistics.median(lat[key])) for key in calls}
