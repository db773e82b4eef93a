"""One rank of tests/test_distributed.py: trains a tiny FAT5 under PyTorch FSDP2 and under DeepSpeed ZeRO-3 on gloo
(CPU), and generates with synced_gpus=True and a different output length on each rank.

    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node 2 tests/distributed_worker.py OUT_DIR

Writes OUT_DIR/rank{R}.json. The model, data and reference computation are shared with the test (`tiny_model`,
`batch`, `reference_run`), so the single-process run there computes exactly what the two ranks compute together.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from conftest import tiny_config
from fat5 import FAT5ForConditionalGeneration

STEPS = 3
LR = 1e-2
WORLD = 2
DS_CONFIG = Path(__file__).resolve().parent.parent / "fat5" / "recipes" / "configs" / "ds_zero3_bf16.json"
# Rank r generates NEW_TOKENS[r] tokens from PROMPTS[r]: different lengths, so without synced_gpus the rank that
# finishes first would stop joining the parameter all-gathers and the other would hang.
PROMPTS = [[5, 9, 14, 1], [7, 3, 22, 31, 17, 8, 1]]
NEW_TOKENS = [2, 7]


def tiny_model():
    torch.manual_seed(0)
    return FAT5ForConditionalGeneration(tiny_config(vocab_size=64, decoder_start_token_id=0, attention_backend="sdpa"))


def batch(rank):
    """Rank `rank`'s half of a fixed batch: ragged inputs and labels (padding masked, labels -100)."""
    generator = torch.Generator().manual_seed(1 + rank)
    input_ids = torch.randint(3, 64, (2, 9), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 5 + rank:] = 0
    input_ids[attention_mask == 0] = 0
    labels = torch.randint(3, 64, (2, 6), generator=generator)
    labels[0, 3 + rank:] = -100
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)


def reference_run():
    """One process, both halves: the loss is the mean of the halves' losses, as data parallelism averages
    gradients over ranks. Returns the losses and the greedy generations of the untrained model."""
    model = tiny_model()
    generated = [generate(model, rank) for rank in range(WORLD)]
    opt = optimizer(model)
    losses = []
    for _ in range(STEPS):
        loss = sum(model(**batch(rank)).loss for rank in range(WORLD)) / WORLD
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, generated


def generate(model, rank, **kwargs):
    inputs = torch.tensor([PROMPTS[rank]])
    with torch.no_grad():
        # min_new_tokens: the length is fixed whatever the random model predicts.
        output = model.generate(input_ids=inputs, max_new_tokens=NEW_TOKENS[rank], min_new_tokens=NEW_TOKENS[rank],
                                do_sample=False, num_beams=1, **kwargs)
    return output[0].tolist()


def mean_over_ranks(value):
    value = value.detach().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def fsdp2_run(rank):
    from torch.distributed.fsdp import fully_shard

    from fat5.modeling_fat5 import FAT5Block

    model = tiny_model()
    for module in model.modules():
        if isinstance(module, FAT5Block):
            fully_shard(module)
    fully_shard(model)
    model.eval()
    with torch.no_grad():
        model(**batch(rank))  # FSDP2 sets up its root at the first forward of the root module
    # generate() calls the encoder directly, outside the root's forward: gather the root's own parameters first.
    model.unshard()
    generated = generate(model, rank, synced_gpus=True)
    model.reshard()
    model.train()
    opt = optimizer(model)
    losses = []
    for _ in range(STEPS):
        loss = model(**batch(rank)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(mean_over_ranks(loss))
    return losses, generated


def deepspeed_config():
    """The shipped ZeRO-3 config with its "auto" values filled as the Trainer would, in fp32 (CPU, and an exact
    comparison), with the optimizer given by the caller instead of DeepSpeed's compiled one."""
    config = json.loads(DS_CONFIG.read_text())
    for key in ("optimizer", "scheduler"):
        config.pop(key)
    config["bf16"] = {"enabled": False}
    config.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1, train_batch_size=2 * WORLD,
                  gradient_clipping=0.0, zero_allow_untested_optimizer=True, steps_per_print=10**6)
    zero = config["zero_optimization"]
    zero.update(reduce_bucket_size=32 * 32, stage3_prefetch_bucket_size=32 * 32,
                stage3_param_persistence_threshold=0)
    assert "auto" not in json.dumps(config)
    return config


def deepspeed_run(rank):
    import deepspeed

    model = tiny_model()
    engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=optimizer(model), config=deepspeed_config())
    assert engine.zero_optimization_stage() == 3
    # ZeRO-3 really partitions: this rank holds about half of each large tensor.
    shared = engine.module.shared.weight
    assert shared.ds_tensor.numel() <= shared.ds_numel // WORLD + 1
    engine.eval()
    generated = generate(engine.module, rank, synced_gpus=True)
    engine.train()
    losses = []
    for _ in range(STEPS):
        loss = engine(**batch(rank)).loss
        engine.backward(loss)
        engine.step()
        losses.append(mean_over_ranks(loss))
    return losses, generated


def main(out_dir):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    result = {}
    engines = {"fsdp2": fsdp2_run, "deepspeed": deepspeed_run}
    for name in sys.argv[2].split(",") if len(sys.argv) > 2 else engines:
        run = engines[name]
        losses, generated = run(rank)
        result[name] = {"losses": losses, "generated": generated}
        dist.barrier()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
