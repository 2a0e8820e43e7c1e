"""KVCacheManager: the eager user's handle on one model's cache runtime."""

from __future__ import annotations

import torch

from kvexport.config import Config
from kvexport.ops import wrappers


class KVCacheManager:
    """Lookup, stats, reset and eviction for the runtime named `runtime_name` (default: the config's name)."""

    def __init__(self, config: Config, runtime_name: str | None = None, device: torch.device | str = "cpu"):
        self.config = config
        self.name = runtime_name or config.name
        wrappers.create_runtime(self.name, config.runtime_json(), device)

    def stats(self) -> dict[str, int]:
        return wrappers.runtime_stats(self.name)

    def reset(self) -> None:
        wrappers.reset_runtime(self.name)

    def evict_user(self, user_id: int) -> bool:
        return wrappers.evict_user(self.name, user_id)

    def cached_length(self, user_id: int) -> int:
        return wrappers.cached_length(self.name, user_id)

    def device_users_lru(self) -> list[int]:
        return wrappers.device_users_lru(self.name)

    def read_user_kv(self, user_id: int) -> torch.Tensor:
        return wrappers.read_user_kv(self.name, user_id)

    def close(self) -> None:
        """Drops the runtime; a later request creates a fresh one."""
        wrappers.drop_runtime(self.name)
