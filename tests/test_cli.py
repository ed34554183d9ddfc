"""The ``mla-jax`` command: the main job, checkpoints through the loader, errors."""

import logging

import jax.numpy as jnp
import pytest
from flax import nnx

import mla_jax as m
from mla_jax import checkpoints, cli, plan
from mla_jax.checkpoints import save_pretrained
from mla_jax.models.config import tiny_lm
from tests.checkpoint_models import fp8_config, random_model, write_fp8_checkpoint


def test_generate_prints_routes_and_throughput(capsys):
  assert cli.main(["generate", "--preset", "tiny", "--prompt", "hi", "--max-new-tokens", "4",
                   "--quiet",
                   "--attention", "dense-capable", "--backend", "xla"]) == 0
  out = capsys.readouterr().out
  assert "prefill route, layer 0: dense_mha" in out  # 3 prompt tokens <= index_topk 16
  assert "generated text:" in out and "decode: 3 tokens" in out
  assert "compile time:" in out and "tokens/s" in out


def test_generate_from_a_checkpoint(tmp_path, capsys):
  model = m.CausalLM(tiny_lm(), rngs=nnx.Rngs(3), backend="xla")
  save_pretrained(model, tmp_path)
  assert cli.main(["generate", "--checkpoint", str(tmp_path), "--prompt-len", "20",
                   "--max-new-tokens", "3", "--quiet", "--backend", "xla"]) == 0
  out = capsys.readouterr().out
  assert "prefill route, layer 1: sparse_mqa" in out and "prompt: 20 tokens" in out


def test_generate_with_an_fp8_cache(capsys):
  assert cli.main(["generate", "--preset", "tiny", "--prompt-len", "20", "--max-new-tokens",
                   "3", "--quiet", "--backend", "xla", "--cache-dtype", "fp8"]) == 0
  out = capsys.readouterr().out
  # A = 64 e4m3 + one float32 scale + R = 16 bf16, then I = 32 e4m3 + one float32 scale.
  assert "cache: fp8, 136 bytes per token per layer" in out and "decode: 2 tokens" in out


def test_bad_checkpoint_is_a_clear_error(tmp_path, capsys):
  assert cli.main(["generate", "--checkpoint", str(tmp_path), "--quiet"]) == 2
  assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["generate", "--max-new-tokens", "0"],
                                  ["generate", "--prompt-len", "0"],
                                  ["generate", "--backend", "cuda"],
                                  ["generate", "--dtype", "fp8"],
                                  ["generate", "--compute-dtype", "float32"],
                                  ["generate", "--compute-dtype", "fp8"],
                                  ["generate", "--cache-dtype", "fp4"],
                                  ["plan", "--mesh", "tensor=8", "--page-size", "0"]])
def test_bad_arguments_exit(argv):
  with pytest.raises(SystemExit):
    cli.main(argv)


def test_routes_demo(capsys):
  assert cli.main(["routes"]) == 0
  rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 1")]
  assert any("dense_mha | no | sparse_mqa | yes" in row for row in rows)
  # Past the top-k the dense-capable layer takes the masked route: equal up to rounding.
  row = next(row for row in rows if row.startswith("| 17 |"))
  assert row.startswith("| 17 | masked_mha | yes | sparse_mqa | yes |")
  assert float(row.split("|")[-2]) < 1e-5


def test_plan_with_fp8_weights(capsys):
  """``--dtype`` also belongs to ``plan``, where fp8 needs no checkpoint."""
  assert cli.main(["plan", "--model", "deepseek_v32", "--mesh", "data=1,tensor=2,expert=8",
                   "--dtype", "fp8"]) == 0
  out = capsys.readouterr().out
  assert "| deepseek_v32 | data=1,tensor=2,expert=8 | fp8 |" in out


def test_bare_plan_plans_deepseek_v32_on_one_host_of_8_gpus(capsys):
  assert cli.main(["plan"]) == 0
  assert "| deepseek_v32 | tensor=8 | bf16 |" in capsys.readouterr().out


