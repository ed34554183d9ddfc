"""lm-eval (the harness people point at vLLM servers) against ``mla-jax serve``: its
``local-completions`` model, token-id requests through an HF tokenizer of the byte vocabulary
written here, on two tasks built from the recall model's lookups: ``generate_until`` (greedy
answers, exact match) and ``multiple_choice`` (log-likelihoods of each choice: echo,
``logprobs: 1``, ``max_tokens: 1``).

lm-eval is installed in CI's HF leg (``.ci/run``), which runs this module; elsewhere it skips.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from mla_jax import presets
from mla_jax.tokenizer import ByteTokenizer
from mla_jax.training.data import LookupTask
from tests.test_server import Server

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval runs in CI's HF leg (.ci/run)")
transformers = pytest.importorskip("transformers", reason="lm-eval's tokenizers need it")

NUM_DOCS = 40
VALUES = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _bytes_to_unicode() -> dict[int, str]:
  """GPT-2's byte-level alphabet: each byte as a printable character (what HF's ByteLevel
  pre-tokenizer and decoder map bytes to and from)."""
  printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
               *range(ord("®"), ord("ÿ") + 1)]
  chars, extra = {}, 0
  for b in range(256):
    if b in printable:
      chars[b] = chr(b)
    else:
      chars[b] = chr(256 + extra)
      extra += 1
  return chars


def byte_tokenizer_for_hf(directory) -> None:
  """``mla_jax.tokenizer.ByteTokenizer`` as an HF fast tokenizer saved in ``directory``: byte
  b is id b, then <bos> 256, <eos> 257, <pad> 258; special tokens add a leading <bos>."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

  vocab = {char: b for b, char in _bytes_to_unicode().items()}
  tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens(["<bos>", "<eos>", "<pad>"])
  tok.post_processor = processors.TemplateProcessing(single="<bos> $A",
                                                     special_tokens=[("<bos>", 256)])
  transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>",
                                       eos_token="<eos>", pad_token="<pad>"
                                       ).save_pretrained(directory)


def _lookups(seed: int):
  """``NUM_DOCS`` (context, answer, choices, gold) lookups of 12-96 tokens; the choices are
  the answer and three other values, in random order."""
  rng = np.random.default_rng(seed)
  task = LookupTask()
  for _ in range(NUM_DOCS):
    context, answer = task.example(rng, int(rng.integers(12, 97))).prompt()
    others = rng.choice([v for v in VALUES if v != answer], 3, replace=False).tolist()
    choices = [answer, *others]
    rng.shuffle(choices)
    yield {"context": context, "answer": answer, "choices": choices,
           "gold": choices.index(answer)}


TASKS = {
    "recall_generate": """\
task: recall_generate
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}}}}}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs: {{until: ["\\n"], max_gen_toks: 1, do_sample: false}}
metric_list: [{{metric: exact_match}}]
""",
    "recall_choice": """\
task: recall_choice
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}}}}}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: choices
doc_to_target: gold
target_delimiter: ""
metric_list: [{{metric: acc}}]
""",
}


@pytest.mark.timeout(600)
def test_lm_eval_local_completions_scores_the_recall_model(tmp_path, monkeypatch):
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
  monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
  byte_tokenizer_for_hf(tmp_path / "tokenizer")
  hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "tokenizer")
  docs = list(_lookups(0))
  assert hf(docs[0]["context"]).input_ids == ByteTokenizer().encode(docs[0]["context"])
  data = tmp_path / "lookups.jsonl"
  data.write_text("".join(json.dumps(d) + "\n" for d in docs))
  for name, text in TASKS.items():
    (tmp_path / f"{name}.yaml").write_text(text.format(data=data))

  from lm_eval import simple_evaluate
  from lm_eval.tasks import TaskManager

  server = Server(presets.RECALL_CHECKPOINT, "--served-model-name", "recall")
  try:
    results = simple_evaluate(
        model="local-completions",
        model_args=dict(model="recall", base_url=f"{server.url}/v1/completions",
                        tokenizer=str(tmp_path / "tokenizer"), tokenizer_backend="huggingface",
                        tokenized_requests=True, add_bos_token=True, batch_size=8,
                        num_concurrent=2, max_retries=1),
        tasks=list(TASKS), task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=False)
  finally:
    code, _, err = server.stop()
  assert code == 0, err
  scores = results["results"]
  assert scores["recall_generate"]["exact_match,none"] >= 0.95, scores
  assert scores["recall_choice"]["acc,none"] >= 0.95, scores
