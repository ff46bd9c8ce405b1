"""Run by tests/test_distributed.py under torch.distributed.run: one MARS training step with FSDP2-sharded parameters.

Each rank takes its half of a global batch of 4, computes MARSTrainer's loss on the sharded model (the count for
normalisation taken over both ranks, as Trainer does), backpropagates (FSDP2 reduce-scatters the gradients), takes
one SGD step and writes the gathered full weights for the test to compare with one process on the whole batch.
"""

import sys

import torch
import torch.distributed as dist
from datasets import Dataset
from safetensors.torch import save_file
from torch.distributed.fsdp import fully_shard

from hf_mars import MARSConfig, MARSTrainer
from hf_mars.testing_utils import build_char_tokenizer, tiny_qwen2

ROWS = [{"prompt": f"copy {w} ->", "completion": f" {w} {w}"} for w in ("abc", "hello", "moon", "xyz")]


def trainer_for(out_dir, normalization):
    tok = build_char_tokenizer()
    model = tiny_qwen2(tok, seed=0)
    args = MARSConfig(output_dir=out_dir, per_device_train_batch_size=4, max_steps=1, report_to=[],
                      save_strategy="no", dataloader_num_workers=0, loss_normalization=normalization, use_cpu=True)
    return MARSTrainer(model, args=args, train_dataset=Dataset.from_list(ROWS), processing_class=tok)


def one_step(trainer, model, batch, count):
    model.train()
    loss = trainer.compute_loss(model, batch, num_items_in_batch=count)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 1.0 * p.grad
    return float(loss)


def main(out_dir, normalization):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    trainer, single = trainer_for(out_dir, normalization), trainer_for(out_dir, normalization)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])  # the global batch, same on each rank
    # the reference: one process, the whole batch (run on every rank: the trainer's metric gather is collective).
    # compute_loss multiplies by the world size to undo gradient averaging; dividing by total * world undoes it here
    total = float(single._count_items(batch))
    one_step(single, single.model, batch, torch.tensor(total * world))
    # the same step sharded: each rank its half, the count over both halves (as Trainer gathers it)
    half = {k: v[2 * rank:2 * rank + 2] for k, v in batch.items()}
    count = torch.tensor(float(trainer._count_items(half)))
    dist.all_reduce(count)
    assert float(count) == total
    model = trainer.model
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    one_step(trainer, model, half, count)
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}
    if rank == 0:
        save_file(full, f"{out_dir}/sharded.safetensors")
        save_file({k: v.detach().clone() for k, v in single.model.state_dict().items()},
                  f"{out_dir}/single.safetensors")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
