"""No TileLang build after the first training step (pytest -m gpu): the first step builds every
kernel the model's selection and attention can choose (``ops.warm_up``), so later steps at new
lengths (shorter than top-k keys, a few tokens, ragged and packed) add nothing to the compile
cache. Counted on ``ops._tilelang._compile_cache``, whose keys name factory and configuration.
"""

from __future__ import annotations

import pytest
import torch

from _support.helpers import TINY_VOCAB, tiny_config
from nemo_dsa.models.dsa_lm.modeling import DSAForCausalLM
from nemo_dsa.ops import _tilelang

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU for the TileLang kernels"),
]

# (S, packed document lengths or None): K = S / 4 keys below and above top-k, a single token,
# ragged lengths, several documents in one row.
LATER_STEPS = [(1, None), (3, None), (5, None), (37, None), (129, None), (255, [100, 155]), (300, None),
               (1001, [1, 500, 500]), (2049, None), (3001, [3001]), (700, [7, 93, 600])]  # fmt: skip


def _step(model, seq: int, docs, seed: int) -> None:
    ids = torch.randint(0, TINY_VOCAB, (1, seq), generator=torch.Generator().manual_seed(seed)).cuda()
    seq_lens = None if docs is None else torch.tensor([docs]).cuda()
    loss = model(ids, labels=ids, seq_lens=seq_lens).loss
    loss.backward()
    assert torch.isfinite(loss)


@pytest.mark.parametrize("scoring", ["v4", "v41"])
def test_later_lengths_build_no_kernel(scoring):
    torch.manual_seed(0)
    config = tiny_config(scoring=scoring, backend="auto", index_topk=64, indexer_kl_coef=0.0,
                         num_attention_heads=16, head_dim=128, qk_rope_head_dim=64, hidden_size=256,
                         q_lora_rank=64, index_n_heads=32, index_head_dim=128, sliding_window=128)  # fmt: skip
    model = DSAForCausalLM(config).cuda().to(torch.bfloat16)
    _step(model, 2048, None, 0)  # the first step: K = 512 keys, more than top-k
    built = set(_tilelang._compile_cache)
    assert built, "the first step built no TileLang kernel: the test would prove nothing"
    for i, (seq, docs) in enumerate(LATER_STEPS):
        _step(model, seq, docs, i + 1)
        new = set(_tilelang._compile_cache) - built
        assert not new, f"S={seq} docs={docs} built {[(k[1], dict(k[2])) for k in new]}"
