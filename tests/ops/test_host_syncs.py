"""Host reads (device-to-host syncs on a GPU) per model forward, counted on the CPU.

``host_reads.count_host_reads`` counts every read of tensor values on the host that nemo_dsa's
own code makes. The op references' reads (``nemo_dsa/ops/``: loop bounds of the CPU references;
the kernels replace them on a GPU) are reported apart. Outside them, one forward of the
DeepSeek-V4 plugin or of ``DSAForCausalLM`` makes one: the metadata's check of the layout, all
ratios at once, which also reads the plugin's ``input_ids`` range check. Before, the plugin made
24 in the THD case below: every ratio's metadata re-checked the layout with one read per check,
the all-groups and indexer layers re-read their ks/ke, the input_ids check read on its own.
"""

from __future__ import annotations

import random

import pytest
import torch

from _support.helpers import tiny_config
from _support.host_reads import count_host_reads
from nemo_dsa.metadata import (
    _ids_in_several_runs,
    _name_id_in_several_runs,
    build_attention_metadata,
    build_attention_metadata_for_ratios,
)
from nemo_dsa.models.dsa_lm.modeling import DSAForCausalLM
from nemo_dsa.visibility import check_ks_ke

OPS = "ops/"


def reads_outside_ops(fn) -> list:
    fn()  # a first call may fill caches (RoPE tables, compiled paths)
    with count_host_reads() as reads:
        fn()
    return reads.outside(OPS)


def test_counter_sees_reads():
    # The counter itself: a check_ks_ke of a caller's pair reads once (all three value checks).
    ks = torch.zeros(2, 8, dtype=torch.int32)
    ke = torch.ones(2, 8, dtype=torch.int32)
    with count_host_reads() as reads:
        ranges = check_ks_ke(ks, ke, batch=2, queries=8, num_keys=2, device=ks.device)
    assert [site[0] for site in reads.sites] == ["visibility.py"] and reads.total == 1
    assert ranges.ks is ks and ranges.ke is ke and ranges.num_keys == 2


@pytest.mark.parametrize("layout", ["rows", "seq_lens", "cu_seqlens", "ids_positions_mask"])
def test_metadata_of_every_ratio_reads_the_host_once(layout):
    seq, docs = 96, [30, 41, 25]
    ids = torch.cat([torch.full((n,), d + 1) for d, n in enumerate(docs)]).unsqueeze(0)
    positions = torch.cat([torch.arange(n) for n in docs]).unsqueeze(0)
    kwargs = {
        "rows": dict(batch_size=2, seq_len=seq),
        "seq_lens": dict(seq_lens=torch.tensor([docs]), position_ids=positions),
        "cu_seqlens": dict(cu_seqlens=torch.tensor([0, 30, 71, 96]), seq_len=seq),
        "ids_positions_mask": dict(packed_seq_ids=ids, position_ids=positions, attention_mask=ids > 0),
    }[layout]
    with count_host_reads() as reads:
        metas = build_attention_metadata_for_ratios(compress_ratios=(1, 4, 128, 4), **kwargs)
    assert sorted(metas) == [1, 4, 128]
    assert reads.total <= 1, reads.by_site()
    for ratio, meta in metas.items():  # the same metadata as one ratio at a time
        single = build_attention_metadata(compress_ratio=ratio, **kwargs)
        for name in ("positions", "doc_ids", "local_positions", "token_valid", "ks", "ke", "group_valid"):
            assert torch.equal(getattr(meta, name), getattr(single, name)), (ratio, name)
        # The builder's ranges satisfy the contract by construction (the ops take them unchecked);
        # checked as a caller's pair, they pass.
        ranges = meta.key_ranges
        assert ranges.ks is meta.ks and ranges.ke is meta.ke and ranges.num_keys == meta.num_groups
        check_ks_ke(meta.ks, meta.ke, batch=meta.batch_size, queries=seq, num_keys=meta.num_groups, device=meta.device)


