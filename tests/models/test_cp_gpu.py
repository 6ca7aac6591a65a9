"""Context parallelism over NCCL on two GPUs: primitives and the model vs one GPU.

Same checks as the gloo tests (tests/distributed/test_cp_primitives.py, tests/models/test_cp_model.py) with CUDA
tensors, so the indexer runs its TileLang kernels; the single-process reference runs on cuda:0.
"""

from __future__ import annotations

import traceback

import pytest
import torch

from _support.cp_model_cases import CASES, all_cases, assert_cp_matches, single_process_run
from _support.cp_primitive_checks import check_gather, check_metadata_without_grad, check_previous_tail
from _support.cp_spawn import run_on_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        torch.cuda.device_count() < 2,
        reason=f"needs 2 CUDA GPUs for NCCL context parallelism, found {torch.cuda.device_count()}",
    ),
]

# "torch": the CP plumbing alone on CUDA; "auto": with the TileLang indexer kernels.
BACKENDS = ("torch", "auto")
PRIMITIVES = {
    "gather_fp32": lambda c, r, s, d: check_gather(c, r, s, (2, 129, 3), 1, torch.float32, 10, d),
    "gather_bf16": lambda c, r, s, d: check_gather(c, r, s, (3, 65, 2, 64), -3, torch.bfloat16, 20, d),
    "tail_fp32": lambda c, r, s, d: check_previous_tail(c, r, s, (2, 129, 3), 1, 4, torch.float32, 40, d),
    "tail_bf16": lambda c, r, s, d: check_previous_tail(c, r, s, (2, 65, 64), 1, 65, torch.bfloat16, 50, d),
    "tail_spans_ranks": lambda c, r, s, d: check_previous_tail(c, r, s, (2, 6, 3), 1, 9, torch.float32, 60, d),
    "metadata_without_grad": lambda c, r, s, d: check_metadata_without_grad(c, r, s, d),
}


def _primitives_then_model(rank: int, size: int) -> dict:
    import torch.distributed as dist

    from nemo_dsa.distributed import ProcessGroupContext

    ctx = ProcessGroupContext(dist.group.WORLD)
    device = torch.device("cuda", rank)
    results = {}
    for name, check in PRIMITIVES.items():
        try:
            check(ctx, rank, size, device)
            results[name] = None
        except Exception:
            results[name] = traceback.format_exc()
        dist.barrier()
    for backend in BACKENDS:
        results[backend] = all_cases(rank, size, "cuda", backend)
    return results


@pytest.fixture(scope="module")
def nccl_results():
    return run_on_ranks(_primitives_then_model, 2, backend="nccl")


@pytest.mark.parametrize("name", list(PRIMITIVES))
def test_primitive_on_nccl(nccl_results, name):
    failures = [f"rank {r}:\n{res[name]}" for r, res in enumerate(nccl_results) if res[name] is not None]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_model_cp_on_two_gpus_equals_one_gpu(nccl_results, case, backend):
    ref = single_process_run(case, "cuda:0", backend)
    ref = {k: (v.cpu() if isinstance(v, torch.Tensor) else {n: g.cpu() for n, g in v.items()}) for k, v in ref.items()}
    assert_cp_matches(nccl_results[0][backend], ref, case, 2, tol=1e-4, kernels=backend == "auto")