def test_plan_prints_the_pages_left_after_the_weights(capsys):
  """DeepSeek-V3.2, fp8 weights and caches on 8 GPUs: a token takes 61 layers x (656 B latent
  row + 132 B indexer key), a 64-token page 64 x that on every device (tensor=8 replicates
  the cache), and the pages fill 90% of the GPU less the weights, never more."""
  p = plan.make_plan("deepseek_v32", "tensor=8", "fp8", cache_dtype="fp8")
  page_bytes = 64 * 61 * (656 + 132)
  left = 0.9 * 143771 * 2**20 - p.param_bytes
  cap = plan.page_capacity(p, "H200 141GB", 64)
  assert cap.page_bytes == page_bytes
  assert cap.pages * page_bytes <= left < (cap.pages + 1) * page_bytes
  assert cap.pages == 16054 and cap.tokens == 16054 * 64
  # 4K, 32K and 128K tokens are 64, 512 and 2048 pages a sequence.
  row = "| tensor=8 | H200 141GB | 16,054 | 16,054 | 1,027,456 | 250 | 31 | 7 |"
  assert cli.main(["plan", "--mesh", "tensor=8", "--dtype", "fp8", "--cache-dtype", "fp8",
                   "--page-size", "64"]) == 0
  out = capsys.readouterr().out
  assert "paged KV cache (page size 64, fp8: 48,068 B per token" in out and row in out
  assert "| tensor=8 | H100 80GB | 0 | 0 | 0 | 0 | 0 | 0 |" in out  # the weights do not fit
  with pytest.raises(ValueError, match="page size"):
    plan.page_capacity(p, "H200 141GB", 0)


def test_an_engine_has_one_pool_whatever_the_data_axis():
  """The engine's pool is whole on every data shard (they share it), so a data axis adds no
  pages, and a context that is not a whole number of pages still takes whole pages."""
  cap = plan.PageCapacity("H200 141GB", page_size=64, page_bytes=1, pages=3072)
  assert cap.tokens == 3072 * 64
  assert cap.sequences(131072) == 1  # 2048 pages a sequence
  assert cap.sequences(65) == 3072 // 2
  p = plan.make_plan("deepseek_v32", "data=2,tensor=4", "fp8", batch=2, cache_dtype="fp8")
  assert plan.page_capacity(p, "H200 141GB").pages == plan.pages_that_fit(
      plan.GPUS["H200 141GB"], p.param_bytes, 64 * p.token_bytes)


def test_plan_counts_the_context_ranks_pages_beside_weights_split_over_them(capsys):
  """DeepSeek-V3.2 and GLM-5, fp8 weights and caches, on the meshes of one 8 x H200 node:
  the weights are 1/8 on every device on each (tensor x context), and each context rank
  holds as many pages as one device of tensor=8, so the pool grows with the context ranks
  (the goals of issue 50: >= 14 / >= 50 sequences of 128K for V3.2, >= 8 / >= 30 for GLM-5)."""
  assert cli.main(["plan", "--mesh", "tensor=8", "--mesh", "tensor=4,context=2", "--mesh",
                   "context=8", "--dtype", "fp8", "--cache-dtype", "fp8"]) == 0
  out = capsys.readouterr().out
  for row in ("| tensor=8 | H200 141GB | 16,054 | 16,054 | 1,027,456 | 250 | 31 | 7 |",
              "| tensor=4,context=2 | H200 141GB | 32,108 | 16,054 | 2,054,912 | 501 | 62 | 15 |",
              "| context=8 | H200 141GB | 128,432 | 16,054 | 8,219,648 | 2,006 | 250 | 62 |",
              "| deepseek_v32 | context=8 | fp8 | 1 x 131072 | 80.4 | 0.7 | 81.1 | no | yes |"):
    assert row in out, row
  sequences = {}
  for mesh in ("tensor=8", "tensor=4,context=2", "context=8"):
    p = plan.make_plan("glm5", mesh, "fp8", cache_dtype="fp8")
    sequences[mesh] = plan.page_capacity(p, "H200 141GB").sequences(131072)
  assert sequences == {"tensor=8": 4, "tensor=4,context=2": 9, "context=8": 39}


@pytest.mark.parametrize("preset", ["tiny", "recall"])
def test_fp8_weights_need_a_checkpoint(preset, capsys):
  with pytest.raises(SystemExit, match="needs --checkpoint"):
    cli.main(["generate", "--preset", preset, "--dtype", "fp8"])


def test_generate_defaults_to_the_recall_preset_and_its_prompt(capsys):
  """No flags but one: the trained recall model answers its example lookup; one new token
  is the prefill's, so there is no decode rate to report."""
  assert cli.main(["generate", "--quiet", "--backend", "xla"]) == 0
  out = capsys.readouterr().out
  assert "generated text: 'X'" in out and "prompt: 31 tokens" in out  # one token by default
  assert out.splitlines()[-1] == "decode: no decode step (the first token comes from the prefill)"
  with pytest.raises(SystemExit):
    cli.main(["generate", "--help"])
  help_text = " ".join(capsys.readouterr().out.split())
  assert cli.RECALL_PROMPT in help_text and "(default recall)" in help_text


