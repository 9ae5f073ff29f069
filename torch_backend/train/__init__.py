"""``chunkzero train``, the main job: the launcher and its workers (:mod:`.launch`, :mod:`.worker`),
the training loop (:mod:`.loop`) over the model and optimizer behind one small interface
(:mod:`.adapter`: ZeroDDP + ZeroOptimizer, or DDP + AdamW), models and data, and the run's report.
The CLI imports it lazily, inside the command."""
