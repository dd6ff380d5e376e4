"""Communication accounting (bytes = the payload a rank hands to each collective)."""
from typing import Dict, Optional

import torch


def comm_stats(group_name: str) -> Dict[str, Dict[str, int]]:
    """Counters of one group: ``{op: {"calls": n, "bytes": n}}`` for every operation
    (all_reduce, all_gather, reduce_scatter, broadcast, send, recv, barrier,
    all_to_all) and "total".
    """
    flat = torch.ops.megatorch.comm_stats(group_name)
    out: Dict[str, Dict[str, int]] = {}
    for key, value in flat.items():
        op, field = key.rsplit(".", 1)
        out.setdefault(op, {})[field] = value
    return out


def reset_comm_stats(group_name: Optional[str] = None) -> None:
    """Zero one group's counters, or every group's."""
    torch.ops.megatorch.reset_comm_stats(group_name)
