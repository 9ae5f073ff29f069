"""``chunkzero train --backend jax``: the same job as :mod:`torch_backend.train`, with
:class:`jax_backend.ZeroTrainer`'s ZeRO-3 step over the chunk layout.

:mod:`.run` checks the run and launches ``--nproc`` JAX processes (:func:`chunkzero.workers.launch_processes`)
or, under an external launcher, runs as one; :mod:`.worker` is what each process runs; :mod:`.adapter`
the trainer behind the interface the report reads; :mod:`.loop` the loop. Data, the model's kind and
tokenizer, the LR schedule, the run folder and the report are the job core's (:mod:`chunkzero.job`,
:mod:`chunkzero.train_config`), shared with the torch engine, so both engines train the same stream.
"""
