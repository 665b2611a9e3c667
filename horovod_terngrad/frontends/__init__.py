"""Layer 4: framework frontends."""
