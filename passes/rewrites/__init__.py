"""The compiler passes: the pass framework (``manager``), pattern-matching helpers
(``matching``), the fusions and the clean-up, the built-in set by config flag
(``builtin``), and the adapter that hands a pass manager to Inductor."""
