"""What the DeepSeek-V4 and V4.1 plugins share: the parameter-layout adapter (``attention_layout``),
the fp32 LM head (``lm_head``), recomputation (``recompute``), the auxiliary-loss gradient
(``aux_loss``) and strict HF checkpoint loading (``checkpoint``)."""
