"""Prefix-cache block keys: sha256 over the parent block's key, the block's token ids and the request's salt.

A key must identify a block's K/V exactly: two blocks with the same key share cached K/V, so a collision lets
one request read another's prompt (vLLM's CVE-2025-25183, where keys were Python's `hash()` of a tuple: a
64-bit hash with crafted collisions for small-int tuples, and deterministic under PYTHONHASHSEED). sha256 is
collision-resistant; vLLM's default `--prefix-caching-hash-algo` is sha256 too.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

BlockHash = bytes  # a 32-byte sha256 digest
ROOT = bytes(32)  # the parent of a request's first block when nothing salts its chain


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """sha256(parent's 32-byte key || len(token_ids) as 8 bytes || each id as 8 bytes), little-endian. The
    first block's parent is ROOT or the request's salt (`salted_root`), so a block's key covers its tokens,
    every token before it and the salt; fixed widths leave no two inputs with the same bytes."""
    n = len(token_ids)
    return hashlib.sha256(parent + struct.pack(f"<Q{n}q", n, *token_ids)).digest()


def salted_root(kind: bytes, value: np.ndarray) -> BlockHash:
    """A request's first parent key when something besides its tokens changes its K/V (forced MoE routes,
    `kind` b"trace_routed_experts"): sha256 over the kind, the array's dtype, shape and bytes. Never ROOT."""
    head = b"%b\0%b\0%b\0" % (kind, value.dtype.str.encode(), ",".join(map(str, value.shape)).encode())
    return hashlib.sha256(head + value.tobytes()).digest()  # tobytes: C order, whatever the strides


def salted_by(parent: BlockHash | None, salt: str) -> BlockHash:
    """vLLM's `cache_salt`: a request's first parent key (after any forced-routes seed `parent`) mixed with the salt,
    so only requests with the same salt share its prefix blocks (one tenant's cache unreadable to another)."""
    return hashlib.sha256(b"cache_salt\0" + (parent or ROOT) + salt.encode("utf-8", "surrogatepass")).digest()
