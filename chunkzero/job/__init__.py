"""``chunkzero train``'s framework-free job, shared by both engines (numpy and the standard library only):
the corpus, its split and the batch sampler (:mod:`.data`), the model's kind, tensors and tokenizer
(:mod:`.models`), the checks of ``--out`` and a resumed checkpoint (:mod:`.checks`) and the run's report
(:mod:`.report`: ``metrics.jsonl``, the progress bar, ``loss.png``, the summary). Each engine
(``torch_backend.train``, ``jax_backend.train``) builds its model, runs its step and samples text in its own
framework, and hands the results to the report."""
