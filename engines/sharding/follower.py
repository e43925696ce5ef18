"""``python -m engines.sharding.follower --model PATH``: one follower rank of a sharded role.

The ring comes from ``MLX_HOSTFILE``/``MLX_RANK`` (as ``mlx.launch`` sets
them); ``mlxcel-server --shard-ranks N`` starts ranks 1..N-1 this way with
``--parent-pid``, so a follower never outlives the node that started it.
The process ends when the leader's engine closes.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time

from engines.sharding.group import ring_group_from_env
from engines.sharding.ranks import follow

log = logging.getLogger(__name__)
PARENT_POLL_S = 1.0


def _exit_with_parent(parent_pid: int) -> None:
    """A local follower blocked in a collective would wait forever for a leader killed -9."""
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    log.warning("the node that started this rank is gone; exiting")
    os._exit(1)  # the main thread may be inside a collective that never returns


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engines.sharding.follower")
    parser.add_argument("--model", required=True, help="the checkpoint the leader serves")
    parser.add_argument("--parent-pid", type=int, help="exit when this process is gone")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: "
                        "%(message)s")
    if args.parent_pid:
        threading.Thread(target=_exit_with_parent, args=(args.parent_pid,), daemon=True).start()
    group = ring_group_from_env()
    if group is None:
        print("engines.sharding.follower: MLX_HOSTFILE must name a ring of 2+ ranks",
              file=sys.stderr)
        return 2
    log.info("shard rank %d of %d: following rank 0", group.rank(), group.size())
    follow(args.model, group)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
