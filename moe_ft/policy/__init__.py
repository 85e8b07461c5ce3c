"""Snapshot policies (SPEC §3): small objects that map each iteration to a snapshot plan."""
