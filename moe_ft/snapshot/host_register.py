"""Page-locking host memory for the device (``cudaHostRegister``) without leaving a failure behind.

A refused registration is not fatal to a snapshot: the copy into that memory still works, at pageable speed.
But the CUDA runtime also records the refusal as the thread's *last error*, and torch's binding of
``cudaHostRegister`` leaves it there; the next torch operation that checks for launch errors on that thread
(a ``.to("cuda")`` of a small tensor, any kernel) then raises ``CUDA error: invalid argument`` for a call it
never made. Measured on an H200: an arena on a store directory that is not a tmpfs (``/tmp`` of an overlay
filesystem: the kernel refuses long-term pins of such file mappings) failed five of seven tests this way.
:func:`register` clears that error again, through the runtime torch itself has loaded, and says why the
registration was refused.
"""

from __future__ import annotations

import contextlib
import ctypes
import os

import torch


def loaded_library(stem: str) -> ctypes.CDLL | None:
    """The shared library whose file name starts with ``stem`` that this process has already loaded (the same
    handle, so the same library state; ``None`` when none is loaded: nothing is loaded by asking)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            paths = {parts[5].strip() for parts in (line.split(None, 5) for line in maps)
                     if len(parts) == 6 and parts[5].startswith("/")}
    except OSError:
        return None
    for path in sorted(paths):
        if os.path.basename(path).startswith(stem):
            try:
                return ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_NOW)
            except OSError:
                continue
    return None


def clear_last_error() -> bool:
    """Reset the calling thread's last CUDA runtime error (``cudaGetLastError`` of the runtime torch uses).
    ``False`` when that runtime is not a shared library of this process (torch linked it statically)."""
    lib = loaded_library("libcudart.so")
    if lib is None:
        return False
    lib.cudaGetLastError.restype = ctypes.c_int
    lib.cudaGetLastError()
    return True


def register(ptr: int, nbytes: int) -> str:
    """Page-lock ``nbytes`` of host memory at ``ptr`` for the current device: ``""`` when done, else why not
    (the runtime's words and error number), with the runtime's last error cleared so that no later torch call
    fails for it."""
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(ptr, nbytes, 0)
    if err == cudart.cudaError.success:
        return ""
    why = f"cudaHostRegister of {nbytes} B failed: {cudart.cudaGetErrorString(err)} (cudaError {int(err)})"
    if not clear_last_error():  # the runtime is not reachable: let torch's launch check meet (and so clear) it
        with contextlib.suppress(RuntimeError):
            torch.zeros(1, device="cuda")
    return why
