"""TileLang plumbing shared by every kernel module: lazy import, the Hopper target, compile cache.

Nothing here imports TileLang at module import time: ``import nemo_dsa`` must stay free of it.
Kernel factories are plain Python functions ``factory(**config) -> PrimFunc``; the helpers below
lower them for sm_90a (works without a GPU, for tests and CI) or compile and cache them for the
GPU the kernels run on.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Every kernel targets Hopper: TVM's plain "cuda" means sm_50, and string targets with options
# are rejected by tilelang.lower, so the dict form is the one that works on CPU and GPU alike.
HOPPER_TARGET: dict[str, str] = {"kind": "cuda", "arch": "sm_90a"}

# 227 KiB of dynamic shared memory per block on H100/H200 (cudaDevAttrMaxSharedMemoryPerBlockOptin).
HOPPER_SMEM_LIMIT = 232448

# tvm_ffi compiles with the local nvcc and needs no libcuda at build time, so the same backend
# serves the CPU cubin check and the GPU launch (cython needs -lcuda, nvrtc extra packages).
EXECUTION_BACKEND = "tvm_ffi"

_compile_cache: dict[tuple, Any] = {}
_compile_lock = threading.Lock()


def tilelang():
    """Import and return the ``tilelang`` module (the environment is left as the caller set it)."""
    import tilelang as _tilelang

    return _tilelang


def _pass_configs(pass_configs: dict | None) -> dict:
    return dict(pass_configs or {})


def lower(prim_func, *, pass_configs: dict | None = None):
    """Lower ``prim_func`` for sm_90a without compiling device code (no GPU, no nvcc needed).

    Returns TileLang's ``CompiledArtifact`` (``kernel_source``, ``device_mod``, ...).
    """
    tl = tilelang()
    from tvm.target import Target

    target = Target(HOPPER_TARGET)
    # LayoutInference reads Target.current(), so lowering needs both contexts.
    with tl.transform.PassContext(opt_level=3, config=_pass_configs(pass_configs)), target:
        return tl.lower(prim_func, target=target, enable_device_compile=False)


def lower_to_cuda_source(prim_func, *, pass_configs: dict | None = None) -> str:
    """CUDA C++ source TileLang generates for ``prim_func`` on sm_90a (CPU-safe)."""
    return str(lower(prim_func, pass_configs=pass_configs).kernel_source)


def dynamic_shared_memory_bytes(prim_func, *, pass_configs: dict | None = None) -> int:
    """Largest dynamic shared memory request of the lowered device kernels, in bytes.

    ``prim_func`` may also be the artifact :func:`lower` returned (saves lowering twice).
    TileLang does not check the Hopper limit when lowering, so callers compare this with
    ``HOPPER_SMEM_LIMIT`` themselves.
    """
    artifact = prim_func if hasattr(prim_func, "device_mod") else lower(prim_func, pass_configs=pass_configs)
    sizes = [0]
    for _, func in artifact.device_mod.functions.items():
        attrs = func.attrs
        if attrs is not None and "dyn_shared_memory_buf" in attrs:
            sizes.append(int(attrs["dyn_shared_memory_buf"]))
    return max(sizes)


def compile_cubin(prim_func, *, pass_configs: dict | None = None):
    """Compile ``prim_func`` for sm_90a with nvcc and return the TileLang ``JITKernel``.

    Works on a machine without a GPU (C++/PTX errors surface here); calling the kernel needs CUDA.
    """
    tl = tilelang()
    return tl.compile(
        prim_func,
        target=HOPPER_TARGET,
        execution_backend=EXECUTION_BACKEND,
        pass_configs=_pass_configs(pass_configs),
    )


def _current_device_key() -> tuple:
    import torch

    if not torch.cuda.is_available():
        return ("nodevice",)
    index = torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    if major != 9:
        raise RuntimeError(
            f"nemo_dsa's TileLang kernels are built for Hopper (sm_90a); CUDA device {index} has "
            f"compute capability {major}.{minor}. Use backend='torch' on this GPU."
        )
    return ("cuda", index)


def compile_cached(factory: Callable[..., Any], *, pass_configs: dict | None = None, **config):
    """Compile ``factory(**config)`` once per (factory, configuration, CUDA device) and reuse it.

    ``config`` values must be hashable (ints, strings, dtype names). TileLang's own disk cache
    makes a new process cheap too; this dict saves re-tracing the PrimFunc on every call.
    """
    key = (
        factory.__module__,
        factory.__qualname__,
        tuple(sorted(config.items())),
        tuple(sorted(_pass_configs(pass_configs).items(), key=lambda kv: str(kv[0]))),
        _current_device_key(),
    )
    kernel = _compile_cache.get(key)
    if kernel is not None:
        return kernel
    with _compile_lock:
        kernel = _compile_cache.get(key)
        if kernel is None:
            kernel = compile_cubin(factory(**config), pass_configs=pass_configs)
            _compile_cache[key] = kernel
    return kernel


@dataclass(frozen=True)
class KernelBuild:
    """One entry of the compile cache as a value: a factory and its configuration.

    The wrappers choose their kernel as a ``KernelBuild`` and compile it through :meth:`compile`,
    so a warm-up (``ops.warm_up``) and the tests can name the builds a call selects without
    compiling anything.
    """

    factory: Callable[..., Any]
    config: tuple  # sorted (name, value) pairs: the factory's keyword arguments
    pass_configs: tuple = ()  # sorted (name, value) pairs

    @classmethod
    def of(cls, factory: Callable[..., Any], *, pass_configs: dict | None = None, **config) -> KernelBuild:
        return cls(factory, tuple(sorted(config.items())), tuple(sorted(_pass_configs(pass_configs).items())))

    def name(self) -> str:
        """The factory and its configuration, readable (for logs and test messages)."""
        return f"{self.factory.__qualname__}({', '.join(f'{k}={v!r}' for k, v in self.config)})"

    def compile(self):
        """The compiled kernel, through :func:`compile_cached` (built once per device)."""
        return compile_cached(self.factory, pass_configs=dict(self.pass_configs), **dict(self.config))
