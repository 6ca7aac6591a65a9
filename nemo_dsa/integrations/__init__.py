"""nemo-automodel integrations: one package per model family, the shared glue beside them.

- ``deepseek_v4/``, ``deepseek_v41/``: nemo-automodel's DeepSeek-V4 and V4.1 with every attention
  layer on nemo_dsa (``NemoDsaDeepseekV4ForCausalLM``, ``NemoDsaDeepseekV41ForCausalLM`` and their
  attention classes, drop-ins for the built-in's).
- ``automodel/``: nemo_dsa's own small LM as a nemo-automodel model (config and model classes, the
  CP sharder hook, the stdlib docstring dataset).
- ``common/``: what the DeepSeek plugins share (the parameter-layout adapter, the fp32 LM head,
  recomputation, the auxiliary-loss gradient, strict checkpoint loading).

The exports below load lazily: ``import nemo_dsa`` and ``import nemo_dsa.integrations`` import
neither nemo-automodel nor transformers; naming a class imports its family's package.
"""

from nemo_dsa._lazy import lazy_exports

_EXPORTS = {
    "NemoDsaDeepseekV4ForCausalLM": "nemo_dsa.integrations.deepseek_v4",
    "NemoDsaDeepseekV4Attention": "nemo_dsa.integrations.deepseek_v4",
    "NemoDsaDeepseekV41ForCausalLM": "nemo_dsa.integrations.deepseek_v41",
    "NemoDsaDeepseekV41Attention": "nemo_dsa.integrations.deepseek_v41",
    "NemoDsaV4Config": "nemo_dsa.integrations.automodel",
    "NemoDsaV41Config": "nemo_dsa.integrations.automodel",
    "NemoDsaV4ForCausalLM": "nemo_dsa.integrations.automodel",
    "NemoDsaV41ForCausalLM": "nemo_dsa.integrations.automodel",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
