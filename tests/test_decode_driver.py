"""The one device decode loop (``decoding.steps``) and the one host decode loop
(``decoding.driver``): the stop rule's emission against a NumPy reference, the scan's steps,
the pipeline's order (the next dispatch before the last is read), and that the drivers loop
through them alone."""

import ast
import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mla_jax as m
from mla_jax.decoding.driver import Pipeline
from mla_jax.decoding.steps import Progress, decode_steps, emit
from mla_jax.generation import loop
from mla_jax.models.config import tiny_lm
from tests.helpers import lm

PACKAGE = pathlib.Path(m.__file__).parent


def _emit_reference(active, emitted, tokens, valid, stop_ids, max_tokens):
  """``emit`` in plain Python: each active row keeps its valid tokens up to its first end."""
  b, k = tokens.shape
  out = np.full((b, k), -1)
  active, emitted = active.copy(), emitted.copy()
  for i in range(b):
    for t in range(min(valid[i], k) if active[i] else 0):
      out[i, t] = tokens[i, t]
      emitted[i] += 1
      if tokens[i, t] in stop_ids[i] or emitted[i] >= max_tokens[i]:
        active[i] = False
        break
  return active, emitted, out


@pytest.mark.parametrize("seed", range(3))
def test_emit_keeps_each_rows_tokens_up_to_its_first_end(seed):
  rng = np.random.default_rng(seed)
  b, k, vocab = 16, 4, 6
  active = rng.random(b) < 0.8
  emitted = rng.integers(1, 6, b).astype(np.int32)
  tokens = rng.integers(0, vocab, (b, k)).astype(np.int32)
  valid = rng.integers(0, k + 1, b).astype(np.int32)
  stop_ids = np.where(rng.random((b, 2)) < 0.5, rng.integers(0, vocab, (b, 2)), -1)
  max_tokens = rng.integers(2, 10, b).astype(np.int32)
  want = _emit_reference(active, emitted, tokens, valid, stop_ids, max_tokens)
  progress, out = emit(Progress.start(active, emitted), jnp.asarray(tokens), jnp.asarray(valid),
                       jnp.asarray(stop_ids, jnp.int32), jnp.asarray(max_tokens))
  np.testing.assert_array_equal(np.asarray(out), want[2])
  np.testing.assert_array_equal(np.asarray(progress.active_B), want[0])
  np.testing.assert_array_equal(np.asarray(progress.emitted_B), want[1])
  # Stop ids shared by every row ([M]) and one length for all (a scalar), as generate has them.
  shared = _emit_reference(active, emitted, tokens, valid, [stop_ids[0]] * b, [7] * b)
  progress, out = emit(Progress.start(active, emitted), jnp.asarray(tokens), jnp.asarray(valid),
                       jnp.asarray(stop_ids[0], jnp.int32), 7)
  np.testing.assert_array_equal(np.asarray(out), shared[2])
  np.testing.assert_array_equal(np.asarray(progress.active_B), shared[0])


def test_decode_steps_runs_each_step_for_the_active_rows_until_they_end():
  """A counting step (row b's step i proposes i + b, twice): rows end at a stop id or their
  last token, and what an ended row's step returns is never emitted."""
  b, count = 4, 5

  def step(carry, progress, i):
    tokens_B = i + jnp.arange(b, dtype=jnp.int32)
    return (carry + progress.active_B.astype(jnp.int32), jnp.stack([tokens_B, tokens_B], 1),
            jnp.full((b,), 2, jnp.int32), tokens_B)

  start = Progress.start(jnp.array([True, True, True, False]), 1)
  carry, progress, emitted_NBK, extra_N = jax.jit(
      lambda c, p: decode_steps(step, c, p, count, stop_ids=jnp.array([5], jnp.int32),
                                max_tokens=jnp.array([4, 20, 20, 20])))(
          jnp.zeros((b,), jnp.int32), start)
  rows = [[int(t) for t in np.asarray(emitted_NBK)[:, r].reshape(-1) if t >= 0] for r in range(b)]
  # Row 0 ends at its 4th token; row 1 at stop id 5 (step 4); row 2 at 5 (step 3); row 3 ended.
  assert rows == [[0, 0, 1], [1, 1, 2, 2, 3, 3, 4, 4, 5], [2, 2, 3, 3, 4, 4, 5], []]
  np.testing.assert_array_equal(np.asarray(progress.active_B), [False] * 4)
  np.testing.assert_array_equal(np.asarray(progress.emitted_B), [4, 10, 8, 1])
  np.testing.assert_array_equal(np.asarray(carry), [2, 5, 4, 0])  # steps each row was active
  assert np.asarray(extra_N).shape == (count, b)


