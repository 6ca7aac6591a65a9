"""The DeepSeek-V4-style causal LM: configuration, model and checkpoints (DeepSeek-V4 key names)."""

from nemo_dsa.models.dsa_lm.checkpoint import load_checkpoint, save_checkpoint
from nemo_dsa.models.dsa_lm.configuration import DSAModelConfig
from nemo_dsa.models.dsa_lm.modeling import DSACausalLMOutput, DSAForCausalLM

__all__ = ["DSACausalLMOutput", "DSAForCausalLM", "DSAModelConfig", "load_checkpoint", "save_checkpoint"]
