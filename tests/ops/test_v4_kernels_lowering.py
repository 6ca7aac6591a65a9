"""The V4 kernels lower for sm_90a without a GPU: wgmma in the source, shared memory in budget.

The configurations come from ``kernels.dispatched_configs()`` (the wrappers' only table). Forward
tiles differ by (query, head) rows and D, backward blocks by warpgroup count and padded heads;
one case per class keeps the file near a minute of lowering (~2-5 s a kernel). nvcc then builds
real cubins for the benchmark shape.
"""

from __future__ import annotations

import shutil

import pytest
from _support.lowering import pingpong_problems

from nemo_dsa.ops import _tilelang as tlh
from nemo_dsa.ops.v4_indexer import kernels

TABLE = {(f.heads, f.index_dim): (f, b) for f, b in kernels.dispatched_configs()}
# Forward tiles change with the head count (queries per tile) and D = 256 (half the rows);
# backward blocks change with the warpgroup count (1, 2, 4) and the 16-padded-heads case.
FORWARD_CASES = [(1, 128), (8, 64), (32, 128), (64, 128), (128, 128), (64, 256), (128, 256)]
BACKWARD_CASES = [(1, 64), (16, 256), (64, 128), (128, 128), (64, 256), (128, 256)]


def test_table_covers_supported_shapes():
    assert set(TABLE) == {(h, d) for h in kernels.SUPPORTED_HEADS for d in kernels.SUPPORTED_DIMS}
    for (heads, _), (fwd, bwd) in TABLE.items():
        assert (fwd.block_q * heads) % 8 == 0 and fwd.block_q * heads >= min(128, 8 * heads)
        assert bwd.threads in (128, 256, 512)


@pytest.mark.parametrize("heads,dim", [(32, 512), (48, 128), (64, 32)])
def test_configs_reject_shapes_outside_the_table(heads, dim):
    """A shape the table lacks is one ValueError naming the argument, not TileLang's layout error
    (``--dims 512`` once reached the backward's lowering through scripts/precompile_kernels.py)."""
    name = "heads" if heads not in kernels.SUPPORTED_HEADS else "index_dim"
    for config in (kernels.forward_config, kernels.backward_config):
        with pytest.raises(ValueError, match=f"{name} must be one of"):
            config(heads, dim)


def test_every_shape_the_wrappers_accept_pads_to_a_config():
    """The wrappers take heads 1..128 and head dims that are multiples of 16 up to 256, pad them
    (``padded_shape``) and only then ask for a config: the table check never fires on that path."""
    for heads in range(1, 129):
        for dim in range(16, 257, 16):
            heads_to, dim_to = kernels.padded_shape(heads, dim)
            assert heads_to >= heads and dim_to >= dim
            forward, backward = kernels.forward_config(heads_to, dim_to), kernels.backward_config(heads_to, dim_to)
            assert (forward.heads, backward.heads, backward.index_dim) == (heads_to, heads_to, dim_to)


def test_precompile_script_rejects_shapes_outside_the_table(capsys):
    """The script's --heads / --dims take the indexers' table only: a wrong one is argparse's line."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "precompile_kernels.py"
    spec = importlib.util.spec_from_file_location("precompile_kernels", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--dims", "512", "--kinds", "v4_bwd"])
    assert exit_info.value.code == 2
    assert "argument --dims: invalid choice: 512" in capsys.readouterr().err


def _check_lowering(prim_func, pass_configs=None):
    artifact = tlh.lower(prim_func, pass_configs=pass_configs)
    assert "tl::wgmma_ss" in str(artifact.kernel_source), "expected Hopper wgmma GEMMs"
    smem = tlh.dynamic_shared_memory_bytes(artifact)
    assert 0 < smem <= tlh.HOPPER_SMEM_LIMIT, f"{smem} bytes of dynamic shared memory"
    return str(artifact.kernel_source), smem


@pytest.mark.parametrize("heads,dim", FORWARD_CASES)
def test_forward_lowers_to_the_pingpong_schedule_within_shared_memory(heads, dim):
    config = TABLE[(heads, dim)][0]
    source, smem = _check_lowering(kernels.v4_logits_kernel(**config.as_kwargs()), config.pass_configs())
    rows = config.block_q * config.heads
    problems = pingpong_problems(source, rows, config.producer_registers, config.consumer_registers)
    assert not problems, f"{config}: missing {problems}"
    assert smem >= config.shared_memory_bytes(), f"{config}: tiles need more than {smem} bytes"


@pytest.mark.parametrize("heads,dim", BACKWARD_CASES)
def test_backward_lowers_with_wgmma_within_shared_memory(heads, dim):
    _check_lowering(kernels.v4_topk_backward_kernel(**TABLE[(heads, dim)][1].as_kwargs()))


def test_backward_cases_cover_every_block_size():
    assert {TABLE[c][1].threads for c in TABLE} == {TABLE[c][1].threads for c in BACKWARD_CASES}


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found: cannot build cubins")
@pytest.mark.parametrize("which", ["forward", "backward"])
def test_nvcc_builds_cubin_for_benchmark_shape(which):
    fwd, bwd = TABLE[(64, 128)]
    if which == "forward":
        kernel = tlh.compile_cubin(kernels.v4_logits_kernel(**fwd.as_kwargs()), pass_configs=fwd.pass_configs())
    else:
        kernel = tlh.compile_cubin(kernels.v4_topk_backward_kernel(**bwd.as_kwargs()))
    assert "wgmma" in kernel.get_kernel_source()


def test_zero_padding_of_odd_shapes_is_exact():
    """Padded heads (zero weights) and padded dims only add exact zeros to the reference logits."""
    import torch

    from nemo_dsa.visibility import causal_ks_ke
    from nemo_dsa.ops.v4_indexer.naive import v4_logits

    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 37, 3, 48, generator=gen).bfloat16()
    k = torch.randn(2, 9, 48, generator=gen).bfloat16()
    w = torch.randn(2, 37, 3, generator=gen)
    ks, ke = causal_ks_ke(2, 37, 9, 4, "cpu")
    heads_to, dim_to = kernels.padded_shape(3, 48)
    assert (heads_to, dim_to) == (4, 64)
    qp, kp, wp = kernels.pad_inputs(q, k, w, heads_to, dim_to)
    assert qp.shape == (2, 37, 4, 64) and kp.shape == (2, 9, 64) and wp.shape == (2, 37, 4)
    assert torch.equal(v4_logits(qp, kp, wp, ks, ke), v4_logits(q, k, w, ks, ke))
