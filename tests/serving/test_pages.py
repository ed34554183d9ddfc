"""The host page table: allocation, reference counts, the prefix hash chain and the LRU of
cached pages, checked against a small model of the expected state."""

import random

import pytest

from mla_jax.serving.pages import OutOfPages, PageTable, page_keys

SIZE = 4


def _cache(table, page, key):
  """Makes ``page`` (in use, one reference) a cached page holding ``key``."""
  table.register(page, key)
  table.release([page])


# ---- page_keys ----------------------------------------------------------------------------


def test_page_keys_are_a_chain_over_full_pages():
  tokens = list(range(4 * SIZE))
  keys = page_keys(tokens, SIZE, "salt")
  assert len(keys) == 4 and len(set(keys)) == 4
  assert page_keys(tokens + [99], SIZE, "salt") == keys  # a partial last page has no key
  assert page_keys(tokens[:SIZE - 1], SIZE, "salt") == []
  for i in range(4):
    changed = list(tokens)
    changed[i * SIZE + 1] += 100
    other = page_keys(changed, SIZE, "salt")
    assert other[:i] == keys[:i]
    assert all(a != b for a, b in zip(other[i:], keys[i:]))


def test_page_keys_continue_from_a_parent_as_from_scratch():
  tokens = [7, 3, 5, 1] * 5
  keys = page_keys(tokens, SIZE, "salt")
  for start in range(1, len(keys) + 1):
    assert page_keys(tokens, SIZE, "salt", start=start, parent=keys[start - 1]) == keys[start:]


def test_page_keys_depend_on_the_salt():
  tokens = list(range(2 * SIZE))
  assert page_keys(tokens, SIZE, "a") == page_keys(tokens, SIZE, "a")
  assert not set(page_keys(tokens, SIZE, "a")) & set(page_keys(tokens, SIZE, "b"))
  assert not set(page_keys(tokens, SIZE, None)) & set(page_keys(tokens, SIZE, "a"))


# ---- allocation and references ------------------------------------------------------------


def test_allocate_and_release():
  table = PageTable(4, SIZE)
  pages = table.allocate(3)
  assert len(set(pages)) == 3 and all(table.refcount(p) == 1 for p in pages)
  assert (table.num_free, table.num_in_use) == (1, 3)
  table.release(pages[:2])
  assert (table.num_free, table.num_in_use) == (3, 1)
  assert table.allocate(0) == []
  table.release(pages[2:])
  assert table.num_free == 4 and table.num_cached == 0
  table.check()


def test_double_release_raises_and_refcounts_stay_non_negative():
  table = PageTable(2, SIZE)
  page, = table.allocate(1)
  table.release([page])
  with pytest.raises(RuntimeError, match=f"page {page} released more often"):
    table.release([page])
  assert table.refcount(page) == 0
  table.check()


def test_out_of_pages_takes_nothing():
  table = PageTable(3, SIZE)
  held = table.allocate(1)
  _cache(table, table.allocate(1)[0], "k")
  with pytest.raises(OutOfPages):
    table.allocate(3)
  assert (table.num_free, table.num_cached, table.refcount(held[0])) == (2, 1, 1)
  assert table.match(["k"])  # the cached page survived
  table.check()


def test_eviction_takes_free_pages_first_then_least_recently_released_cached():
  table = PageTable(4, SIZE)
  pages = table.allocate(4)
  for page, key in zip(pages[:3], "abc"):
    table.register(page, key)
  table.release([pages[1], pages[0], pages[3], pages[2]])  # LRU order: 1, 0, 2 (3 is free)
  assert table.num_cached == 3
  assert table.allocate(1) == [pages[3]]
  assert table.allocate(2) == [pages[1], pages[0]]
  assert table.match(["b"]) == [] and table.match(["a"]) == []  # evicted keys are forgotten
  assert table.match(["c"]) == [pages[2]]
  table.check()


