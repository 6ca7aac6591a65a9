"""DSAForCausalLM: forward contract, packing, layer roles, training signal, init."""

from __future__ import annotations

import threading

import pytest
import torch

from _support.helpers import TINY_VOCAB, tiny_config
from nemo_dsa.layers.context import SequenceContext
from nemo_dsa.models.dsa_lm.modeling import DSAForCausalLM, causal_lm_loss


def make_model(seed: int = 0, **overrides) -> DSAForCausalLM:
    torch.manual_seed(seed)
    return DSAForCausalLM(tiny_config(**overrides))


@pytest.mark.parametrize("scoring", ["v4", "v41"])
def test_loss_decreases(scoring):
    model = make_model(scoring=scoring, indexer_kl_coef=0.1 if scoring == "v4" else 0.0)
    torch.manual_seed(1)
    ids = torch.randint(0, TINY_VOCAB, (2, 24))
    labels = torch.cat((ids[:, 1:], torch.full((2, 1), -100)), dim=1)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(6):
        out = model(ids, labels=labels)
        assert torch.isfinite(out.loss)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    assert losses[-1] < losses[0] - 0.3, losses


def test_packed_thd_batch_matches_documents_alone():
    """THD-style kwargs (seq_lens/-1000 padding, document-local position_ids) = documents alone."""
    model = make_model(scoring="v4").eval()
    torch.manual_seed(2)
    ids = torch.randint(0, TINY_VOCAB, (1, 40))
    seq_lens = torch.tensor([[16, 24, -1000]])
    position_ids = torch.cat((torch.arange(16), torch.arange(24))).unsqueeze(0)
    packed = model(ids, position_ids=position_ids, seq_lens=seq_lens, qkv_format="thd").logits
    first = model(ids[:, :16]).logits
    second = model(ids[:, 16:]).logits
    torch.testing.assert_close(packed[:, :16], first, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed[:, 16:], second, rtol=1e-5, atol=1e-5)


def test_seq_lens_padded_tails_are_padding():
    """THD collater layout: each document padded to seq_lens_padded; real tokens = documents alone."""
    model = make_model(scoring="v41").eval()
    torch.manual_seed(3)
    ids = torch.randint(0, TINY_VOCAB, (1, 40))
    out = model(ids, seq_lens=torch.tensor([[13, 20, -1000]]), seq_lens_padded=torch.tensor([[16, 24, -1000]]),
                position_ids=torch.cat((torch.arange(16), torch.arange(24))).unsqueeze(0)).logits
    torch.testing.assert_close(out[:, :13], model(ids[:, :13]).logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[:, 16:36], model(ids[:, 16:36]).logits, rtol=1e-5, atol=1e-5)


def test_padding_rows_and_labels():
    model = make_model(scoring="v41")
    ids = torch.randint(0, TINY_VOCAB, (2, 19))
    mask = torch.ones(2, 19, dtype=torch.long)
    mask[1, 11:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    out = model(ids, labels=labels, attention_mask=mask)
    assert out.logits.shape == (2, 19, TINY_VOCAB) and torch.isfinite(out.logits).all()
    torch.testing.assert_close(out.loss, causal_lm_loss(out.logits, labels))
    # padding_mask (True = padding) is the same layout when no attention_mask is given.
    again = model(ids, labels=labels, padding_mask=mask == 0)
    torch.testing.assert_close(again.logits, out.logits)
    # No counted label: loss 0, not NaN.
    empty = model(ids, labels=torch.full_like(ids, -100))
    assert empty.loss.item() == 0.0


def test_bad_inputs_raise():
    model = make_model()
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.randint(0, TINY_VOCAB, (12,)))
    with pytest.raises(ValueError, match="labels"):
        model(torch.randint(0, TINY_VOCAB, (1, 12)), labels=torch.zeros(1, 11, dtype=torch.long))


