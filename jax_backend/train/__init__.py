"""``chunkzero train --backend jax``: the same job as :mod:`torch_backend.train`, with
:class:`jax_backend.ZeroTrainer`'s ZeRO-3 step over the chunk layout.

:mod:`.run` checks the run and launches ``--nproc`` JAX processes (:func:`chunkzero.workers.launch_processes`)
or, under an external launcher, runs as one; :mod:`.worker` is what each process runs; :mod:`.engine`
the trainer behind the interface the report reads; :mod:`.loop` the loop. Data, models, the LR
schedule, the run folder and the report are the torch job's own (:mod:`torch_backend.train.data`,
``.models``, ``.report``; :mod:`chunkzero.train_config`), so both engines train the same stream.
"""