def test_match_takes_references_to_the_longest_registered_prefix():
  table = PageTable(5, SIZE)
  keys = page_keys(list(range(3 * SIZE)), SIZE, None)
  pages = table.allocate(3)
  for page, key in zip(pages, keys):
    table.register(page, key)
  table.release(pages[1:])  # page 0 still in use, 1 and 2 cached
  assert table.match(keys[:1] + ["nope"] + keys[2:]) == pages[:1]  # stops at the first miss
  assert table.refcount(pages[0]) == 2
  table.release(pages[:1])
  got = table.match(keys)
  assert got == pages and [table.refcount(p) for p in pages] == [2, 1, 1]
  assert table.num_cached == 0 and table.num_free == 2  # matched pages left the LRU
  table.release(got + pages[:1])
  assert table.num_cached == 3
  table.check()


def test_register_keeps_the_first_page_of_a_key():
  table = PageTable(3, SIZE)
  first, second, third = table.allocate(3)
  table.register(first, "k")
  table.register(second, "k")   # duplicate key: stays unregistered
  table.register(first, "other")  # a page holds one key
  table.release([first, second, third])
  assert table.num_cached == 1 and table.num_free == 3
  assert table.match(["k"]) == [first] and table.match(["other"]) == []
  table.release([first])
  table.check()


# ---- random operations against a model ----------------------------------------------------


class Model:
  """The expected state: refcounts, key <-> page, the free set and the LRU list of cached."""

  def __init__(self, num_pages):
    self.refcount = [0] * num_pages
    self.page_of_key, self.key_of_page = {}, {}
    self.free, self.lru = set(range(num_pages)), []

  def allocate(self, count, got):
    from_free = min(count, len(self.free))
    assert set(got[:from_free]) <= self.free and got[from_free:] == self.lru[:count - from_free]
    for page in got:
      self.free.discard(page)
      if page in self.lru:
        self.lru.remove(page)
        del self.page_of_key[self.key_of_page.pop(page)]
      self.refcount[page] = 1

  def release(self, page):
    self.refcount[page] -= 1
    if self.refcount[page] == 0:
      (self.lru.append if page in self.key_of_page else self.free.add)(page)

  def match(self, keys):
    pages = []
    for key in keys:
      if key not in self.page_of_key:
        break
      page = self.page_of_key[key]
      if page in self.lru:
        self.lru.remove(page)
      self.refcount[page] += 1
      pages.append(page)
    return pages

  def register(self, page, key):
    if key not in self.page_of_key and page not in self.key_of_page:
      self.page_of_key[key], self.key_of_page[page] = page, key


@pytest.mark.parametrize("seed", range(4))
def test_random_operations_follow_the_model(seed):
  rng, num_pages = random.Random(seed), 8
  table, model, held = PageTable(num_pages, SIZE, salt=seed), Model(num_pages), []
  chains = [page_keys([rng.randrange(3) for _ in range(4 * SIZE)], SIZE, seed)
            for _ in range(6)]  # few tokens: the chains share prefixes
  for _ in range(400):
    op = rng.choice(["allocate", "release", "release", "match", "register", "double"])
    if op == "allocate":
      count = rng.randint(0, 4)
      if count > len(model.free) + len(model.lru):
        with pytest.raises(OutOfPages):
          table.allocate(count)
      else:
        got = table.allocate(count)
        model.allocate(count, got)
        held += got
    elif op == "release" and held:
      page = held.pop(rng.randrange(len(held)))
      table.release([page])
      model.release(page)
    elif op == "match":
      chain = rng.choice(chains)
      prefix = chain[:rng.randint(1, len(chain))]
      got = table.match(prefix)
      assert got == model.match(prefix)
      held += got
    elif op == "register" and held:
      page, key = rng.choice(held), rng.choice(rng.choice(chains))
      table.register(page, key)
      model.register(page, key)
    elif op == "double":
      unheld = [p for p in range(num_pages) if model.refcount[p] == 0]
      if unheld:
        with pytest.raises(RuntimeError):
          table.release([rng.choice(unheld)])
    table.check()
    assert [table.refcount(p) for p in range(num_pages)] == model.refcount
    assert (table.num_free, table.num_cached) == (len(model.free) + len(model.lru), len(model.lru))
    assert table.num_in_use == sum(n > 0 for n in model.refcount)
    assert table.num_free + table.num_in_use == num_pages
  for page in held:
    table.release([page])
  assert table.num_free == num_pages
  table.check()
