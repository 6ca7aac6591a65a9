"""Context parallelism: the torch.distributed ``SequenceContext``, batch sharding, torchrun setup.

The protocol the layers call (``SequenceContext``, ``LocalContext``) lives in
``nemo_dsa.layers.context``; it is re-exported here. nemo-automodel's CP hook is
``nemo_dsa.integrations.automodel.cp``. Nothing here imports nemo-automodel or touches CUDA at
import time.
"""

from nemo_dsa.distributed.context import LocalContext, SequenceContext, sequence_context_for
from nemo_dsa.distributed.launch import CPEnv, init_from_env, shutdown
from nemo_dsa.distributed.process_group import ProcessGroupContext
from nemo_dsa.distributed.sharding import cp_padded_length, cp_shard_multiple, shard_batch

__all__ = [
    "CPEnv",
    "LocalContext",
    "ProcessGroupContext",
    "SequenceContext",
    "cp_padded_length",
    "cp_shard_multiple",
    "init_from_env",
    "sequence_context_for",
    "shard_batch",
    "shutdown",
]
