"""nemo_dsa's small LM as a nemo-automodel model: transformers config classes and registry-ready
model classes (``modeling.py``, registered with ``AutoConfig`` on import), the context-parallel
sharder hook (``cp.py``) and the stdlib docstring dataset (``data.py``)."""

from nemo_dsa.integrations.automodel.modeling import (
    NemoDsaV4Config,
    NemoDsaV4ForCausalLM,
    NemoDsaV41Config,
    NemoDsaV41ForCausalLM,
    register_with_transformers,
)

__all__ = ["NemoDsaV4Config", "NemoDsaV41Config", "NemoDsaV4ForCausalLM", "NemoDsaV41ForCausalLM", "register_with_transformers"]
