"""Failure drills: deterministic faults, simulated nodes on one machine, late joins, the drill's input checks and reports."""
