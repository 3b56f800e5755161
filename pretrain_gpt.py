"""Train a GPT with Megatron-LM's own loop (``megatron.training.pretrain``) and Adacc.

    python pretrain_gpt.py --config configs/tiny-cpu.yaml
    torchrun --nproc_per_node 2 pretrain_gpt.py <Megatron-LM's flags> \
        --transformer-impl local --adacc-policy auto --adacc-memory-budget 2GiB

Every Megatron-LM flag works as in Megatron-LM; ``--config FILE`` reads flags from YAML
(keys are flag names). Without data flags it trains on the built-in corpus.

Exit status: 0 trained, 1 the run diverged, 2 bad input (one line on stderr), 130
interrupted (Ctrl-C; 143 on SIGTERM).
"""
from __future__ import annotations

import contextlib
import sys

PROG = "pretrain_gpt.py"


def datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Megatron-LM's dataset provider: GPTDatasets over the flags' blend (mock or FIM data)."""
    from megatron.core import mpu
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder)
    from megatron.training import get_args

    dataset_type, config = _dataset_type_and_config(get_args())
    return BlendedMegatronDatasetBuilder(
        dataset_type, train_val_test_num_samples,
        lambda: mpu.get_tensor_model_parallel_rank() == 0, config).build()


def _dataset_type_and_config(args):
    """The dataset class and its config, each field from its Megatron-LM flag.

    Mock data wins over ``--fim-data``, as in Megatron-LM's pretrain_gpt.py."""
    import json

    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.training import get_tokenizer
    from megatron.training.utils import get_blend_and_blend_per_split

    blend, blend_per_split = get_blend_and_blend_per_split(args)
    sequences_per_dataset = None
    if args.per_dataset_sequences_path is not None:
        with open(args.per_dataset_sequences_path) as file:
            sequences_per_dataset = json.load(file)
    options = dict(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend,
        blend_per_split=blend_per_split, split=args.split,
        multiple_validation_sets=args.multiple_validation_sets,
        full_validation=args.full_validation,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path, mmap_bin_files=args.mmap_bin_files,
        tokenizer=get_tokenizer(), reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        object_storage_cache_path=args.object_storage_cache_path,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
        allow_ambiguous_pad_tokens=args.allow_ambiguous_pad_tokens,
        fast_cache_load=args.dataloader_fast_cache_load,
        sequences_per_dataset=sequences_per_dataset,
        defer_npy_index_mmap=args.dataloader_defer_npy_index_mmap,
        context_parallel_size=args.context_parallel_size,
        data_parallel_size=args.data_parallel_size,
        sequence_parallel_size=args.tensor_model_parallel_size * args.sequence_parallel,
        hybrid_context_parallel=args.hybrid_context_parallel,
        inter_document_masking=args.dataloader_inter_document_masking)
    if not args.fim_data:
        with _flag_checks():
            config = GPTDatasetConfig(**options)
        return (MockGPTDataset if args.mock_data else GPTDataset), config
    from megatron.training.datasets.fim_dataset import GPTFIMDataset, GPTFIMDatasetConfig

    tokens = {"prefix": args.fim_prefix_token, "middle": args.fim_middle_token,
              "suffix": args.fim_suffix_token, "pad": args.fim_pad_token,
              "eod": args.fim_eod_token}
    try:  # as GPTFIMDataset reads them, once it has built its indices
        if args.tokenizer_type == "NullTokenizer":  # ids without text: FIM detokenizes
            raise ValueError
        options["tokenizer"]._tokenizer.tokens_to_ids(list(tokens.values()))
    except (ValueError, KeyError, TypeError):
        from megatron_adacc import megatron_lm

        raise megatron_lm.ConfigError(
            f"--fim-data: the {args.tokenizer_type} tokenizer has no ids for the FIM tokens "
            f"{', '.join(tokens.values())}; use a text tokenizer that has them, or name its "
            f"own with --fim-prefix-token and the like") from None
    with _flag_checks():
        config = GPTFIMDatasetConfig(
            **options, fim_rate=args.fim_rate, fim_spm_rate=args.fim_spm_rate,
            fim_extra_tokens=tokens, fim_split_sample=args.fim_split_sample,
            fim_fragment_rate=args.fim_fragment_rate, fim_no_prefix=args.fim_no_prefix)
    return (MockGPTDataset if args.mock_data else GPTFIMDataset), config


datasets_provider.is_distributed = True


def forward_step(data_iterator, model):
    """One micro-batch through the model; the loss is Megatron-LM's masked token sum."""
    import torch

    batch = get_batch(data_iterator)
    output = model(batch.get("tokens"), batch.get("position_ids"), batch.get("attention_mask"),
                   labels=batch.get("labels"))
    loss_mask = batch.get("loss_mask")

    def loss_func(per_token):
        losses = per_token.view(-1).float()
        mask = loss_mask.view(-1).float()
        loss = torch.sum(losses * mask)
        num_tokens = mask.sum().clone().detach().to(torch.int)
        _validate(loss)
        return loss, num_tokens, {"lm loss": torch.cat([loss.detach().view(1),
                                                        num_tokens.view(1)])}

    return output, loss_func


