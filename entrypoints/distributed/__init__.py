"""`replayllm.entrypoints.distributed`: replay (and capture, diff) a trace set on several engine replicas with Ray."""

from .options import ScaleOut
from .replay import ReplayResult, replay

__all__ = ["ReplayResult", "ScaleOut", "replay"]
