"""TileLang sparse window + compressed attention for Hopper (sm_90a): the launch wrappers.

Contract (see :func:`nemo_dsa.ops.sparse_attention.naive.window_compressed_attention_reference`):
query i of batch b owns raw row ``own = i + N_raw - S``; it sees the raw rows
``[max(window_start, own - window + 1), own]`` (its sliding window, read by position) and the
compressed rows named by ``indices[b, i]`` (-1 = none) or the range ``[ks, ke)``. One softmax
over both, the per-head sink in the denominator only.

Work unit: one query and 64 of its heads (the GEMM's M dimension, as in FlashMLA; fewer heads
are zero-padded to 64, 128 heads take two blocks); its keys come in 64-key tiles (``tiles.py``).

- ``configs.py``: block shapes, register splits, one dataclass per compiled kernel;
- ``forward.py``: the forward kernel;
- ``backward.py``: the backward and the delta kernels;
- here: operands padded to the built head dim and head count, compilation, launches.
"""

import torch

from nemo_dsa.ops._tilelang import HOPPER_SMEM_LIMIT, compile_cached, tilelang
from nemo_dsa.ops.sparse_attention.backward import attention_delta_kernel, sparse_window_bwd_kernel
from nemo_dsa.ops.sparse_attention.configs import (
    BLOCK_HEADS,
    CONSUMER_REGISTERS,
    FWD_THREADS,
    KERNEL_DIMS,
    LAUNCH_REGISTERS,
    MAX_SELECTED,
    MODES,
    PRODUCER_REGISTERS,
    BackwardConfig,
    ForwardConfig,
    backward_config,
    dispatched_configs,
    forward_config,
    kernel_dim,
)
from nemo_dsa.ops.sparse_attention.forward import (
    EXCHANGE_BARRIER,
    FLAGS_BARRIER,
    ROLE_BARRIER_IDS,
    register_barrier_postproc,
    separate_role_barriers,
    sparse_window_fwd_kernel,
)

# Re-exported for tests, benchmarks and scripts: ``kernels`` is the sparse-attention kernels' one
# import (configs, factories, launches).
__all__ = [
    "CONSUMER_REGISTERS", "EXCHANGE_BARRIER", "FLAGS_BARRIER", "FWD_THREADS", "HOPPER_SMEM_LIMIT", "KERNEL_DIMS",
    "LAUNCH_REGISTERS", "MAX_SELECTED", "MODES", "PRODUCER_REGISTERS", "ROLE_BARRIER_IDS", "BackwardConfig",
    "ForwardConfig", "KernelInputs", "attention_delta", "attention_delta_kernel", "backward_config", "compile_config",
    "dispatched_configs", "forward_config", "kernel_dim", "last_valid_slots", "register_barrier_postproc",
    "separate_role_barriers", "sparse_window_backward", "sparse_window_bwd_kernel", "sparse_window_forward",
    "sparse_window_fwd_kernel", "tilelang",
]  # fmt: skip


def _compile_forward(config: ForwardConfig):
    register_barrier_postproc()  # the forward's CUDA needs its role barriers separated (forward.py)
    return compile_cached(sparse_window_fwd_kernel, pass_configs=config.pass_configs(), **config.kernel_kwargs())


_param_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _params(device, scale: float, has_sink: bool, window: int):
    """Device scalars (scale, has_sink) and window, cached so no call re-uploads them."""
    key = (device, float(scale), bool(has_sink), int(window))
    cached = _param_cache.get(key)
    if cached is None:
        cached = (
            torch.tensor([float(scale), 1.0 if has_sink else 0.0], dtype=torch.float32, device=device),
            torch.tensor([int(window)], dtype=torch.int32, device=device),
        )
        _param_cache[key] = cached
    return cached


_needs_cache: dict[tuple, torch.Tensor] = {}


