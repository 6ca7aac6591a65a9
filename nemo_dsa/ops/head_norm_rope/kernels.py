"""TileLang kernels of V4's per-head q RMS norm + RoPE, forward and backward, one pass each.

A block takes ``block_heads`` rows (heads) of one token: ``128`` threads, 16 channels a thread at
D = 512. The forward reads x once, keeps its fp32 copy in registers, reduces the squares over the
row (a block all-reduce), rounds ``y = x * rstd`` to bf16 into shared memory (so a channel can read
its rotary partner) and writes the rotated row and ``rstd``. The backward reads the output's
gradient and x once: the rotary channels' gradient is rotated back in fp32 and rounded to bf16 (the
reference's rounding), then ``dx = rstd * (g - y * mean(g * y))`` with ``y = x * rstd`` in fp32.

Counts at S = 16,384, 64 heads of 512 (one V4-Flash layer): the eager ops move ~16 GB in the
forward and ~30 GB in the backward; these kernels move 2 GB and 3 GB.
Lowered for sm_90a on the CPU (tests/ops/test_head_norm_rope.py); checked against the reference on
the GPU (tests/ops/test_head_norm_rope_gpu.py). Importing this module does not import TileLang.
"""


from nemo_dsa.ops._tilelang import tilelang

THREADS = 128
MAX_BLOCK_HEADS = 4


def supports(dim: int, rope_dim: int) -> bool:
    """Shapes the kernels are built for: head dims in whole multiples of 128 channels (one row
    spread evenly over the block's threads; V4's 512), an even rotary width within the head."""
    return dim % 128 == 0 and rope_dim % 2 == 0 and 0 <= rope_dim <= dim


def block_heads_for(heads: int) -> int:
    """Rows a block takes: the largest of 4, 2, 1 dividing ``heads`` (a block stays in one token)."""
    return next(b for b in (4, 2, 1) if heads % b == 0)


def forward_kernel(dim: int, rope_dim: int, block_heads: int):
    """PrimFunc: ``X [rows, dim]`` bf16 (rows = tokens x heads, token-major) -> ``Q`` bf16 and
    ``Rstd [rows]`` fp32; ``Cos``/``Sin [tokens, rope_dim // 2]`` fp32; grid (tokens, heads / block_heads)."""
    T = tilelang().language
    half, plain = rope_dim // 2, dim - rope_dim
    rows, tokens = T.dynamic("rows"), T.dynamic("tokens")

    @T.prim_func
    def head_rms_rope_fwd(
        X: T.Tensor((rows, dim), T.bfloat16),
        Cos: T.Tensor((tokens, max(half, 1)), T.float32),
        Sin: T.Tensor((tokens, max(half, 1)), T.float32),
        Q: T.Tensor((rows, dim), T.bfloat16),
        Rstd: T.Tensor((rows,), T.float32),
        heads: T.int32,
        eps: T.float32,
    ):
        with T.Kernel(tokens, T.ceildiv(heads, block_heads), threads=THREADS) as (token, head_block):
            first_row = token * heads + head_block * block_heads
            x_s = T.alloc_shared((block_heads, dim), T.bfloat16)
            xf = T.alloc_fragment((block_heads, dim), T.float32)
            squares = T.alloc_fragment((block_heads, dim), T.float32)
            rstd = T.alloc_fragment((block_heads,), T.float32)
            y_s = T.alloc_shared((block_heads, dim), T.float32)  # bf16-rounded values
            T.copy(X[first_row, 0], x_s)
            T.copy(x_s, xf)
            for i, j in T.Parallel(block_heads, dim):
                squares[i, j] = xf[i, j] * xf[i, j]
            T.reduce_sum(squares, rstd, dim=1)
            for i in T.Parallel(block_heads):
                rstd[i] = T.rsqrt(rstd[i] / T.float32(dim) + eps)
            for i, j in T.Parallel(block_heads, dim):
                y_s[i, j] = T.cast(T.cast(xf[i, j] * rstd[i], T.bfloat16), T.float32)
            for i, j in T.Parallel(block_heads, dim):
                if j < plain:
                    Q[first_row + i, j] = T.cast(y_s[i, j], T.bfloat16)
                else:
                    pair = (j - plain) // 2
                    even, odd = y_s[i, plain + 2 * pair], y_s[i, plain + 2 * pair + 1]
                    c, s = Cos[token, pair], Sin[token, pair]
                    rotated = T.if_then_else((j - plain) % 2 == 0, even * c - odd * s, even * s + odd * c)
                    Q[first_row + i, j] = T.cast(rotated, T.bfloat16)
            for i in T.Parallel(block_heads):
                Rstd[first_row + i] = rstd[i]

    return head_rms_rope_fwd


def backward_kernel(dim: int, rope_dim: int, block_heads: int):
    """PrimFunc: ``G`` (the gradient of Q), ``X``, ``Rstd``, ``Cos``/``Sin`` -> ``DX`` bf16; grid as the forward's."""
    T = tilelang().language
    half, plain = rope_dim // 2, dim - rope_dim
    rows, tokens = T.dynamic("rows"), T.dynamic("tokens")

    @T.prim_func
    def head_rms_rope_bwd(
        G: T.Tensor((rows, dim), T.bfloat16),
        X: T.Tensor((rows, dim), T.bfloat16),
        Rstd: T.Tensor((rows,), T.float32),
        Cos: T.Tensor((tokens, max(half, 1)), T.float32),
        Sin: T.Tensor((tokens, max(half, 1)), T.float32),
        DX: T.Tensor((rows, dim), T.bfloat16),
        heads: T.int32,
    ):
        with T.Kernel(tokens, T.ceildiv(heads, block_heads), threads=THREADS) as (token, head_block):
            first_row = token * heads + head_block * block_heads
            g_s = T.alloc_shared((block_heads, dim), T.bfloat16)
            x_s = T.alloc_shared((block_heads, dim), T.bfloat16)
            g_y = T.alloc_fragment((block_heads, dim), T.float32)
            normalized = T.alloc_fragment((block_heads, dim), T.float32)
            products = T.alloc_fragment((block_heads, dim), T.float32)
            rstd = T.alloc_fragment((block_heads,), T.float32)
            dot = T.alloc_fragment((block_heads,), T.float32)
            T.copy(G[first_row, 0], g_s)
            T.copy(X[first_row, 0], x_s)
            for i in T.Parallel(block_heads):
                rstd[i] = Rstd[first_row + i]
            for i, j in T.Parallel(block_heads, dim):
                if j < plain:
                    g_y[i, j] = T.cast(g_s[i, j], T.float32)
                else:
                    pair = (j - plain) // 2
                    g_even = T.cast(g_s[i, plain + 2 * pair], T.float32)
                    g_odd = T.cast(g_s[i, plain + 2 * pair + 1], T.float32)
                    c, s = Cos[token, pair], Sin[token, pair]
                    back = T.if_then_else((j - plain) % 2 == 0, g_even * c + g_odd * s, g_odd * c - g_even * s)
                    g_y[i, j] = T.cast(T.cast(back, T.bfloat16), T.float32)  # the reference's rounding
                normalized[i, j] = T.cast(x_s[i, j], T.float32) * rstd[i]
                products[i, j] = g_y[i, j] * normalized[i, j]
            T.reduce_sum(products, dot, dim=1)
            for i, j in T.Parallel(block_heads, dim):
                DX[first_row + i, j] = T.cast(
                    (g_y[i, j] - normalized[i, j] * (dot[i] / T.float32(dim))) * rstd[i], T.bfloat16
                )

    return head_rms_rope_bwd
