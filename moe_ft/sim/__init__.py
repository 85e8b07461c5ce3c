"""ETTR model, discrete-event failure simulator and policy planner."""
