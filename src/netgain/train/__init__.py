"""`netgain train`: data-parallel training with a gradient codec on a DDP communication hook.

Spawns `--world-size` local gloo workers, or runs as one rank when launched by torchrun (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT set; nccl when CUDA is available). Every batch is a pure
function of (seed, step, rank), so a run resumed from a checkpoint equals a straight run.

With --fsdp the model is fully_shard-ed (FSDP2) over the "shard" dimension of a (replicate, shard)
DeviceMesh of --replicas x --shards ranks, and the codec carries the all-reduce across replicas
(netgain.comm.fsdp); its checkpoints are torch.distributed.checkpoint folders.

With --sync the model is not wrapped in DDP: each rank steps alone, and netgain.sync averages the
pseudo-gradients in a summable code every --sync-period steps (its state is the checkpoint's comm state).

One module per job: cli (options and their checks, into a config.TrainConfig), launch (workers and
signals), loop (one worker's training, the Trainer), tasks (model and batches), checkpoints (read and
checked), report (rank 0's summary, record and plots).
"""

from netgain.train.cli import configure, run

__all__ = ["configure", "run"]
