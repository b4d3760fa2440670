"""Training: one job (data, model, objectives, engine), the loop, the engine, checkpoints,
models, objectives, meters, the report, and `tfspeed.fit`."""