def test_bad_layouts_still_name_the_argument():
    ids = torch.tensor([[1, 1, 2, 2, 1, 0, 0, 0]])
    with pytest.raises(ValueError, match="packed_seq_ids: id 1 of row 0 appears again at token 4"):
        build_attention_metadata_for_ratios(compress_ratios=(1, 4), packed_seq_ids=ids)
    with pytest.raises(ValueError, match="seq_lens: lengths of row 0 sum to 7, expected 8"):
        build_attention_metadata_for_ratios(compress_ratios=(4,), seq_lens=torch.tensor([[3, 4]]), seq_len=8)
    with pytest.raises(ValueError, match="max_position_embeddings is 4"):
        build_attention_metadata_for_ratios(compress_ratios=(4,), seq_len=8, batch_size=1, max_position_embeddings=4)
    with pytest.raises(ValueError, match="compress_ratio must be"):
        build_attention_metadata_for_ratios(compress_ratios=(4, 0), seq_len=8, batch_size=1)
    with pytest.raises(TypeError, match="compress_ratios"):
        build_attention_metadata_for_ratios(compress_ratios=4, seq_len=8, batch_size=1)

    def caller_error():
        raise ValueError("the caller's own check")

    flags = (torch.tensor([False, True]), caller_error)
    with pytest.raises(ValueError, match="the caller's own check"):  # reported before the layout's errors
        build_attention_metadata_for_ratios(compress_ratios=(1,), packed_seq_ids=ids, extra_checks=(flags,))
    with count_host_reads() as reads:
        build_attention_metadata_for_ratios(compress_ratios=(1, 4), seq_len=8, batch_size=1,
                                            extra_checks=((torch.zeros(3, dtype=torch.bool), caller_error),))
    assert reads.total == 1


def test_sync_free_run_rule_equals_the_named_one():
    # The deferred check (a stable sort, fixed shapes) flags exactly the layouts the eager one
    # (run starts, unique) names, on random ids with gaps, repeats and padding.
    rng = random.Random(5)
    for _ in range(400):
        batch, seq = rng.randint(1, 3), rng.randint(1, 24)
        ids = torch.tensor([[rng.choice([0, 1, 1, 2, 2, 3, 7]) for _ in range(seq)] for _ in range(batch)])
        if rng.random() < 0.5:  # mostly-valid layouts: runs in order
            ids = ids.sort(dim=1).values
        valid = ids > 0
        flagged = bool(_ids_in_several_runs(ids, valid).any())
        try:
            _name_id_in_several_runs(ids, valid)
            named = False
        except ValueError:
            named = True
        assert flagged == named, ids


def test_model_forward_reads_the_host_once():
    torch.manual_seed(0)
    model = DSAForCausalLM(tiny_config(compress_ratios=(0, 4, 8, 4), indexer_kl_coef=0.5))
    ids = torch.randint(0, model.config.vocab_size, (2, 64))
    positions = torch.cat([torch.arange(20), torch.arange(44)]).expand(2, 64)
    sites = reads_outside_ops(lambda: model(ids, labels=ids, position_ids=positions).loss.backward())
    assert len(sites) <= 1, sites


def test_plugin_forward_reads_the_host_once():
    try:
        import nemo_automodel  # noqa: F401
    except ImportError:
        pytest.skip("nemo-automodel is not installed (the DeepSeek-V4 plugin needs it)")
    from _support.v4_builtin_and_plugin import VOCAB, build_plugin, thd_batch
    from _support.v4_builtin_and_plugin import tiny_config as v4_config

    torch.manual_seed(0)
    model = build_plugin(v4_config(), indexer_kl_coef=0.5)
    model.initialize_weights(dtype=torch.float32)
    batch, _ = thd_batch([100, 150, 38], [100, 150, 38], seed=3)
    batch.pop("labels", None)
    ids = torch.randint(0, VOCAB, (2, 288), generator=torch.Generator().manual_seed(4))
    for run in (
        lambda: model.eval()(**batch),
        lambda: model.eval()(ids, attention_mask=torch.ones_like(ids)),
        lambda: model.train()(**batch).logits.sum().backward(),
    ):
        sites = reads_outside_ops(run)
        print(sites)
        assert len(sites) <= 1, sites
        assert {path for path, _, _ in sites} <= {"metadata.py"}, sites
    with pytest.raises(ValueError, match=r"input_ids must be in \[0, vocab_size=101\)"):
        model(ids + VOCAB)  # the input check still raises, out of the shared read


def test_v41_plugin_forward_reads_the_host_once_outside_the_references():
    try:
        import nemo_automodel  # noqa: F401
    except ImportError:
        pytest.skip("nemo-automodel is not installed (the DeepSeek-V4.1 plugin needs it)")
    from _support.v41_builtin_and_plugin import batch, build_models

    _, model = build_models()
    for kind in ("rows", "packed"):
        inputs = {k: v for k, v in batch(kind).items() if k != "labels"}
        sites = reads_outside_ops(lambda: model.eval()(**inputs))
        # The V4.1 layers' own cache rounding and candidate blocks are references on CPU (ops/);
        # what is left is the metadata's one read for every ratio of the forward.
        assert len(sites) <= 1, (kind, sites)
        assert {path for path, _, _ in sites} <= {"metadata.py"}, (kind, sites)