# Megatron-LM's pretrain_gpt.py: a loss this many times the largest seen so far is spiky.
SPIKY_LOSS_FACTOR = 10


def _validate(loss) -> None:
    """This rank's loss through Megatron-LM's result checks, as its own pretrain_gpt.py does.

    So ``--check-for-nan-in-loss-and-grad`` checks the loss before the data-parallel all-reduce,
    ``--check-for-spiky-loss`` the spikes, and ``--rerun-mode`` reruns what they reject."""
    import functools

    import torch
    from megatron.core.rerun_state_machine import get_rerun_state_machine
    from megatron.training import get_args

    args, machine = get_args(), get_rerun_state_machine()
    checks = []
    if args.check_for_nan_in_loss_and_grad:
        checks += [(torch.isnan, "found NaN in local forward loss calculation", True),
                   (torch.isinf, "found Inf in local forward loss calculation", True)]
    if args.check_for_spiky_loss:
        checks.append((functools.partial(machine.is_unexpectedly_large,
                                         threshold=SPIKY_LOSS_FACTOR, context="loss"),
                       "Spiky loss", False))
    for rejects, message, fatal in checks:  # the forward pass is deterministic: no tolerance
        machine.validate_result(result=loss, rejection_func=rejects, message=message,
                                tolerance=0.0, fatal=fatal)


def get_batch(data_iterator) -> dict:
    """This rank's micro-batch, as Megatron-LM's ``get_batch`` gives it.

    It is read on the tensor-parallel group's first rank and shared with the others. It holds
    only the fields this pipeline stage reads: the first stage its inputs, the last its labels
    and loss mask."""
    import torch
    from megatron.core import mpu
    from megatron.core.utils import get_batch_on_this_tp_rank
    from megatron.training import get_args

    args = get_args()
    first, last = mpu.is_pipeline_first_stage(), mpu.is_pipeline_last_stage()
    if not (first or last):  # megatron_lm.check_args refuses multi-token prediction
        return {}
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch = next(data_iterator) if tp_rank == 0 else {}
    if not torch.cuda.is_available():
        return _batch_on_host(batch, first, last, args.pipeline_model_parallel_size > 1)
    batch = {key: value.cuda(non_blocking=True) if torch.is_tensor(value) else value
             for key, value in batch.items()}
    return get_batch_on_this_tp_rank(
        batch, has_cu_seqlens=False, is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(),
        cp_size=args.context_parallel_size, tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size, seq_length=args.seq_length,
        mtp_on_this_rank=False, pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=first, is_pipeline_last_stage=last)


def _batch_on_host(batch: dict, first: bool, last: bool, pipelined: bool) -> dict:
    """get_batch_on_this_tp_rank on a host (gloo): rank 0's micro-batch on every rank of its group.

    It is copied as a GPU copies it to the device. So what the model saves for backward is the
    step's own, never the loader's tensors, which Megatron-LM's rerun state machine keeps for the
    whole step."""
    import torch
    import torch.distributed as dist
    from megatron.core import mpu

    if mpu.get_tensor_model_parallel_world_size() > 1:
        payload = [batch if mpu.get_tensor_model_parallel_rank() == 0 else None]
        dist.broadcast_object_list(payload, src=mpu.get_tensor_model_parallel_src_rank(),
                                   group=mpu.get_tensor_model_parallel_group())
        batch = payload[0]
    unread = ({"labels", "loss_mask"} if not last else set()) | (
        {"tokens", "position_ids"} if not first else set()) if pipelined else set()
    return {key: value.clone() if torch.is_tensor(value) and key not in unread else None
            for key, value in batch.items()}


def main(argv: list[str] | None = None) -> int:
    """Run Megatron-LM's ``pretrain`` with Adacc on ``argv``; returns the exit status."""
    from megatron_adacc import launch, megatron_compat

    megatron_compat.quiet_missing_kernel_notices()

    return launch.run(sys.argv[1:] if argv is None else argv, PROG, _pretrain)


def _pretrain(args) -> None:
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import (gpt_config_from_args,
                                                  pretrain_cfg_container_from_args)

    from megatron_adacc import megatron_lm

    packed = "--sft" if args.sft else "--dataloader-inter-document-masking" if (
        args.dataloader_inter_document_masking) else None
    if packed:  # Megatron-LM's get_batch then carries cu_seqlens, which forward_step drops
        raise megatron_lm.ConfigError(f"{packed} trains on packed sequences, which this "
                                      f"pretrain_gpt.py does not feed the model yet")
    with _flag_checks():
        model_cfg = gpt_config_from_args(args)
    megatron_lm.install(model_cfg, args)
    with _flag_checks():
        full_config = pretrain_cfg_container_from_args(args, model_cfg)
    pretrain(full_config, datasets_provider, ModelType.encoder_or_decoder, forward_step)


@contextlib.contextmanager
def _flag_checks():
    """megatron-core's config checks within it (assertions, ValueErrors) are bad flags."""
    from megatron_adacc import launch, megatron_lm

    try:
        yield
    except (AssertionError, ValueError) as exc:
        raise megatron_lm.ConfigError(launch.assertion_line(exc)) from None


if __name__ == "__main__":
    sys.exit(main())
