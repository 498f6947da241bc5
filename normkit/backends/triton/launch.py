"""A thin, fast way to launch @triton.jit kernels.

`kernel[grid](...)` re-derives Triton's specialization key on every call, which costs tens of
microseconds of host time per launch on triton 3.x. Here the first launch of each specialization
goes through Triton as usual (compiling it); later launches call the compiled kernel's own
launcher directly. The key we cache on reproduces what Triton specializes on: each tensor's
dtype and 16-byte alignment, each integer's "== 1" and "% 16 == 0" and 64-bit-ness, plus the
constexprs and launch options. Under the Triton interpreter everything goes through Triton.
"""
from __future__ import annotations

from threading import get_ident

import torch

_I32_MAX = 2**31 - 1
_Tensor = torch.Tensor
# normkit._host records a run of the backend's host functions as a launch plan: while it does, this
# is (recording thread's id, list), and each launch of that thread is appended to the list as
# (CompiledKernel or None under the interpreter, jit function, grid, args, constexprs, options)
recording = None


def spec_key(args) -> tuple:
    """What Triton specializes a launch on, per argument: a tensor's dtype and 16-byte alignment,
    an integer's value 1 / divisibility by 16 / need for 64 bits; other arguments only by kind."""
    key = []
    for a in args:
        t = type(a)
        if t is int:  # Triton: 1 becomes a constant; else "divisible by 16"; 64-bit if it must be
            key.append("one" if a == 1 else (a & 15 == 0, a > _I32_MAX or a < -_I32_MAX))
        elif a is None or t is float or t is bool:
            key.append(t)
        else:
            key.append((a.dtype, a.data_ptr() & 15 == 0))
    return tuple(key)


def note_foreign_launch(name: str, launch=None) -> None:
    """A kernel launched outside launch.Kernel (the CUDA backend's driver.launch): a recording under
    way on this thread must know, since a plan replays only the launches it saw. launch: what a plan
    needs to replay it, (KernelSpec, CUfunction address, grid, block, shared bytes, cluster, args),
    or None where it cannot."""
    if recording is not None and recording[0] == get_ident():
        recording[1].append(("foreign", name, launch))


class Kernel:
    """Wraps one @triton.jit function; call as launcher(grid, args, constexprs, num_warps)."""

    def __init__(self, jit_fn):
        self.jit_fn = jit_fn
        self.interpreted = type(jit_fn).__name__ == "InterpretedFunction"
        self._compiled: dict = {}


    def compiled(self, args, constexprs, options, device_index=0):
        """The CompiledKernel for this specialization, compiling it (without launching) if needed.
        Runtime args come first in every normkit kernel signature and constexprs last, in order;
        `options` is (num_warps, num_stages[, maxnreg])."""
        key = (spec_key(args), tuple(constexprs.values()), options, device_index)
        kernel = self._compiled.get(key)
        if kernel is None:
            num_warps, num_stages, *cap = options
            # floating-point contraction (FMA) pinned on: the kernels' numerics and speed were measured
            # with it, and Triton 3.9 warns that its default turns it off from 3.10
            kernel = self.jit_fn.warmup(*args, grid=(1,), num_warps=num_warps, num_stages=num_stages,
                                        enable_fp_fusion=True, **({"maxnreg": cap[0]} if cap else {}),
                                        **constexprs)
            if hasattr(kernel, "result"):  # async compile handles
                kernel = kernel.result()
            kernel._init_handles()
            self._compiled[key] = kernel
        return kernel

    def __call__(self, grid, args, constexprs, options, device_index=0):
        """Launch; `grid` is a tuple, or a function of the CompiledKernel (None under the
        interpreter) returning one, for grids sized by the kernel's resource use. Returns the grid."""
        if self.interpreted:
            grid = grid(None) if callable(grid) else grid
            if recording is None or recording[0] != get_ident():
                self.jit_fn[grid](*args, num_warps=options[0], num_stages=options[1], **constexprs)
                return grid
            recording[1].append((None, self.jit_fn, grid, args, constexprs, options))
            from torch.utils._python_dispatch import _disable_current_modes
            with _disable_current_modes():  # the interpreter's own torch ops are not the host function's
                self.jit_fn[grid](*args, num_warps=options[0], num_stages=options[1], **constexprs)
            return grid
        if device_index != torch._C._cuda_getDevice():  # kernels load into the current device
            with torch.cuda.device(device_index):
                return self(grid, args, constexprs, options, device_index)
        kernel = self.compiled(args, constexprs, options, device_index)
        grid = grid(kernel) if callable(grid) else grid
        stream = torch._C._cuda_getCurrentRawStream(device_index)
        if recording is not None and recording[0] == get_ident():
            recording[1].append((kernel, self.jit_fn, grid, args, constexprs, options))
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        kernel.run(grid[0], g1, g2, stream, kernel.function, kernel.packed_metadata, None, None, None,
                   *args, *constexprs.values())
        return grid


def resident_programs_per_sm(kernel, num_warps: int, device_index: int) -> int:
    """How many programs of a compiled kernel fit on one SM at once (registers, shared memory,
    threads), so a persistent grid that relies on all its programs running together stays
    within what the hardware can keep resident. Cached on the kernel object."""
    cached = getattr(kernel, "_normkit_resident", None)
    if cached is not None:
        return cached
    props = _props(device_index)
    threads = num_warps * 32
    regs_per_warp = -(-max(kernel.n_regs, 1) * 32 // 256) * 256  # allocated in 256-register units
    by_regs = props["regs_per_sm"] // (regs_per_warp * num_warps)
    shared = kernel.metadata.shared
    by_smem = props["smem_per_sm"] // (shared + 1024) if shared else 32
    by_threads = props["threads_per_sm"] // threads
    kernel._normkit_resident = max(0, min(by_regs, by_smem, by_threads, 32))
    return kernel._normkit_resident


_PROPS: dict = {}


def _props(device_index: int) -> dict:
    p = _PROPS.get(device_index)
    if p is None:
        d = torch.cuda.get_device_properties(device_index)
        p = _PROPS[device_index] = {
            "sms": d.multi_processor_count,
            "regs_per_sm": getattr(d, "regs_per_multiprocessor", 65536),
            "smem_per_sm": getattr(d, "shared_memory_per_multiprocessor", 228 * 1024),
            "threads_per_sm": getattr(d, "max_threads_per_multi_processor", 2048),
            "major": d.major,
        }
    return p