def _needs(device, need_dq: bool, need_d_raw: bool, need_d_comp: bool) -> torch.Tensor:
    """The backward's int32 [3] flags (dq, d raw rows, d compressed rows), cached per device."""
    key = (device, bool(need_dq), bool(need_d_raw), bool(need_d_comp))
    cached = _needs_cache.get(key)
    if cached is None:
        cached = torch.tensor([int(v) for v in key[1:]], dtype=torch.int32, device=device)
        _needs_cache[key] = cached
    return cached


def _pad_dim(x: torch.Tensor, dim: int) -> torch.Tensor:
    x = x.contiguous()
    return x if x.shape[-1] == dim else torch.nn.functional.pad(x, (0, dim - x.shape[-1]))


def _pad_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Zero-pad axis 2 (heads) of ``[B, S, H, ...]`` to ``heads``."""
    if x.shape[2] == heads:
        return x.contiguous()
    pad = [0, 0] * (x.ndim - 3) + [0, heads - x.shape[2]]
    return torch.nn.functional.pad(x, pad).contiguous()


def last_valid_slots(indices: torch.Tensor) -> torch.Tensor:
    """int32 [B, S]: 1 + the last slot j with indices[b, i, j] >= 0, or 0 for a row of -1s."""
    if indices.shape[-1] == 0:
        return indices.new_zeros(indices.shape[:2])
    slots = torch.arange(1, indices.shape[-1] + 1, device=indices.device, dtype=torch.int16)  # T <= 2048
    return torch.where(indices >= 0, slots, 0).amax(-1).to(torch.int32)


class KernelInputs:
    """The operands both kernels take, padded to the built head dim, and the mode they select."""

    def __init__(self, q, raw_kv, window_start, window, compressed_kv, indices, ks, ke, sink, scale):
        batch, seq_len, heads, dim = q.shape
        self.dim, self.heads = dim, heads
        self.kdim = kernel_dim(dim)
        self.kheads = -(-heads // BLOCK_HEADS) * BLOCK_HEADS  # whole 64-head blocks
        self.q = _pad_heads(_pad_dim(q, self.kdim), self.kheads)
        self.raw = _pad_dim(raw_kv, self.kdim)
        self.n_raw = raw_kv.shape[1]
        self.window_start = window_start.contiguous()
        if indices is not None and indices.shape[-1] == 0:
            compressed_kv = None  # no slots: the same as no compressed keys
        if compressed_kv is None:  # no compressed keys: an empty range over one zero row
            compressed_kv = q.new_zeros(batch, 1, dim)
            ks = ke = torch.zeros(batch, seq_len, dtype=torch.int32, device=q.device)
            indices = None
        self.comp = _pad_dim(compressed_kv, self.kdim)
        if indices is not None:
            self.mode = "indices"
            # end = 1 + the last slot holding an index >= 0 (0 if none): the kernels read no
            # slot past it (the -1 tails of queries with fewer visible compressed rows).
            self.selector, self.end = indices.contiguous(), last_valid_slots(indices)
        else:
            self.mode = "range"
            self.selector, self.end = ks.contiguous(), ke.contiguous()
        self.has_sink = sink is not None
        self.sink = torch.zeros(self.kheads, dtype=torch.float32, device=q.device)
        if sink is not None:
            self.sink[:heads] = sink
        self.params, self.window = _params(q.device, scale, self.has_sink, window)


def sparse_window_forward(inputs: KernelInputs, *, out=None, lse=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, S, H, D] bf16, lse [B, S, H] fp32) on the GPU; ``out`` / ``lse`` (optional,
    contiguous, at the built head dim and padded head count) receive the result, every element
    written; the returned tensors are views of them at the real heads and dim."""
    q = inputs.q
    batch, seq_len, heads, _ = q.shape
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty((batch, seq_len, heads), dtype=torch.float32, device=q.device) if lse is None else lse
    if q.numel():
        kernel = _compile_forward(forward_config(inputs.kdim, inputs.mode))
        kernel(q, inputs.raw, inputs.comp, inputs.window_start, inputs.selector, inputs.end, inputs.sink,
               inputs.params, inputs.window, out, lse)
    return out[:, :, : inputs.heads, : inputs.dim], lse[:, :, : inputs.heads]


