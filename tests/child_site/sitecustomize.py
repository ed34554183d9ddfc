"""Loaded at start-up by every Python process the tests start (conftest puts this folder on
``PYTHONPATH``), and by conftest itself: the test processes share one persistent compilation
cache, so each of them must write its entries atomically."""

import os


def write_cache_entries_atomically() -> None:
  """JAX's file cache writes an entry in place (``Path.write_bytes``) unless its size cap is
  set, which turns on a lock that scans the whole directory at every write: a process reading
  an entry another process is writing loads half an executable and crashes in native code
  (segfaults in ``compilation_cache.get_executable_and_time``). Write each entry beside its
  place and rename it there: readers see it whole or not at all."""
  from jax._src import lru_cache

  if getattr(lru_cache.LRUCache.put, "writes_atomically", False):
    return
  original = lru_cache.LRUCache.put

  def put(self, key: str, value: bytes) -> None:
    if self.eviction_enabled:
      return original(self, key, value)
    path = self.path / f"{key}{lru_cache._CACHE_SUFFIX}"
    if path.exists():
      return None
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    partial.write_bytes(value)
    os.replace(partial, path)
    return None

  put.writes_atomically = True
  lru_cache.LRUCache.put = put


if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
  write_cache_entries_atomically()
