"""The sparse window + compressed attention kernels' test cases on the GPU: random bf16 inputs per
case (packed documents starting anywhere, CP history, padding queries that see nothing), the error
statistics their criteria read, and which queries see no key."""

import torch

# (batch, seq_len, history, heads, dim, window, compressed rows, mode, slots, sink)
CASES = [
    (1, 300, 0, 64, 512, 128, 160, "indices", 512, True),
    (3, 129, 40, 16, 128, 1, 50, "indices", 1, False),
    (1, 203, 0, 128, 512, 128, 700, "indices", 2048, True),
    (3, 77, 0, 64, 128, 128, 0, "window", 0, True),
    (1, 150, 64, 64, 512, 128, 300, "range", 0, True),
    (2, 97, 0, 20, 96, 1, 40, "range", 0, True),  # sink on a head count padded to 64
    (1, 65, 3, 128, 128, 128, 90, "indices", 0, False),
    (3, 111, 17, 16, 512, 128, 64, "indices", 512, True),
]


def case_inputs(case, gen):
    batch, seq_len, history, heads, dim, window, num_comp, mode, slots, with_sink = case
    dev = "cuda"
    num_raw = seq_len + history
    q = torch.randn(batch, seq_len, heads, dim, generator=gen).bfloat16().to(dev)
    raw = torch.randn(batch, num_raw, dim, generator=gen).bfloat16().to(dev)
    own = torch.arange(seq_len) + history
    # Packed documents: boundaries anywhere (some before the shard: CP history), a few padding
    # queries (window_start past their own row) that see no window key.
    starts = torch.sort(torch.randint(0, num_raw, (batch, 4), generator=gen), dim=1).values
    ws = torch.zeros(batch, seq_len, dtype=torch.int64)
    for k in range(4):
        ws = torch.where(own[None] >= starts[:, k : k + 1], starts[:, k : k + 1], ws)
    ws[:, :: max(1, seq_len // 5)] = own[:: max(1, seq_len // 5)] + 1
    kw = {"sink": (torch.randn(heads, generator=gen) * 2).to(dev) if with_sink else None}
    comp = None
    if mode != "window":
        comp = torch.randn(batch, num_comp, dim, generator=gen).bfloat16().to(dev)
    if mode == "indices":
        idx = torch.randint(0, num_comp, (batch, seq_len, slots), generator=gen)
        idx = torch.where(torch.rand(idx.shape, generator=gen) < 0.2, -1, idx)
        if slots > 1:
            idx[..., 1] = idx[..., 0]  # repeated slots
        idx[:, :: max(1, seq_len // 5)] = -1  # padding queries select nothing
        kw["indices"] = idx.to(torch.int32).to(dev)
    elif mode == "range":
        ke = torch.randint(0, num_comp + 1, (batch, seq_len), generator=gen)
        ks = (ke - torch.randint(0, num_comp + 1, (batch, seq_len), generator=gen)).clamp_min(0)
        ks[:, :: max(1, seq_len // 5)] = ke[:, :: max(1, seq_len // 5)]
        kw["ks"], kw["ke"] = ks.to(torch.int32).to(dev), ke.to(torch.int32).to(dev)
    return q, raw, ws.to(torch.int32).to(dev), window, comp, kw, dim**-0.5


def error_stats(name, got, want):
    got, want = got.double(), want.double()
    err = (got - want).abs()
    return {
        "name": name,
        "rel_norm": float(err.norm() / want.norm().clamp_min(1e-30)),
        "max_abs": float(err.max()) if err.numel() else 0.0,
        "mean_abs": float(err.mean()) if err.numel() else 0.0,
        "max_rel": float((err / want.abs().clamp_min(1e-3)).max()) if err.numel() else 0.0,
    }


def sees_nothing(q, raw, ws, window, comp, kw):
    """[B, S] bool: queries with no visible key (from the reference's own index lists)."""
    from nemo_dsa.ops.sparse_attention.naive import range_key_indices, window_key_indices

    lists = [window_key_indices(ws, window, q.shape[1], raw.shape[1])]
    if kw.get("indices") is not None:
        lists.append(kw["indices"].long())
    elif kw.get("ks") is not None:
        lists.append(range_key_indices(kw["ks"], kw["ke"]))
    return ~(torch.cat(lists, -1) >= 0).any(-1)
