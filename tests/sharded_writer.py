"""Writes a checkpoint the way a torch.distributed trainer does: `python sharded_writer.py OUT WORLD`.

WORLD processes (gloo, CPU) each torch.save `OUT/model.<rank>.pth` = {"model_state_dict": ...,
"optimizer_state_dict": {}} holding a row-sharded table `table.weight` [10, 4] (a ShardedTensor,
rows split between the ranks; values = arange) and a replicated dense `dense.weight` [2, 3].
Run by tests/test_importers.py in a subprocess, so the process group never touches the test process.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROWS, COLUMNS = 10, 4


def table() -> torch.Tensor:
    return torch.arange(ROWS * COLUMNS, dtype=torch.float32).reshape(ROWS, COLUMNS)


def write(rank: int, world: int, out: str, port: str) -> None:
    from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata, init_from_local_shards

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    bounds = [ROWS * r // world for r in range(world + 1)]
    first, last = bounds[rank], bounds[rank + 1]
    shard = Shard(table()[first:last].clone(), ShardMetadata([first, 0], [last - first, COLUMNS], f"rank:{rank}/cpu"))
    sharded = init_from_local_shards([shard], [ROWS, COLUMNS])
    state = {"table.weight": sharded, "dense.weight": torch.full((2, 3), 0.5)}
    torch.save({"model_state_dict": state, "optimizer_state_dict": {}}, os.path.join(out, f"model.{rank}.pth"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    out, world, port = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    mp.spawn(write, args=(world, out, port), nprocs=world)
