"""HF transformers ``generate`` over static batches of ragged requests (run by a side Python).

    PYTHON_WITH_TORCH benchmarks/hf_static_batches.py REQUESTS.json OUT_DIR --batch 32

``benchmarks/serving.py --hf-python`` writes the throughput workload to REQUESTS.json
(``{"prompts": [[ids]], "max_tokens": [n]}``) and runs this with the interpreter of a side
virtual environment (torch, transformers, numpy; not mla_jax). It builds the random
``DeepseekV32ForCausalLM`` of mla_jax's tiny preset (``hf_eager_decode.build``), then runs the
requests in arrival order as static batches: left-padded with an attention mask, greedy, eager
attention with the KV cache, each batch to its longest ``max_tokens`` (no end-of-sequence
stop), as ``benchmarks/serving.py``'s static ``generate`` baseline does. It prints one JSON
object: seconds, and the requests' own output tokens (useful) and the tokens decoded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
  # This folder's kernels.py would shadow the optional ``kernels`` package transformers probes;
  # hf_eager_decode is imported by path instead.
  sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]
  import importlib.util

  import torch
  import transformers

  spec = importlib.util.spec_from_file_location("hf_eager_decode",
                                                os.path.join(HERE, "hf_eager_decode.py"))
  hf_eager_decode = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(hf_eager_decode)

  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("requests")
  parser.add_argument("out_dir")
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  warnings.filterwarnings("ignore")
  with open(args.requests) as f:
    work = json.load(f)
  model = hf_eager_decode.build(args.out_dir, args.seed)
  model.generation_config.eos_token_id = None  # every request runs to its max_tokens
  model.generation_config.pad_token_id = 0
  seconds = useful = computed = 0
  for first in range(0, len(work["prompts"]), args.batch):
    prompts = work["prompts"][first:first + args.batch]
    limits = work["max_tokens"][first:first + args.batch]
    width, longest = max(map(len, prompts)), max(limits)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):  # left padding: every prompt ends at the same column
      ids[row, width - len(prompt):] = torch.as_tensor(prompt)
      mask[row, width - len(prompt):] = 1
    t0 = time.perf_counter()
    with torch.no_grad():
      model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest,
                     min_new_tokens=longest, do_sample=False)
    seconds += time.perf_counter() - t0
    useful += sum(limits)
    computed += len(prompts) * longest
  print(json.dumps({"seconds": seconds, "useful": useful, "computed": computed,
                    "torch": torch.__version__, "transformers": transformers.__version__,
                    "threads": torch.get_num_threads()}))


if __name__ == "__main__":
  main()
