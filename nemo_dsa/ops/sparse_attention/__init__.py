"""Index-based sparse multi-query attention with a per-head sink (torch reference)."""
