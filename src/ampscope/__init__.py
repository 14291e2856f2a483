"""ampscope."""
