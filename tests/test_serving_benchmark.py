"""benchmarks/serving.py: its workloads and latency figures are what its tables say, and a quick
run prints every table."""

import argparse
import dataclasses
import types

import numpy as np
import pytest

from benchmarks import serving


def test_random_requests_stay_in_their_ranges():
  requests = serving.random_requests(np.random.default_rng(0), 500, (16, 1024), (16, 256))
  prompts = np.array([len(r.prompt) for r in requests])
  outputs = np.array([r.max_tokens for r in requests])
  assert prompts.min() >= 16 and prompts.max() <= 1024
  assert outputs.min() >= 16 and outputs.max() <= 256
  # Log-uniform: the median prompt sits near the geometric mean of the range (128), far below
  # the arithmetic mean (520).
  assert 90 < np.median(prompts) < 180
  assert all(r.arrival == 0 for r in requests)


def test_shared_prefix_requests_share_exactly_the_prefix():
  sizes = serving.QUICK
  requests = serving.shared_prefix_requests(np.random.default_rng(0), sizes)
  prefix = requests[0].prompt[:sizes.prefix_len]
  assert len(requests) == sizes.prefix_requests
  for r in requests:
    assert r.prompt[:sizes.prefix_len] == prefix
    assert sizes.suffix_lens[0] <= len(r.prompt) - sizes.prefix_len <= sizes.suffix_lens[1]


def test_poisson_arrivals_have_the_rate():
  requests = serving.random_requests(np.random.default_rng(0), 2000, (16, 16), (16, 16))
  arrivals = [r.arrival for r in serving.poisson_arrivals(np.random.default_rng(1), requests,
                                                          rate=4.0)]
  assert arrivals[0] == 0 and np.all(np.diff(arrivals) >= 0)
  assert np.mean(np.diff(arrivals)) == pytest.approx(0.25, rel=0.1)


def test_trace_latencies():
  trace = serving.Trace(arrivals=[0.0, 1.0], token_times=[[0.5, 0.75, 1.0], [3.0, 3.5]],
                        outputs=[None, None], compile_s=0.0)
  np.testing.assert_allclose(trace.ttft(), [0.5, 2.0])
  np.testing.assert_allclose(trace.itl(), [0.25, 0.25, 0.5])
  assert trace.elapsed == 3.5 and trace.output_tokens == 5


@dataclasses.dataclass
class _Stats:
  compile_s: float = 0.0
  steps: int = 0


class _DispatchingEngine:
  """What ``drive`` uses of an engine; each step returns up to 8 tokens of every request, as
  a multi-step decode dispatch does."""

  def __init__(self):
    self.stats = _Stats()
    self.scheduler = types.SimpleNamespace(num_preemptions=0)
    self.left = {}

  def add_request(self, prompt, params):
    self.left[str(len(self.left))] = params.max_tokens
    return str(len(self.left) - 1)

  def has_unfinished(self):
    return any(self.left.values())

  def step(self):
    self.stats.steps += 1
    outputs = []
    for request_id, left in self.left.items():
      if left:
        self.left[request_id] = left - min(left, 8)
        outputs.append(types.SimpleNamespace(request_id=request_id,
                                             new_tokens=(0,) * min(left, 8)))
    return outputs

  def release(self, request_id):
    return request_id


def test_drive_times_every_token_of_a_multi_step_dispatch():
  """The tokens of one dispatch come back at one time: each is counted (once a step, 20
  tokens would count as 3)."""
  trace = serving.drive(_DispatchingEngine(), [serving.Request([1], 20), serving.Request([2], 5)])
  assert [len(times) for times in trace.token_times] == [20, 5] and trace.output_tokens == 25
  assert trace.steps == 3 and len(set(trace.token_times[0])) == 3
  assert len(trace.itl()) == 2 and np.all(trace.itl() > 0)  # the gaps between 3 dispatches


def test_the_pool_holds_every_seat_at_its_longest():
  sizes = serving.FULL
  assert sizes.num_pages() == sizes.max_num_seqs * 20  # 1024 + 256 tokens in pages of 64
  assert sizes.host_prompt * serving.HOST_SEQS <= sizes.max_step_tokens


@pytest.mark.slow  # over 30 s on 2 cores
@pytest.mark.parametrize("sections, titles", [
    # throughput's row and the three latency rates
    ("throughput,latency", ("## 1. Throughput", "## 3. Latency")),
    # shared prefix, host time, the two static batches
    ("prefix,host,static", ("## 2. Shared prefix", "## 4. Host time", "## 5. Static batches")),
])
def test_quick_run_prints_every_table(capsys, sections, titles):
  """Every section but the warm-up's (three fresh processes compiling every program: minutes,
  and what they time is Engine.warmup, tested in test_engine_dispatch.py), in two halves that
  CI's two workers can run at once (160 s in one case on 2 cores, cold)."""
  serving.main(["--quick", "--requests", "4", "--sections", sections])
  out = capsys.readouterr().out
  for title in titles:
    assert title in out
  if "throughput" in sections:
    assert "| tiny | 4 |" in out  # the throughput row, with --requests
  assert out.count("| tiny | ") == 4
  assert "nan" not in out


def test_sections_choose_a_subset_and_latency_needs_throughput():
  assert serving.parse_sections("throughput, static") == ("throughput", "static")
  with pytest.raises(argparse.ArgumentTypeError, match="unknown sections"):
    serving.parse_sections("throughput,speed")
  with pytest.raises(argparse.ArgumentTypeError, match="latency needs throughput"):
    serving.parse_sections("latency")
