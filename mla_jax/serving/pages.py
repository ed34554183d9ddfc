"""Page bookkeeping on the host: free pages, reference counts, the prefix hash chain and LRU.

Pure Python over integers (no jax): the device pools (``mla_jax.paged_cache``) hold the rows,
this holds which page belongs to whom. A page is in exactly one of three states:

* **free**: on the free list, content meaningless;
* **in use**: referenced by one or more running sequences (``refcount > 0``);
* **cached**: unreferenced but holding a full page of a known prefix (its hash is registered),
  kept in LRU order and evicted (made free) only when a page is needed and none is free.

A full page is keyed by a hash chain: ``hash(parent key, its tokens)``, the root keyed by the
model and cache format (``salt``). Latent rows and indexer keys of a position depend only on the
tokens up to it, so a page with the same chain key holds the same rows in any request.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence


def pages_for(num_tokens: int, page_size: int) -> int:
  """Pages that hold ``num_tokens`` rows."""
  return -(-num_tokens // page_size)


class OutOfPages(RuntimeError):
  """No page is free and none can be evicted (the scheduler preempts before this happens)."""


def page_keys(tokens: Sequence[int], page_size: int, salt, start: int = 0,
              parent=None, stop: int | None = None) -> list:
  """Chain keys of the full pages of ``tokens`` from page ``start`` on, before page ``stop``
  (default: every full page; ``parent``: the key of page ``start - 1``, or None at the
  root). Only those pages' tokens are read."""
  keys, key = [], parent if start else (salt,)
  end = len(tokens) if stop is None else min(len(tokens), stop * page_size)
  for first in range(start * page_size, end - page_size + 1, page_size):
    key = hash((key, tuple(tokens[first:first + page_size])))
    keys.append(key)
  return keys


class PageTable:
  """``num_pages`` pages of ``page_size`` tokens: allocation, sharing and the prefix cache."""

  def __init__(self, num_pages: int, page_size: int, *, salt=None):
    self.num_pages, self.page_size, self.salt = num_pages, page_size, salt
    self._free = collections.deque(range(num_pages))
    self._refcount = [0] * num_pages
    self._key_of_page: dict[int, int] = {}
    self._page_of_key: dict[int, int] = {}
    self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first

  # ---- counts ---------------------------------------------------------------------------

  @property
  def num_free(self) -> int:
    """Pages that an allocation can take now (free ones and evictable cached ones)."""
    return len(self._free) + len(self._cached)

  @property
  def num_in_use(self) -> int:
    return self.num_pages - self.num_free

  @property
  def num_cached(self) -> int:
    return len(self._cached)

  def refcount(self, page: int) -> int:
    return self._refcount[page]

  # ---- allocation -----------------------------------------------------------------------

  def allocate(self, count: int) -> list[int]:
    """``count`` pages for one sequence (refcount 1), evicting least recently used cached
    pages when the free list runs out; ``OutOfPages`` (nothing taken) if they do not fit."""
    if count > self.num_free:
      raise OutOfPages(f"{count} pages asked, {self.num_free} free")
    pages = []
    for _ in range(count):
      if self._free:
        page = self._free.popleft()
      else:
        page, _ = self._cached.popitem(last=False)
        del self._page_of_key[self._key_of_page.pop(page)]
      self._refcount[page] = 1
      pages.append(page)
    return pages

  def release(self, pages: Sequence[int]) -> None:
    """Drops one reference to each page: unreferenced pages become cached (when they hold a
    registered prefix) or free."""
    for page in pages:
      if self._refcount[page] <= 0:
        raise RuntimeError(f"page {page} released more often than it was taken")
      self._refcount[page] -= 1
      if self._refcount[page] == 0:
        if page in self._key_of_page:
          self._cached[page] = None
        else:
          self._free.append(page)

  # ---- the prefix cache -----------------------------------------------------------------

  def match(self, keys: Sequence) -> list[int]:
    """Takes a reference to the pages of the longest registered prefix of the chain ``keys``
    and returns them (the caller owns them like allocated pages)."""
    pages = []
    for key in keys:
      page = self._page_of_key.get(key)
      if page is None:
        break
      if self._refcount[page] == 0:
        del self._cached[page]
      self._refcount[page] += 1
      pages.append(page)
    return pages

  def register(self, page: int, key) -> None:
    """Records that in-use ``page`` holds the full prefix page ``key``. A key already held by
    another page keeps that page (the duplicate stays unregistered and is freed normally)."""
    if key not in self._page_of_key and page not in self._key_of_page:
      self._page_of_key[key] = page
      self._key_of_page[page] = key

  def check(self) -> None:
    """Every page is in exactly one state (tests call it after runs)."""
    free, cached = set(self._free), set(self._cached)
    used = {p for p, n in enumerate(self._refcount) if n > 0}
    if min(self._refcount, default=0) < 0 or free & cached or free & used or cached & used or \
        len(free) + len(cached) + len(used) != self.num_pages or len(free) != len(self._free):
      raise AssertionError("page table is inconsistent")
    if not cached <= set(self._key_of_page):
      raise AssertionError("a cached page has no prefix key")
