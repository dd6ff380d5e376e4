"""One rank of test_plan_cli_moe.py's MoE activation test at expert tensor parallelism 2.

Run under torchrun (2 ranks, gloo): every rank builds the MoE layers of test_plan_cli_moe's
MOE_VARIANTS x MOE_SETTINGS with expert_tensor_parallel_group = the world, runs each on
its own random tokens and writes what the layer saved for backward (bytes, storages) and
its expert shards' shapes to <out_dir>/rank<r>.json.

    torchrun --standalone --nproc-per-node=2 tests/python/unit/moe_etp_activations_worker.py OUT_DIR
"""
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import test_plan_cli_moe as t  # noqa: E402  (the layers and the measurement the ETP-1 test uses)


def main(out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.group.WORLD
    results = {}
    for variant in t.MOE_VARIANTS:
        for setting in t.MOE_SETTINGS:
            torch.manual_seed(100 + rank)  # each rank its own tokens (the layer's weights: config.seed)
            config = t._moe_config(setting, *variant, expert_tensor_parallel_group=world)
            saved, layer = t._moe_layer_saved(config, torch.float32)
            params = dict(layer.named_parameters())
            results[f"{variant} {setting}"] = dict(
                bytes=saved.bytes, storages=saved.storages,
                fc1_weight=list(params["mlp.experts.fc1_weight"].shape),
                fc2_weight=list(params["mlp.experts.fc2_weight"].shape))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