def test_v41_layer_roles_and_candidates():
    cfg = dict(
        scoring="v41", num_hidden_layers=6, compress_ratios=(4, 0, 4, 4, 4, 8), kv_source_layer_ids=(0, 3),
        index_source_layer_ids=(0, 2, 3), candidate_source_layer_id=0, candidate_block_size=2,
        candidate_topk_blocks=2,
    )
    model = make_model(**cfg)
    roles = [layer.attn.role for layer in model.layers]
    assert roles == ["source", "window", "reindex", "source", "reuse", "all_groups"]
    attn = [layer.attn for layer in model.layers]
    assert attn[2].compressor is None and attn[2].indexer.compressor is None
    assert attn[4].compressor is None and attn[4].indexer is None
    assert "layers.2.attn.indexer.wq_b.weight" in model.state_dict()
    ids = torch.randint(0, TINY_VOCAB, (2, 33))
    out = model(ids, labels=ids)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert all(p.grad is None for layer in attn if layer.indexer is not None for p in layer.indexer.parameters())
    assert attn[0].compressor.wkv.weight.grad.abs().sum() > 0  # layer 4 reuses its KV


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(kv_source_layer_ids=(0,)), "kv_source_layer_ids"),
        (dict(kv_source_layer_ids=(3,)), "kv_source_layer_ids"),
        (dict(kv_source_layer_ids=(1, 3), index_source_layer_ids=(1,)), "index_source_layer_ids"),
        (dict(candidate_source_layer_id=1), "candidate_source_layer_id"),
        (dict(scoring="v41", candidate_source_layer_id=2), "candidate_source_layer_id"),
    ],
)
def test_bad_roles_raise(overrides, field):
    with pytest.raises(ValueError, match=field):
        tiny_config(**overrides)


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(o_lora_rank=8, o_groups=3), "o_groups"),
        (dict(o_lora_rank=-1), "o_lora_rank"),
        (dict(compress_rope_theta=0.0), "compress_rope_theta"),
        (dict(rope_scaling={"type": "yarn", "factor": 4}), "rope_scaling"),
        (dict(rope_scaling={"rope_type": "dynamic", "factor": 2}), "rope_scaling"),
    ],
)
def test_bad_released_attention_fields_raise(overrides, field):
    with pytest.raises(ValueError, match=field):
        tiny_config(**overrides)


def test_initialize_weights_deterministic_and_counts():
    a, b = make_model(seed=5), make_model(seed=5)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert a.num_parameters() == sum(p.numel() for p in a.parameters())
    assert (a.layers[1].attn.attn_sink == 0).all() and (a.layers[1].attn.compressor.ape == 0).all()
    tied = make_model(tie_word_embeddings=True)
    assert tied.head.weight is tied.embed.weight
    assert tied.num_parameters() == a.num_parameters() - a.head.weight.numel()
    v41 = make_model(scoring="v41")
    assert v41.num_parameters(only_trainable=True) < v41.num_parameters()


class ThreadContext(SequenceContext):
    """Context parallelism simulated with threads (forward only): ranks exchange via a board."""

    def __init__(self, rank: int, size: int, board: list, barrier: threading.Barrier) -> None:
        self.rank, self.size, self.board, self.barrier = rank, size, board, barrier

    def gather_sequence(self, x, dim):
        self.barrier.wait()
        self.board[self.rank] = x
        self.barrier.wait()
        out = torch.cat(list(self.board), dim)
        self.barrier.wait()
        return out

    def previous_tail(self, x, n, dim):
        full = self.gather_sequence(x, dim)
        if self.rank == 0:
            return x.new_zeros((*x.shape[:dim], n, *x.shape[dim + 1 :]))
        return full.narrow(dim, self.rank * x.shape[dim] - n, n)


