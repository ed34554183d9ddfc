"""Memory and reads of streamed checkpoint loading, on a generated checkpoint of about 2 GB.

    python benchmarks/load.py                      # writes, measures, deletes /tmp/mla_jax_load
    python benchmarks/load.py --dir DIR --keep     # keep the checkpoint for another run

Three steps, each in a fresh process so that one step's memory does not blur the next:

1. write: a wide bf16 model (hidden 4096, vocabulary 32000, 2 dense + 2 MoE layers of 8
   experts) saved by ``save_pretrained`` as a sharded checkpoint (1 GB files);
2. rss: one process loads it onto one CPU device. Baseline RSS (jax and mla_jax imported,
   the device up) against the peak while loading, and the largest tensor. On CPU the loaded
   parameters live in host memory too, so the overhead is peak - baseline - parameters. RSS
   counts the checkpoint's memory-mapped pages once touched (``RssFile``: page cache, shared
   and reclaimable); anonymous memory (``RssAnon``) is what the loader itself holds, sampled
   every millisecond and after every tensor read;
3. two processes x 2 CPU devices (jax.distributed over gloo on 127.0.0.1) load it onto one
   mesh, each counting the bytes it reads (benchmarks/multiprocess_load_worker.py); a piece that
   both of a process's devices hold (replicated over the other axis) is read once but held
   twice.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MESHES = ("data=1,tensor=2,expert=2", "data=1,tensor=1,expert=4")


def wide_config():
  from mla_jax.config import IndexerConfig, MLAConfig, RopeConfig
  from mla_jax.models.config import ModelConfig, MoEConfig

  mla = MLAConfig(hidden_size=4096, num_heads=32, q_lora_rank=1536, kv_lora_rank=512,
                  qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                  rope=RopeConfig(theta=10000.0), max_position_embeddings=4096,
                  indexer=IndexerConfig(num_heads=32, head_dim=128, topk=64))
  moe = MoEConfig(num_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                  n_shared_experts=1, moe_intermediate_size=1408)
  return ModelConfig(mla=mla, vocab_size=32000, num_layers=4, intermediate_size=11008, moe=moe,
                     first_k_dense_replace=2)


def write(directory: Path) -> None:
  import jax.numpy as jnp
  from flax import nnx

  from mla_jax.checkpoints import save_pretrained
  from mla_jax.models.lm import CausalLM

  model = CausalLM(wide_config(), rngs=nnx.Rngs(0), backend="xla", param_dtype=jnp.bfloat16)
  save_pretrained(model, directory, max_shard_bytes=1 << 30)


def _status() -> dict[str, int]:
  """RSS fields of /proc/self/status in bytes."""
  fields = {}
  for line in Path("/proc/self/status").read_text().splitlines():
    key, _, value = line.partition(":")
    if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
      fields[key] = int(value.split()[0]) * 1024
  return fields


def measure_rss(directory: Path) -> dict:
  import jax
  from flax import nnx

  from mla_jax.checkpoints import load_pretrained, open_checkpoint, reading

  jax.devices()
  tensors = open_checkpoint(directory)
  largest = max(tensors, key=lambda name: tensors[name].nbytes)
  total = sum(handle.nbytes for handle in tensors.values())
  baseline = _status()
  peak_anon = baseline["RssAnon"]
  done = threading.Event()

  def sample():
    nonlocal peak_anon
    while not done.is_set():
      peak_anon = max(peak_anon, _status()["RssAnon"])
      time.sleep(0.001)

  read = reading.SafetensorsFile.read

  def read_and_sample(self, name, index=()):
    nonlocal peak_anon
    data = read(self, name, index)
    peak_anon = max(peak_anon, _status()["RssAnon"])  # the slice is in memory now
    return data

  reading.SafetensorsFile.read = read_and_sample
  sampler = threading.Thread(target=sample, daemon=True)
  sampler.start()
  start = time.perf_counter()
  model = load_pretrained(directory, backend="xla")
  seconds = time.perf_counter() - start
  done.set()
  sampler.join()
  after = _status()
  params = sum(var[...].nbytes for _, var in nnx.state(model, nnx.Param).flat_state())
  return {"checkpoint_bytes": total, "largest_tensor": largest,
          "largest_tensor_bytes": tensors[largest].nbytes, "param_bytes": params,
          "baseline": baseline, "after": after, "peak_anon": peak_anon, "load_s": seconds}


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def measure_processes(directory: Path, mesh: str, out: Path) -> list[dict]:
  worker = ROOT / "benchmarks" / "multiprocess_load_worker.py"
  port = _free_port()
  env = {**os.environ, "PYTHONPATH": str(ROOT)}
  procs = [subprocess.Popen([sys.executable, str(worker), str(port), "2", str(i),
                             str(directory), mesh, "default", str(out), "--no-save"], env=env)
           for i in range(2)]
  if any(p.wait(timeout=3600) for p in procs):
    raise SystemExit("a load worker failed")
  return [json.loads((out / f"p{i}.json").read_text()) for i in range(2)]


def _gb(b: int) -> str:
  return f"{b / 1e9:.2f} GB"


def report(rss: dict, workers: dict[str, list[dict]]) -> str:
  base, after = rss["baseline"], rss["after"]
  overhead = after["VmHWM"] - base["VmRSS"] - rss["param_bytes"]
  anon_overhead = rss["peak_anon"] - base["RssAnon"] - rss["param_bytes"]
  lines = [
      f"checkpoint: {_gb(rss['checkpoint_bytes'])} of bf16 safetensors; largest tensor "
      f"{rss['largest_tensor']} {_gb(rss['largest_tensor_bytes'])}",
      "",
      "| one process, one CPU device | bytes |", "|---|---|",
      f"| baseline RSS (jax + mla_jax imported, device up) | {_gb(base['VmRSS'])} |",
      f"| parameters loaded (they live in host memory on CPU) | {_gb(rss['param_bytes'])} |",
      f"| peak RSS while loading (VmHWM, includes mapped file pages) | {_gb(after['VmHWM'])} |",
      f"| RSS after loading: anonymous / mapped file pages | {_gb(after['RssAnon'])} / "
      f"{_gb(after['RssFile'])} |",
      f"| peak RSS - baseline - parameters | {_gb(overhead)} |",
      f"| peak anonymous RSS - baseline - parameters (loader's own memory) | "
      f"{_gb(anon_overhead)} ({anon_overhead / rss['largest_tensor_bytes']:.2f} x the largest "
      "tensor) |",
      f"| load time | {rss['load_s']:.1f} s |",
      "",
      "| 2 processes x 2 CPU devices | process | routed experts held | bytes read (of the "
      "checkpoint) | parameter bytes on its 2 devices | peak RSS | load time |",
      "|---|---|---|---|---|---|---|",
  ]
  for mesh, reports in workers.items():
    for i, w in enumerate(reports):
      read = sum(w["bytes_read"].values())
      lines.append(f"| {mesh} | {i} | {w['experts']} | {_gb(read)} "
                   f"({read / rss['checkpoint_bytes']:.0%}) | {_gb(w['held_bytes'])} | "
                   f"{_gb(w['peak_rss'])} | {w['load_s']:.1f} s |")
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("step", nargs="?", choices=("write", "rss"), help=argparse.SUPPRESS)
  parser.add_argument("--dir", type=Path, default=Path("/tmp/mla_jax_load"))
  parser.add_argument("--keep", action="store_true", help="keep the checkpoint afterwards")
  args = parser.parse_args(argv)
  checkpoint = args.dir / "checkpoint"
  if args.step == "write":
    write(checkpoint)
    return
  if args.step == "rss":
    print(json.dumps(measure_rss(checkpoint)))
    return
  env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
  me = [sys.executable, str(Path(__file__).resolve())]
  if not (checkpoint / "config.json").exists():
    subprocess.run([*me, "write", "--dir", str(args.dir)], check=True, env=env)
  rss = json.loads(subprocess.run([*me, "rss", "--dir", str(args.dir)], check=True, env=env,
                                  stdout=subprocess.PIPE).stdout.decode().splitlines()[-1])
  workers = {mesh: measure_processes(checkpoint, mesh, args.dir) for mesh in MESHES}
  print(report(rss, workers))
  if not args.keep:
    shutil.rmtree(args.dir)


if __name__ == "__main__":
  main()
