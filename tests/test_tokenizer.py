"""A checkpoint's own tokenizer: a small BPE trained here with the ``tokenizers`` library and
saved beside a tiny checkpoint, its special tokens and generation defaults, and the CLI."""

import json
import re

import jax.numpy as jnp
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import mla_jax.checkpoints
from mla_jax import cli
from mla_jax.checkpoints import CheckpointError, save_pretrained
from mla_jax.checkpoints.generation_config import GenerationDefaults, read_generation_config
from mla_jax.tokenizer import ByteTokenizer, HFTokenizer, checkpoint_tokenizer
from tests.checkpoint_models import (fp8_config, random_model, small_config,
                                     write_fp8_checkpoint)

SENTENCES = ["Sparse attention picks the keys that matter.",
             "The indexer scores every key with a few cheap heads.",
             "Experts share the work of every token, eight at a time.",
             "Latent caches keep one row per token for all heads."]
TEXT = "The keys that matter share every token."
SPECIAL = ["<bos>", "<eos>", "<eot>", "<unk>"]  # ids 0-3


def _write_tokenizer(path, tokenizer_config=None, generation_config=None):
  tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
  tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
  tokenizer.decoder = decoders.Metaspace()
  tokenizer.train_from_iterator(SENTENCES, trainers.BpeTrainer(vocab_size=150,
                                                               special_tokens=SPECIAL))
  tokenizer.save(str(path / "tokenizer.json"))
  for name, content in (("tokenizer_config.json", tokenizer_config),
                        ("generation_config.json", generation_config)):
    if content is not None:
      (path / name).write_text(json.dumps(content))
  return tokenizer


def _largest_id(path) -> int:
  return max(Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab().values())


TOKENIZER_CONFIG = {"bos_token": "<bos>", "add_bos_token": True,
                    "eos_token": {"__type": "AddedToken", "content": "<eos>"}}
GENERATION_CONFIG = {"bos_token_id": 0, "eos_token_id": [1, 2], "do_sample": True,
                     "temperature": 0.7, "top_p": 0.9}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """A tiny fp8 checkpoint (vocabulary 256) with the BPE tokenizer and both configs."""
  path = tmp_path_factory.mktemp("tokenized")
  write_fp8_checkpoint(random_model(fp8_config(), seed=7, param_dtype=jnp.bfloat16), path)
  _write_tokenizer(path, TOKENIZER_CONFIG, GENERATION_CONFIG)
  return path


def test_round_trip_and_special_tokens(checkpoint, tmp_path):
  tok = checkpoint_tokenizer(checkpoint)
  assert isinstance(tok, HFTokenizer)
  ids = tok.encode(TEXT)
  assert ids[0] == 0 and 0 not in ids[1:] and max(ids) < 150
  assert tok.decode(ids) == TEXT and tok.decode(ids + [2, 1]) == TEXT
  assert (tok.bos_id, tok.eos_ids, tok.max_id) == (0, (1, 2), _largest_id(checkpoint))
  # Without generation_config.json, EOS is tokenizer_config.json's eos_token.
  _write_tokenizer(tmp_path, {**TOKENIZER_CONFIG, "add_bos_token": False})
  plain = checkpoint_tokenizer(tmp_path)
  assert plain.eos_ids == (1,) and plain.encode(TEXT) == ids[1:]
  assert isinstance(checkpoint_tokenizer(tmp_path / "nowhere"), ByteTokenizer)
  assert ByteTokenizer().decode(ByteTokenizer().encode("héllo")) == "héllo"


