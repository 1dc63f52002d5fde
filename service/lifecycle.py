"""The server's lifecycle, read by both doors: warming up (compiling) → serving → draining (after SIGTERM)."""
from __future__ import annotations

import enum


class ServingState(enum.Enum):
    WARMING_UP = "warming up"
    SERVING = "serving"
    DRAINING = "draining"
