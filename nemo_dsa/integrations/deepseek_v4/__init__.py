"""DeepSeek-V4 on nemo_dsa: nemo-automodel's ``DeepseekV4ForCausalLM`` with every attention layer
replaced by ``NemoDsaDeepseekV4Attention`` (``modeling.py``, ``attention.py``; ``backbone.py``: the
built-in's ``model.model`` building nemo_dsa's metadata per forward; ``pipeline.py``: the model as
one of nemo-automodel's pipeline stages)."""

from nemo_dsa.integrations.deepseek_v4.attention import NemoDsaDeepseekV4Attention
from nemo_dsa.integrations.deepseek_v4.modeling import (
    ARCHITECTURE,
    NemoDsaDeepseekV4ForCausalLM,
    NemoDsaDeepseekV4Output,
    dsa_config_from_deepseek_v4,
)

__all__ = [
    "ARCHITECTURE",
    "NemoDsaDeepseekV4Attention",
    "NemoDsaDeepseekV4ForCausalLM",
    "NemoDsaDeepseekV4Output",
    "dsa_config_from_deepseek_v4",
]