def test_vocab_mismatch_is_a_clear_error(checkpoint, tmp_path, monkeypatch, capsys):
  tok, top = checkpoint_tokenizer(checkpoint), _largest_id(checkpoint)
  assert 64 < top < 150
  tok.check_fits(top + 1)
  with pytest.raises(ValueError, match=f"has ids up to {top}, but the model's vocabulary has "
                                       f"{top} entries"):
    tok.check_fits(top)
  save_pretrained(random_model(small_config("ds32")), tmp_path)  # vocabulary 64
  _write_tokenizer(tmp_path, TOKENIZER_CONFIG)
  monkeypatch.setattr(mla_jax.checkpoints, "load_pretrained",
                      lambda *a, **k: pytest.fail("the model was loaded before the check"))
  assert cli.main(["generate", "--checkpoint", str(tmp_path), "--quiet"]) == 2
  assert f"has ids up to {top}, but the model's vocabulary has 64" in capsys.readouterr().err


@pytest.mark.parametrize("files, match", [
    ({"tokenizer.json": "{not json"}, "tokenizer.json: not a tokenizers file"),
    ({"tokenizer_config.json": {"eos_token": 5}}, "eos_token must be a string"),
    ({"tokenizer_config.json": {"eos_token": "<end>"}}, "special token '<end>' is not in"),
    ({"tokenizer_config.json": {"add_bos_token": True}}, "add_bos_token is true but no BOS"),
    ({"generation_config.json": {"eos_token_id": []}}, "eos_token_id must be an id >= 0"),
    ({"generation_config.json": {"do_sample": True, "temperature": "hot"}},
     "temperature must be a number in \\[0, inf\\]"),
    ({"generation_config.json": {"top_p": 0}}, "top_p must be a number in \\(0, 1\\]"),
    ({"generation_config.json": [1]}, "must hold a JSON object"),
])
def test_bad_tokenizer_files(tmp_path, files, match):
  _write_tokenizer(tmp_path)
  for name, content in files.items():
    (tmp_path / name).write_text(content if isinstance(content, str) else json.dumps(content))
  with pytest.raises(CheckpointError, match=match):
    checkpoint_tokenizer(tmp_path)


def test_generation_defaults_follow_hf(tmp_path):
  def defaults(content):
    (tmp_path / "generation_config.json").write_text(json.dumps(content))
    found = read_generation_config(tmp_path)
    return found.temperature, found.top_p

  assert defaults({"temperature": 0.6, "top_p": 0.95}) == (0.0, 1.0)  # HF: do_sample=False
  assert defaults({"do_sample": True, "temperature": 0.6, "top_p": 0.95}) == (0.6, 0.95)
  assert defaults({"do_sample": True}) == (1.0, 1.0)
  (tmp_path / "generation_config.json").unlink()
  assert read_generation_config(tmp_path) == GenerationDefaults()
  args = cli.build_parser().parse_args(["generate", "--checkpoint", str(tmp_path),
                                        "--top-p", "0.5"])
  (tmp_path / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
  assert cli._sampling(args) == (0.7, 0.5)  # a flag wins over generation_config.json


@pytest.mark.slow  # over 30 s on 2 cores: CI runs the slow cases in a step of their own
def test_cli_fp8_on_a_mesh_with_the_checkpoints_tokenizer(checkpoint, capsys):
  assert cli.main(["generate", "--checkpoint", str(checkpoint), "--mesh",
                   "data=2,tensor=2,expert=2", "--dtype", "fp8", "--prompt", TEXT, "--batch", "2",
                   "--max-new-tokens", "4", "--stop-at-eos", "--quiet", "--backend", "xla"]) == 0
  out = capsys.readouterr().out
  assert "mesh: data=2,tensor=2,expert=2 over 8 devices" in out
  assert f"tokenizer: tokenizer {checkpoint / 'tokenizer.json'}" in out
  assert "sampling: temperature 0.7, top_p 0.9" in out  # from generation_config.json
  tok = checkpoint_tokenizer(checkpoint)
  assert f"prompt: {len(tok.encode(TEXT))} tokens" in out
  ids = json.loads(re.search(r"generated ids: (\[.*\])", out).group(1))
  assert 1 <= len(ids) <= 4 and all(i not in tok.eos_ids for i in ids[:-1])
  assert f"generated text: {tok.decode(ids)!r}" in out
