"""The training samples: Megatron's GPTDataset over the bundled dataset, the sample order
gpt_pretrain uses (megatorch's data::GPTDataset equals megatron-core's sample for sample,
tests/python/unit/test_data_megatron.py), and the micro-batches each rank takes.

Built once per benchmark run by prepare.py (megatron-core is in the project's venv) and
saved as an int64 array [train_iters * global_batch, seq + 1]; every peer reads that file.
"""
import warnings

import numpy as np
import torch

from config import BenchConfig


class _ByteTokenizer:
    """What GPTDataset needs of a tokenizer (byte-level ids 0-255, end of document 256)."""
    eod = 256
    vocab_size = 257
    unique_identifiers = {"class": "ByteLevel"}


def build_train_samples(cfg: BenchConfig, cache_dir: str) -> np.ndarray:
    """The first train_iters * global_batch samples of the train split, as gpt_pretrain
    sizes it (num_samples = train_iters * global_batch; the order depends on that size)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
        from megatron.core.datasets.utils import get_blend_from_list
    n = cfg.train_iters * cfg.global_batch_size
    config = GPTDatasetConfig(random_seed=cfg.seed, sequence_length=cfg.seq_length,
                              blend=get_blend_from_list([cfg.data_path]), split=cfg.split,
                              tokenizer=_ByteTokenizer(), reset_position_ids=False, reset_attention_mask=False,
                              eod_mask_loss=False, create_attention_mask=False,
                              path_to_cache=cache_dir)  # not next to the data, inside the repo
    train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [n, None, None], lambda: True, config).build()
    out = np.empty((n, cfg.seq_length + 1), dtype=np.int64)
    for i in range(n):
        item = train[i]
        out[i] = torch.cat([item["tokens"], item["labels"][-1:]]).numpy()
    return out


def micro_batches(samples: np.ndarray, cfg: BenchConfig, step: int, dp_rank: int, dp: int):
    """This DP rank's micro-batches of step `step` (0-based), as megatorch's trainer and
    Megatron's sampler take them: micro-batch k of the step is samples
    [step*G + k*b*dp + dp_rank*b, +b). Returns [(ids [b, s], labels [b, s])]. A step past
    the samples (the extra, profiled step of train_loop.run) takes the first batch again."""
    b, g = cfg.micro_batch_size, cfg.global_batch_size
    step %= len(samples) // g
    out = []
    for k in range(g // (b * dp)):
        first = step * g + k * b * dp + dp_rank * b
        tokens = torch.from_numpy(samples[first:first + b])
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out
