"""Context parallelism: the sequence handle the model talks to, batch sharding, torchrun setup.

Nothing here imports nemo-automodel or touches CUDA at import time.
"""

from nemo_dsa.distributed.context import LocalContext, SequenceContext, sequence_context_for
from nemo_dsa.distributed.launch import CPEnv, init_from_env, shutdown
from nemo_dsa.distributed.process_group import ProcessGroupContext
from nemo_dsa.distributed.sharding import (
    cp_padded_length,
    cp_shard_multiple,
    prepare_model_inputs_for_cp,
    shard_batch,
)

__all__ = [
    "CPEnv",
    "LocalContext",
    "ProcessGroupContext",
    "SequenceContext",
    "cp_padded_length",
    "cp_shard_multiple",
    "init_from_env",
    "prepare_model_inputs_for_cp",
    "sequence_context_for",
    "shard_batch",
    "shutdown",
]