def test_progress_bar_prints_one_line(capsys):
  """Off a terminal (a pipe, a log) each tqdm redraw would stay as a line of its own."""
  assert cli.main(["generate", "--preset", "tiny", "--max-new-tokens", "5",
                   "--backend", "xla"]) == 0
  bars = [line for line in capsys.readouterr().err.replace("\r", "\n").splitlines()
          if line.startswith("decode")]
  assert len(bars) == 1 and "5/5" in bars[0], bars


@pytest.fixture
def mla_jax_logger():
  logger = logging.getLogger("mla_jax")
  level = logger.level
  yield logger
  logger.setLevel(level)


@pytest.mark.parametrize("verbose", [False, True])
def test_verbose_shows_the_mla_jax_info_messages(mla_jax_logger, caplog, verbose):
  caplog.set_level(logging.DEBUG, logger="")
  assert cli.main(["plan", "--mesh", "data=1,tensor=2,expert=8"]
                  + ["-v"] * verbose) == 0
  mla_jax_logger.info("an info message")
  mla_jax_logger.warning("a warning")
  messages = [r.getMessage() for r in caplog.records if r.name == "mla_jax"]
  assert messages == ["an info message"] * verbose + ["a warning"]


def test_fp8_checkpoint_with_float32_compute(tmp_path, monkeypatch, capsys):
  write_fp8_checkpoint(random_model(fp8_config(), seed=1), tmp_path)
  asked = []
  load = checkpoints.load_pretrained
  monkeypatch.setattr(checkpoints, "load_pretrained",
                      lambda *a, **kw: asked.append(kw) or load(*a, **kw))
  assert cli.main(["generate", "--checkpoint", str(tmp_path), "--dtype", "fp8",
                   "--compute-dtype", "float32", "--max-new-tokens", "2", "--quiet",
                   "--backend", "xla"]) == 0
  assert asked[0]["dtype"] == "fp8" and asked[0]["compute_dtype"] == jnp.float32
  assert "decode: 1 tokens" in capsys.readouterr().out


def test_num_pages_auto_fits_the_pool_beside_the_weights(capsys, monkeypatch):
  """``serve --num-pages auto``: the pages that fit in 90% of a GPU's memory after the
  weights, one page being what the engine allocates per page; on a host without a GPU, a
  quarter of the memory available, at most 2 GiB."""
  import argparse

  import jax

  from mla_jax.serving.engine import Engine, page_bytes

  model = m.CausalLM(tiny_lm("mqa-only"), rngs=nnx.Rngs(0), backend="xla")
  engine = Engine(model, num_pages=3, page_size=8, cache_dtype="bf16", log_interval=None)
  per_page = page_bytes(model, 8, "bf16")
  assert sum(leaf.nbytes for leaf in jax.tree.leaves(engine._pools)) == 3 * per_page
  monkeypatch.setattr(plan, "_memory_limit", lambda device: 2**26)  # a GPU of 64 MiB
  weights = sum(leaf.nbytes for leaf in jax.tree.leaves(nnx.state(model)))
  args = argparse.Namespace(num_pages="auto", page_size=8, cache_dtype="bf16",
                            speculative_tokens=0)
  pages = cli._num_pages(args, model)
  assert pages == int((plan.FIT_FRACTION * 2**26 - weights) // per_page) > 0
  assert f"--num-pages auto: {pages:,} pages" in capsys.readouterr().out
  monkeypatch.setattr(plan, "_memory_limit", lambda device: weights)
  with pytest.raises(SystemExit, match="not one page fits"):
    cli._num_pages(args, model)
  # No GPU (the CPU states no limit): 25% of the host memory available, at most 2 GiB.
  monkeypatch.undo()
  for available, pool in ((2**26, 2**24), (64 * 2**30, 2 * 2**30)):
    monkeypatch.setattr(plan, "_host_available_bytes", lambda: available)
    assert cli._num_pages(args, model) == pool // per_page
    assert "no GPU, so 25% of the" in capsys.readouterr().out
  assert cli.pages_or_auto("auto") == "auto" and cli.pages_or_auto("7") == 7
  with pytest.raises(argparse.ArgumentTypeError, match=">= 1"):
    cli.pages_or_auto("0")