def test_pipeline_dispatches_the_next_before_it_reads_the_last():
  events, sent = [], iter(range(1, 4))

  def dispatch(pipeline, updates):
    n = next(sent, None)
    if n is not None:
      events.append(f"dispatch {n}")
    return n

  def settle(flight):
    events.append(f"settle {flight}")
    return [flight]

  pipeline = Pipeline(dispatch, settle)
  settled = [u for updates in pipeline.run(lambda: events and pipeline.in_flight is None)
             for u in updates]
  assert events == ["dispatch 1", "dispatch 2", "settle 1", "dispatch 3", "settle 2",
                    "settle 3"]
  assert settled == [1, 2, 3]
  # A flight whose outputs the next dispatch needs is settled first.
  events.clear()
  sent = iter(range(1, 3))
  pipeline = Pipeline(dispatch, settle, settle_first=lambda flight: True)
  for _ in pipeline.run(lambda: len(events) >= 4):
    pass
  assert events == ["dispatch 1", "settle 1", "dispatch 2", "settle 2"]


@pytest.mark.parametrize("speculative_tokens", [0, 2])
def test_generate_sends_each_dispatch_before_it_reads_the_last(monkeypatch, speculative_tokens):
  """``generate``'s decode keeps one dispatch in flight, and its tokens do not depend on it
  (the same as one dispatch of every step)."""
  events = []
  dispatch, settle = loop._Decode.dispatch, loop._Decode.settle

  def spied_dispatch(self, pipeline, updates):
    flight = dispatch(self, pipeline, updates)
    if flight is not None:
      events.append("dispatch")
    return flight

  def spied_settle(self, flight):
    events.append("settle")
    return settle(self, flight)

  monkeypatch.setattr(loop._Decode, "dispatch", spied_dispatch)
  monkeypatch.setattr(loop._Decode, "settle", spied_settle)
  config = dataclasses.replace(tiny_lm(), num_layers=1, num_mtp_layers=1)
  model = lm(config, seed=2)
  prompts = [[3, 1, 4, 1, 5], [9, 2]]
  result = m.generate(model, prompts, 9, steps_per_dispatch=2,
                      speculative_tokens=speculative_tokens)
  assert events[:3] == ["dispatch", "dispatch", "settle"], events
  assert events.count("dispatch") == events.count("settle") >= 2
  monkeypatch.undo()
  assert result.tokens == m.generate(model, prompts, 9, steps_per_dispatch=8).tokens


def _tree(relative: str) -> ast.Module:
  return ast.parse((PACKAGE / relative).read_text())


def _calls(tree: ast.AST, name: str) -> int:
  """Calls of ``name`` as a function or attribute (``lax.scan``, ``jax.lax.scan``, ``scan``)."""
  return sum(isinstance(node, ast.Call) and (getattr(node.func, "attr", None) == name
                                             or getattr(node.func, "id", None) == name)
             for node in ast.walk(tree))


def test_every_driver_loops_through_the_one_device_and_host_loop():
  """Decode steps are scanned only in ``decoding.steps``; no driver writes its own loop over
  dispatches (the host's is ``Pipeline.run``)."""
  for program in ("generation/programs.py", "serving/step_program.py"):
    tree = _tree(program)
    assert _calls(tree, "decode_steps") >= 1, program
    assert not any(_calls(tree, loop_name) for loop_name in ("scan", "while_loop",
                                                              "fori_loop")), program
  assert _calls(_tree("decoding/steps.py"), "scan") == 1
  for driver in ("generation/loop.py", "serving/engine.py"):
    assert not any(isinstance(node, ast.While) for node in ast.walk(_tree(driver))), driver
  run = next(node for node in ast.walk(_tree("serving/engine_loop.py"))
             if isinstance(node, ast.FunctionDef) and node.name == "_run")
  assert not any(isinstance(node, ast.While) for node in ast.walk(run))
  assert "self.engine.run(" in ast.unparse(run)
