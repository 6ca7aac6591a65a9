"""DeepSeek-V4.1 on nemo_dsa: nemo-automodel's ``DeepseekV41ForCausalLM`` with every attention layer
replaced by ``NemoDsaDeepseekV41Attention`` (``modeling.py``, ``attention.py``)."""

from nemo_dsa.integrations.deepseek_v41.attention import NemoDsaDeepseekV41Attention
from nemo_dsa.integrations.deepseek_v41.modeling import (
    ARCHITECTURE,
    NemoDsaDeepseekV41ForCausalLM,
    dsa_config_from_deepseek_v41,
)

__all__ = ["ARCHITECTURE", "NemoDsaDeepseekV41Attention", "NemoDsaDeepseekV41ForCausalLM", "dsa_config_from_deepseek_v41"]
