"""Run under ``torchrun --nproc_per_node 2`` with ``argv[1:4]`` the Ray cluster's address,
a namespace and the name of a ``RayReplayBuffer`` actor another process made: every rank
attaches to that one actor, trains a real SFTTrainer for one epoch pass from it, and
writes what it received to ``argv[4].rank<r>.json``."""

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from online_dist_common import train_one_pass  # noqa: E402
from torchrl_trl.online.ray import connect_ray_replay_buffer  # noqa: E402

if __name__ == "__main__":
    import ray
    address, namespace, name, out = sys.argv[1:5]
    rank = int(os.environ["RANK"])
    rb = connect_ray_replay_buffer(name, address=address, namespace=namespace, timeout=30,
                                   ray_init_config={"log_to_driver": False})
    result = train_one_pass(rb, out)
    result.update({"type": type(rb).__name__, "ray_connected": ray.is_initialized()})
    rb.close()  # detaches; this process started its Ray connection, so it leaves Ray too
    result["ray_left"] = not ray.is_initialized()
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(result, f)
    torch.distributed.destroy_process_group() if torch.distributed.is_initialized() else None
