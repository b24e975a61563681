"""ScaleOut: the data-parallel options (replicas, Ray address, shard size), validated, and the Ray import."""

from __future__ import annotations

import re
from dataclasses import dataclass

RAY_INSTALL_HINT = "pip install 'replayllm[ray]'"
# `--ray-address`: "auto" (a cluster started on this node with `ray start --head`) or HOST:PORT of its head.
_ADDRESS = re.compile(r"^(auto|local|ray://[^\s]+|[A-Za-z0-9_.\-\[\]:]+:\d+)$")


@dataclass(frozen=True)
class ScaleOut:
    """How a trace set is spread over replicas.

    data_parallel_size: engine replicas (Ray actors, each holding one engine of tensor_parallel_size GPUs).
    ray_address: the Ray cluster to join ("auto", "HOST:PORT", "ray://HOST:PORT"); None: the Ray session this
    process already has, else a local one started here. shard_size: requests per shard (one engine batch on
    one replica; the unit that is retried when a replica dies); None: min(max_num_seqs, ceil(requests / dp)).
    max_attempts: a shard whose replica died is run again on another one at most this many times in all.
    """

    data_parallel_size: int = 1
    ray_address: str | None = None
    shard_size: int | None = None
    max_attempts: int = 3

    def __post_init__(self):
        for name in ("data_parallel_size", "max_attempts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.shard_size is not None and (isinstance(self.shard_size, bool) or not isinstance(self.shard_size, int)
                                            or self.shard_size < 1):
            raise ValueError(f"shard_size must be an integer >= 1 or None, got {self.shard_size!r}")
        if self.ray_address is not None and (not isinstance(self.ray_address, str)
                                             or not _ADDRESS.match(self.ray_address)):
            raise ValueError(f"ray_address must be 'auto' or HOST:PORT (e.g. 10.0.0.1:6379), got {self.ray_address!r}")
        if self.uses_ray:
            import_ray()  # say how to install it before anything runs

    @property
    def uses_ray(self) -> bool:
        """False for one replica and no cluster named: the plain in-process engine, no Ray at all."""
        return self.data_parallel_size > 1 or self.ray_address is not None

    def shard_size_for(self, num_requests: int, max_num_seqs: int) -> int:
        if self.shard_size is not None:
            return self.shard_size
        return max(1, min(max_num_seqs, -(-num_requests // self.data_parallel_size)))


def import_ray():
    """The `ray` module, or a ValueError saying how to install it."""
    try:
        import ray
    except ImportError as e:
        raise ValueError("--data-parallel-size > 1 and --ray-address run replicas on Ray, which is not installed: "
                         f"{RAY_INSTALL_HINT} (or pip install ray)") from e
    return ray


def add_scale_out_args(parser, shard_size: bool = True) -> None:
    """`--data-parallel-size`, `--ray-address` (and `--shard-size`) on a subcommand."""
    parser.add_argument("--data-parallel-size", "-dp", type=int, default=1, metavar="N",
                        help="engine replicas, each a Ray actor holding one engine (default: 1, in-process, no Ray)")
    parser.add_argument("--ray-address", default=None, metavar="auto|HOST:PORT",
                        help="join this Ray cluster (default: the local one; started here if none is running)")
    if shard_size:
        parser.add_argument("--shard-size", type=int, default=None, metavar="N",
                            help="requests per shard (default: min(max_num_seqs, requests / replicas))")


def scale_out_from_args(args) -> ScaleOut:
    return ScaleOut(args.data_parallel_size, args.ray_address, getattr(args, "shard_size", None))