def attention_delta(out: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """rowsum(dO * O) in fp32, [B, S, H] (inputs [B, S, H, D] bf16, D a multiple of 128)."""
    dim = out.shape[-1]
    rows = out.numel() // dim
    delta = torch.empty(out.shape[:-1], dtype=torch.float32, device=out.device)
    if rows:
        kernel = compile_cached(attention_delta_kernel, dim=dim)
        kernel(out.contiguous().view(rows, dim), grad_out.contiguous().view(rows, dim), delta.view(rows))
    return delta


def sparse_window_backward(inputs: KernelInputs, out, lse, grad_out, *, dq=None, need_dq: bool = True,
                           need_d_raw: bool = True, need_d_comp: bool = True):
    """(dq, d raw_kv, d compressed_kv, delta) for the saved forward; gradients in bf16, ``None``
    for each one not wanted (``need_*``: neither computed nor added; with none wanted only delta
    runs). Every key's dkv, window rows included, is added by the kernel's fp32 atomics. ``dq``
    (optional, contiguous, at the built head dim) receives dq, every element written."""
    q = inputs.q
    batch, seq_len, heads, _ = q.shape
    # Padded heads: zero dO (so zero delta and gradients) and a finite lse of 0.
    grad_out = _pad_heads(_pad_dim(grad_out, inputs.kdim), inputs.kheads)
    out = _pad_heads(_pad_dim(out, inputs.kdim), inputs.kheads)
    delta = None  # rowsum(dO * O): the main kernel writes it; the delta kernel when it does not run
    n_comp = inputs.comp.shape[1]
    lse = _pad_heads(lse, inputs.kheads)
    shape = (batch, inputs.n_raw + n_comp, inputs.kdim)
    dkv = None
    if need_dq or need_d_raw or need_d_comp:
        dq = torch.empty_like(q) if dq is None else dq
        # Rows nobody wants are never added to, so they need no zeros (one allocation).
        if need_d_raw and need_d_comp:
            dkv = torch.zeros(shape, dtype=torch.float32, device=q.device)
        else:
            dkv = torch.empty(shape, dtype=torch.float32, device=q.device)
            if need_d_raw:
                dkv[:, : inputs.n_raw].zero_()
            elif need_d_comp:
                dkv[:, inputs.n_raw :].zero_()
        if q.numel():
            delta = torch.empty(out.shape[:-1], dtype=torch.float32, device=q.device)
            config = backward_config(inputs.kdim, inputs.mode)
            kernel = compile_cached(sparse_window_bwd_kernel, pass_configs=config.pass_configs(), **config.kernel_kwargs())
            kernel(q, inputs.raw, inputs.comp, inputs.window_start, inputs.selector, inputs.end, inputs.params,
                   inputs.window, _needs(q.device, need_dq, need_d_raw, need_d_comp), grad_out, lse, out, delta,
                   dq, dkv)  # fmt: skip
    if delta is None:
        delta = attention_delta(out, grad_out)
    dim, heads = inputs.dim, inputs.heads
    d_raw = dkv[:, : inputs.n_raw, :dim].to(q.dtype) if need_d_raw else None
    d_comp = dkv[:, inputs.n_raw :, :dim].to(q.dtype) if need_d_comp else None
    return dq[:, :, :heads, :dim] if need_dq else None, d_raw, d_comp, delta[:, :, :heads]


def compile_config(config) -> None:
    """Compile (or load from TileLang's disk cache) one configuration of
    :func:`dispatched_configs`, or the delta kernel of a head dim given as an int."""
    if isinstance(config, int):
        compile_cached(attention_delta_kernel, dim=config)
    elif isinstance(config, ForwardConfig):
        _compile_forward(config)
    else:
        compile_cached(sparse_window_bwd_kernel, pass_configs=config.pass_configs(), **config.kernel_kwargs())
