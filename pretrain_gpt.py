"""Pretrain GPT on megatron-core: Megatron-LM's pretrain_gpt.py, on Ascend NPUs, GPUs or the CPU.

    torchrun --nproc_per_node 8 pretrain_gpt.py <Megatron-LM's flags>

Same shape as Megatron-LM's script (model provider, dataset provider, forward step,
loss function); the trainer is megatron_npu.training. ``import megatron_npu`` first:
it patches megatron-core for the running target before anything else touches it.
"""

import sys
from functools import partial

# isort: off
import megatron_npu  # noqa: F401  (first: patches megatron-core for npu / cuda / cpu)

# isort: on
import torch
from megatron.core import parallel_state
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel

from megatron_npu.accelerator import get_accelerator
from megatron_npu.compat import get_batch_on_this_cp_rank  # megatron-core's, on every release
from megatron_npu.compat.core import mtp_on_this_rank
from megatron_npu.spec import gpt_model
from megatron_npu.training import get_args, get_timers, get_tokenizer, print_rank_0
from megatron_npu.training.config import transformer_config
from megatron_npu.training.data import build_datasets
from megatron_npu.training.loop import pretrain


def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None) -> GPTModel:
    """Build one GPT model chunk (the whole model without pipeline parallelism)."""
    args = get_args()
    print_rank_0("building GPT model ...")
    return gpt_model(args, args.padded_vocab_size, pre_process, post_process, vp_stage)


def get_batch(data_iterator):
    """The next micro-batch on the device; all None for chunks that read no data."""
    if data_iterator is None:
        return None, None, None, None, None
    batch = next(data_iterator)
    device = get_accelerator().device()
    tokens = batch["tokens"].to(device, non_blocking=True)
    labels = batch["labels"].to(device, non_blocking=True)
    loss_mask = batch["loss_mask"].to(device, non_blocking=True)
    position_ids = batch["position_ids"].to(device, non_blocking=True)
    attention_mask = batch["attention_mask"].to(device, non_blocking=True) if "attention_mask" in batch else None
    # context parallel: this rank's 2 of the sequence's 2 x CP chunks (megatron-core's load-balanced order)
    local = get_batch_on_this_cp_rank(
        {
            "tokens": tokens,
            "labels": labels,
            "loss_mask": loss_mask,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
        }
    )
    tokens, labels, loss_mask = local["tokens"], local["labels"], local["loss_mask"]
    attention_mask, position_ids = local["attention_mask"], local["position_ids"]
    if not parallel_state.is_pipeline_first_stage() and not _mtp_here():
        tokens = position_ids = None  # a last-stage chunk needs labels and the mask (MTP: the tokens too)
    return tokens, labels, loss_mask, attention_mask, position_ids


def _mtp_here() -> bool:
    """Multi-token prediction embeds the shifted tokens on the chunk that holds its layers."""
    args = get_args()
    return bool(args.mtp_num_layers) and mtp_on_this_rank(transformer_config(args))


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron-LM's form: the summed loss of the unmasked tokens and their count.

    megatron-core divides by the micro-batch's count, or with --calculate-per-token-loss by
    the whole global batch's; the report [sum, count] is averaged over the tokens of the
    global batch."""
    losses = output_tensor.float().view(-1)
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    report = torch.cat([loss.clone().detach().view(1), num_tokens.float().view(1)])
    return loss, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model: GPTModel):
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
    timers("batch-generator").stop()
    # loss_mask: multi-token prediction masks its own losses with it (as Megatron-LM passes it)
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output_tensor, partial(loss_func, loss_mask)


def train_valid_test_datasets_provider(train_val_test_num_samples: list[int]):
    args = get_args()
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    return build_datasets(args.data, args.init.seed, get_tokenizer(), train_val_test_num_samples)


if __name__ == "__main__":  # the guard matters: dist-checkpointing starts a spawn context
    sys.exit(
        pretrain(
            train_valid_test_datasets_provider,
            model_provider,
            ModelType.encoder_or_decoder,
            forward_step,
        )
    )
