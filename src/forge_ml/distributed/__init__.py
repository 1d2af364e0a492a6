"""Training on several GPUs (and machines): communicators, data parallelism with gradient
buckets, ZeRO-1, launching and the data-parallel trainer.

- ``comm``: ``Communicator`` (all_reduce, reduce_scatter, all_gather, broadcast, barrier),
  ``ThreadCommunicator`` (ranks as threads: the tests), ``NcclCommunicator`` (one process per
  GPU through CuPy's NCCL: real runs);
- ``launch``: ``threads(n, fn)``, ``spawn(n, argv)`` (``forge-ml train --gpus N``),
  ``init_process_group()`` (torchrun / mpirun / spawn environment -> NCCL), ``TCPStore``;
- ``buckets``: the flat bucketed layout (``Buckets``) and ``FlatBuffer``;
- ``ddp``: ``DataParallel`` (the step) and ``rank_batches`` (each rank's micro-batches);
- ``zero``: ``ZeroAdamW``, the sharded optimizer (llm.c's zero.cuh design);
- ``trainer``: ``train(config, comm)``, ``DistributedTrainer`` (rank 0) and ``Worker``.

Layers: ``comm``, ``buckets``, ``zero`` and ``ddp`` sit above ``optim`` and ``models``;
``trainer`` sits above ``train`` (beside ``cli``). ``import forge_ml.distributed`` imports
neither CuPy nor the trainer.

>>> from forge_ml.distributed import launch
>>> launch.threads(2, lambda comm: comm.all_reduce_floats([comm.rank + 1])[0])
[3.0, 3.0]
"""
from .buckets import Buckets, FlatBuffer
from .comm import CommError, CommTimeout, Communicator, NcclCommunicator, ThreadCommunicator, ThreadGroup
from .ddp import DataParallel, rank_batches
from .launch import init_process_group, spawn, threads
from .zero import ZeroAdamW

__all__ = ["Communicator", "ThreadCommunicator", "ThreadGroup", "NcclCommunicator", "CommError",
           "CommTimeout", "Buckets", "FlatBuffer", "DataParallel", "rank_batches", "ZeroAdamW",
           "init_process_group", "spawn", "threads"]
