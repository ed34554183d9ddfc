"""One process of a multi-process run on this host (started by tests/test_sharding.py).

Usage: python tests/multiprocess_worker.py PORT NUM_PROCESSES PROCESS_ID MESH OUT.npz [JOB]
Each process has 2 CPU devices; together they form one mesh. JOB ``generate`` (the default):
process 0 writes the prefill logits and the greedy tokens of the tiny MoE preset to OUT.npz.
JOB ``engine``: process 0 schedules an ``Engine`` over PROMPTS (5 greedy tokens each, the second
request with its 2 most likely tokens' log-probabilities) and writes its tokens and those
log-probabilities; the others follow its steps.
"""

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
port, num_processes, process_id, mesh_spec, out = sys.argv[1:6]
job = sys.argv[6] if len(sys.argv) > 6 else "generate"
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                           num_processes=int(num_processes), process_id=int(process_id))

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from mla_jax import sharding  # noqa: E402
from mla_jax.generation import generate  # noqa: E402
from mla_jax.models.config import tiny_moe_lm  # noqa: E402
from mla_jax.models.lm import CausalLM  # noqa: E402

IDS = np.random.default_rng(0).integers(0, 256, (2, 12)).astype(np.int32)

PROMPTS = [np.random.default_rng(1).integers(0, 256, n).tolist() for n in (5, 30, 12)]

mesh = sharding.make_mesh(mesh_spec)
model = CausalLM(tiny_moe_lm(), rngs=nnx.Rngs(0), backend="xla", mesh=mesh)
if job == "engine":
  from mla_jax.serving import Engine, SamplingParams  # noqa: E402

  engine = Engine(model, num_pages=16, page_size=8, max_num_seqs=4, max_step_tokens=16,
                  log_interval=None)
  if jax.process_index() == 0:
    params = [SamplingParams(max_tokens=5, logprobs=2 if i == 1 else None)
              for i in range(len(PROMPTS))]
    outputs = engine.generate(PROMPTS, params)
    engine.shutdown()
    top = [t.top for t in outputs[1].logprobs]
    np.savez(out, tokens=np.asarray([list(o.tokens) for o in outputs]),
             devices=jax.device_count(), prompt_ids=np.concatenate(PROMPTS),
             prompt_lens=[len(p) for p in PROMPTS], top_ids=[[i for i, _ in t] for t in top],
             top_logprobs=[[v for _, v in t] for t in top])
  else:
    engine.follow()
  sys.exit(0)
logits, _ = nnx.jit(lambda m, ids, c: m(ids, c, num_cached_tokens=0))(
    model, sharding.put(IDS, mesh, sharding.TOKENS_SPEC), model.init_cache(2, 24))
logits = sharding.fetch(logits)  # a collective: every process takes part
result = generate(model, IDS.tolist(), 6)
if jax.process_index() == 0:
  np.savez(out, logits=logits, tokens=np.asarray(result.tokens), devices=jax.device_count())
