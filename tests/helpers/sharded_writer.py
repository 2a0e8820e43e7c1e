"""Writes a checkpoint the way a torch.distributed trainer does: `python sharded_writer.py FORMAT OUT WORLD PORT`.

WORLD processes (gloo, CPU), each holding its rows of a row-sharded table (a ShardedTensor):
- FORMAT `torch_save` (NVIDIA recsys-examples' `.pth`): each rank torch.saves `OUT/model.<rank>.pth` =
  {"model_state_dict": ..., "optimizer_state_dict": {}} with `table.weight` [10, 4] (float32,
  values = arange) sharded, and a replicated dense `dense.weight` [2, 3].
- FORMAT `dcp` (Meta's `sparse/`): torch.distributed.checkpoint.save of one state dict into OUT:
  `sparse_dict._embedding_collection.embeddings.items.weight` [10, 4] (float16, arange / 8)
  sharded, `...embeddings.actions.weight` [3, 4] (float16) held whole by every rank (saved once),
  and a step counter (an int: saved as pickled bytes).
Run by the tests in a subprocess, so the process group never touches the test process.
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WRITER = Path(__file__)  # the script the tests run: python WRITER FORMAT OUT WORLD PORT
ROWS, COLUMNS = 10, 4
PREFIX = "sparse_dict._embedding_collection.embeddings."


def table() -> torch.Tensor:
    return torch.arange(ROWS * COLUMNS, dtype=torch.float32).reshape(ROWS, COLUMNS)


def items() -> torch.Tensor:
    return (table() / 8).half()


def actions() -> torch.Tensor:
    return torch.linspace(-1, 1, 12).reshape(3, 4).half()


def write(rank: int, world: int, form: str, out: str, port: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata, init_from_local_shards

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    bounds = [ROWS * r // world for r in range(world + 1)]
    first, last = bounds[rank], bounds[rank + 1]
    whole = table() if form == "torch_save" else items()
    shard = Shard(whole[first:last].clone(), ShardMetadata([first, 0], [last - first, COLUMNS], f"rank:{rank}/cpu"))
    sharded = init_from_local_shards([shard], [ROWS, COLUMNS])
    if form == "torch_save":
        state = {"table.weight": sharded, "dense.weight": torch.full((2, 3), 0.5)}
        torch.save({"model_state_dict": state, "optimizer_state_dict": {}}, os.path.join(out, f"model.{rank}.pth"))
    else:
        dcp.save({PREFIX + "items.weight": sharded, PREFIX + "actions.weight": actions(), "step": 7}, checkpoint_id=out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    form, out, world, port = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    mp.spawn(write, args=(world, form, out, port), nprocs=world)
