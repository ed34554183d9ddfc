"""One process of a multi-process checkpoint load (started by benchmarks/load.py and
tests/test_checkpoint_streaming.py).

Usage: python benchmarks/multiprocess_load_worker.py PORT NUM_PROCESSES PROCESS_ID CHECKPOINT MESH
       DTYPE OUT_DIR [--no-save]
Each process has 2 CPU devices; together they form one mesh. Each process loads the
checkpoint onto it, writes OUT_DIR/p{ID}.json (the bytes it read per file, the routed experts
and parameter bytes its devices hold, its peak RSS after loading and the load time) and, unless --no-save, saves
the gathered model to OUT_DIR/p{ID} (a collective: every process takes part).
"""

import json
import os
import resource
import sys
import time
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
port, num_processes, process_id, checkpoint, mesh_spec, dtype, out = sys.argv[1:8]
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                           num_processes=int(num_processes), process_id=int(process_id))

from flax import nnx  # noqa: E402

from mla_jax import sharding  # noqa: E402
from mla_jax.checkpoints import loading, save_pretrained  # noqa: E402
from mla_jax.models.hf_layout import param_layouts  # noqa: E402

opened = []
open_checkpoint = loading.open_checkpoint
loading.open_checkpoint = lambda path: opened.append(open_checkpoint(path)) or opened[-1]

start = time.perf_counter()
model = loading.load_pretrained(checkpoint, dtype=None if dtype == "default" else dtype,
                                backend="xla", mesh=sharding.make_mesh(mesh_spec))
load_s = time.perf_counter() - start
peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # before saving gathers
experts, held = set(), 0
state = nnx.state(model, nnx.Param)
for _, var in state.flat_state():
  held += sum(shard.data.nbytes for shard in var[...].addressable_shards)
for path, layout in param_layouts(state).items():
  if "expert" in layout.leading:
    array = dict(state.flat_state())[path][...]
    for shard in array.addressable_shards:
      experts.update(range(*shard.index[layout.leading.index("expert")].indices(
          array.shape[layout.leading.index("expert")])))
(Path(out) / f"p{process_id}.json").write_text(json.dumps({
    "bytes_read": opened[0].bytes_read, "experts": sorted(experts), "held_bytes": held,
    "load_s": load_s, "peak_rss": peak_rss}))
if "--no-save" not in sys.argv[8:]:
  save_pretrained(model, Path(out) / f"p{process_id}")
