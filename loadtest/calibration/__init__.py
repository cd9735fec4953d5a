"""Fitting the models to measurements: the engine model's step time to the real vLLM-CPU engine
(calibrate_engine, step_time_fit, replay_fit), the planner's host-CPU costs (calibrate_host), and how
close the fitted model comes (fidelity_stats)."""
