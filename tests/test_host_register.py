"""moe_ft/snapshot/host_register.py on the host: the library lookup that reaches the CUDA runtime torch has
loaded (to clear the last error a refused ``cudaHostRegister`` leaves) finds a loaded library's own handle
and loads nothing. The registration itself needs a GPU (tests/gpu/test_gpu_mapped.py)."""

from __future__ import annotations

import os

from moe_ft.snapshot.host_register import clear_last_error, loaded_library


def test_a_loaded_library_is_found_by_its_name_and_is_the_loaded_one():
    libc = loaded_library("libc.so")
    assert libc is not None
    assert libc.getpid() == os.getpid()


def test_a_library_not_loaded_is_not_loaded_by_asking():
    assert loaded_library("libmoe-ft-no-such-library.so") is None
    with open("/proc/self/maps") as maps:
        cudart_loaded = "libcudart.so" in maps.read()
    assert clear_last_error() == cudart_loaded  # a CPU build of torch has no CUDA runtime to clear
    with open("/proc/self/maps") as maps:
        assert ("libcudart.so" in maps.read()) == cudart_loaded