@pytest.mark.parametrize("scoring", ["v4", "v41"])
@pytest.mark.parametrize("cp_size", [2, 3])
def test_context_parallel_forward_matches_single_rank(scoring, cp_size):
    """Shards see exactly the unsharded run: documents cross shard boundaries, and with
    cp_size 3 the window (19 earlier tokens) is longer than a shard (16 tokens). The forward takes
    a SequenceContext as its cp_group as it is (here one that exchanges through threads)."""
    model = make_model(scoring=scoring, sliding_window=20).eval()
    torch.manual_seed(4)
    ids = torch.randint(0, TINY_VOCAB, (2, 48))
    seq_lens = torch.tensor([[13, 30, 5], [47, 1, -1000]])
    with torch.no_grad():
        ref = model(ids, seq_lens=seq_lens).logits
        board, barrier, outs = [None] * cp_size, threading.Barrier(cp_size, timeout=60), [None] * cp_size
        shard = 48 // cp_size

        def rank_forward(rank):
            ctx = ThreadContext(rank, cp_size, board, barrier)
            outs[rank] = model(ids[:, rank * shard : (rank + 1) * shard], seq_lens=seq_lens, cp_group=ctx).logits

        threads = [threading.Thread(target=rank_forward, args=(r,)) for r in range(cp_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert all(o is not None for o in outs), "a simulated rank failed"
    torch.testing.assert_close(torch.cat(outs, 1), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("scoring", ["v4", "v41"])
def test_cuda_kernels_match_cpu_reference(scoring):
    """backend='auto' on CUDA (TileLang indexer) agrees with the CPU torch reference; bf16 trains."""
    cpu = make_model(scoring=scoring, indexer_kl_coef=0.1 if scoring == "v4" else 0.0, index_topk=3)
    gpu = make_model(scoring=scoring, indexer_kl_coef=0.1 if scoring == "v4" else 0.0, index_topk=3, backend="auto")
    gpu = gpu.cuda()
    torch.manual_seed(3)
    ids = torch.randint(0, TINY_VOCAB, (2, 70))
    seq_lens = torch.tensor([[29, 41], [70, -1000]])
    ref = cpu(ids, labels=ids, seq_lens=seq_lens)
    out = gpu(ids.cuda(), labels=ids.cuda(), seq_lens=seq_lens.cuda())
    torch.testing.assert_close(out.logits.cpu(), ref.logits, rtol=2e-3, atol=2e-3)
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in gpu.parameters() if p.grad is not None)
    bf16 = gpu.to(torch.bfloat16)
    loss = bf16(ids.cuda(), labels=ids.cuda(), seq_lens=seq_lens.cuda()).loss
    loss.backward()
    assert torch.isfinite(loss)


@pytest.mark.gpu
@pytest.mark.parametrize("scoring", ["v4", "v41"])
def test_cuda_forward_from_input_ids_alone(scoring):
    """Plain rows with no layout tensor: the metadata is built on the activations' device, and a
    CPU-side seq_lens (a collator's) is moved there too."""
    cpu = make_model(scoring=scoring, index_topk=3)
    gpu = make_model(scoring=scoring, index_topk=3, backend="auto").cuda()
    ids = torch.randint(0, TINY_VOCAB, (2, 40), generator=torch.Generator().manual_seed(4))
    ref = cpu(ids, labels=ids)
    out = gpu(ids.cuda(), labels=ids.cuda())
    torch.testing.assert_close(out.logits.cpu(), ref.logits, rtol=2e-3, atol=2e-3)
    mixed = gpu(ids.cuda(), labels=ids.cuda(), seq_lens=torch.tensor([[40], [40]]))
    torch.testing.assert_close(mixed.logits, out.logits, rtol=0, atol=0)


@pytest.mark.parametrize("scoring", ["v4", "v41"])
def test_runs_under_bf16_autocast(scoring):
    model = make_model(scoring=scoring, indexer_kl_coef=0.1 if scoring == "v4" else 0.0)
    ids = torch.randint(0, TINY_VOCAB, (2, 21))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids, labels=ids)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize(
    "scoring, roles",
    [("v4", {}), ("v41", {}), ("v41", dict(kv_source_layer_ids=(1,), index_source_layer_ids=(1, 3),
                                            candidate_source_layer_id=1, candidate_block_size=2,
                                            candidate_topk_blocks=2))],
)
def test_streamed_selection_matches_materialised(scoring, roles, monkeypatch):
    """fused_topk streams the indexer's selection over query chunks; the model's logits, loss and
    gradients equal the materialising path's (same selected groups). Under bf16 autocast, where the
    indexer scores bf16 q/k (an fp32 model scores fp32 q/k, which only the reference path takes)."""
    from nemo_dsa.ops.fused_selection import interface as streaming

    calls = []
    for name in ("v4_select_topk_in_ranges", "v41_select_topk_in_ranges"):
        real = getattr(streaming, name)
        monkeypatch.setattr(streaming, name, lambda *a, _real=real, **kw: calls.append(1) or _real(*a, **kw))
    torch.manual_seed(5)
    ids = torch.randint(0, TINY_VOCAB, (2, 70))
    seq_lens = torch.tensor([[29, 41], [70, -1000]])
    runs = []
    for fused in (False, True):
        model = make_model(seed=2, scoring=scoring, index_topk=3, fused_topk=fused, **roles)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(ids, labels=ids, seq_lens=seq_lens)
        out.loss.backward()
        runs.append((out.logits, out.loss, [p.grad for p in model.parameters() if p.grad is not None]))
        assert bool(calls) == fused  # the streamed path ran exactly when asked for
    (logits0, loss0, grads0), (logits1, loss1, grads1) = runs
    assert torch.equal(logits0, logits1) and torch.equal(loss0, loss1)
    assert len(grads0) == len(grads1) and all(torch.equal(a, b) for a, b in zip(grads0, grads1))


@pytest.mark.parametrize("scoring", ["v4", "v41"])
@pytest.mark.parametrize("fused_topk", [True, False])
def test_forward_under_inference_mode_equals_no_grad(scoring, fused_topk):
    """Metadata made under torch.inference_mode has no version counter: nothing may rely on one."""
    model = make_model(scoring=scoring, fused_topk=fused_topk).eval()
    ids = torch.randint(0, TINY_VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(ids).logits
    with torch.inference_mode():
        got = model(ids).logits
    assert torch.equal(got, expected)
