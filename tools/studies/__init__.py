"""Research scripts: studies whose results are recorded in docs/ (run from the repository root)."""
