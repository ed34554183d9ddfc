"""Load on ``mla-jax serve``: N concurrent streaming clients x M requests each, on 127.0.0.1.

    python benchmarks/serve_load.py                    # recall preset, 32 clients x 8, 3 repeats
    python benchmarks/serve_load.py --clients 4 --requests 2 --repeats 2   # a quick look

It starts the server as a subprocess on a free loopback port (the server compiles every step
program before it listens: ``Engine.warmup``), runs the load ``--warmup`` times unreported,
then ``--repeats`` times, and stops the server with SIGTERM. Each request streams a completion (official ``openai``
client, temperature 0, ``--max-tokens`` tokens, prompts of 16-256 bytes). Per repeat it reports
output tokens/s over the wall time, time to first token and whole-request latency at p50/p99,
errors (goal 0), pages still in use once every request is done (goal 0: from ``/metrics``), the
step programs compiled so far and during the repeat (goal 0: a compile while serving stalls
every request in flight), and the server's RSS before and after (goal: no growth from one repeat to the next once warm). Every
request has a timeout, the run stops by itself, and nothing leaves the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import openai

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def rss_mb(pid: int) -> float:
  status = Path(f"/proc/{pid}/status").read_text()
  return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M).group(1)) / 1024


def metric(url: str, name: str) -> float:
  text = httpx.get(f"{url}/metrics", timeout=10).text
  return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def start_server(args) -> tuple[subprocess.Popen, str]:
  port = free_port()
  command = [sys.executable, "-m", "mla_jax", "serve", "--preset", args.preset,
             "--port", str(port), "--num-pages", str(args.num_pages),
             "--max-num-seqs", str(args.max_num_seqs), "--log-interval", "1000"]
  if args.warmup_every_reach:
    command.append("--warmup-every-reach")
  proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
  url = f"http://127.0.0.1:{port}"
  # The server compiles its step programs first (about 7x as many at every reach).
  start_s = 3600 if args.warmup_every_reach else 600
  deadline = time.monotonic() + start_s
  while time.monotonic() < deadline:
    if proc.poll() is not None:
      raise SystemExit(f"the server exited: {proc.stderr.read()}")
    with contextlib.suppress(httpx.HTTPError):
      if httpx.get(f"{url}/health", timeout=1).status_code == 200:
        return proc, url
    time.sleep(0.3)
  proc.kill()
  raise SystemExit(f"the server did not come up in {start_s} s")


def prompts(rng: np.random.Generator, n: int) -> list[str]:
  letters = np.array(list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ .?"))
  lengths = np.exp(rng.uniform(np.log(16), np.log(256), n)).astype(int)
  return ["".join(rng.choice(letters, size=k)) for k in lengths]


async def one_client(client, model: str, texts: list[str], max_tokens: int, timeout: float):
  """Requests ``texts`` one after another: per request (ttft, latency, tokens) or an error."""
  results = []
  for text in texts:
    t0 = time.perf_counter()
    first, tokens = None, 0
    try:
      stream = await asyncio.wait_for(client.completions.create(
          model=model, prompt=text, max_tokens=max_tokens, temperature=0, stream=True,
          stream_options={"include_usage": True}), timeout)
      async for chunk in stream:
        if chunk.choices and chunk.choices[0].text and first is None:
          first = time.perf_counter() - t0
        if chunk.usage is not None:
          tokens = chunk.usage.completion_tokens
      results.append((first, time.perf_counter() - t0, tokens))
    except Exception as e:  # noqa: BLE001 - counted, reported
      results.append(e)
  return results


async def one_repeat(url: str, args, texts: list[list[str]]):
  client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                              timeout=args.timeout)
  t0 = time.perf_counter()
  per_client = await asyncio.gather(*(one_client(client, args.preset, t, args.max_tokens,
                                                 args.timeout) for t in texts))
  wall = time.perf_counter() - t0
  await client.close()
  return [r for results in per_client for r in results], wall


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", default="recall")
  parser.add_argument("--clients", type=int, default=32)
  parser.add_argument("--requests", type=int, default=8, help="per client")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--warmup", type=int, default=1, help="unreported runs of the load first")
  parser.add_argument("--max-tokens", type=int, default=32)
  parser.add_argument("--num-pages", type=int, default=512)
  parser.add_argument("--warmup-every-reach", action="store_true",
                      help="the server warms up every key-block bucket (nothing compiles "
                           "while serving)")
  parser.add_argument("--max-num-seqs", type=int, default=32)
  parser.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  rng = np.random.default_rng(args.seed)
  texts = [prompts(rng, args.requests) for _ in range(args.clients)]
  proc, url = start_server(args)
  rows = []
  try:
    for _ in range(args.warmup):
      asyncio.run(one_repeat(url, args, texts))
    for repeat in range(args.repeats):
      before, programs = rss_mb(proc.pid), metric(url, "mla_jax_step_programs")
      results, wall = asyncio.run(one_repeat(url, args, texts))
      done = [r for r in results if not isinstance(r, Exception)]
      errors = [r for r in results if isinstance(r, Exception)]
      ttft = [r[0] for r in done if r[0] is not None]
      latency = [r[1] for r in done]
      tokens = sum(r[2] for r in done)
      leaked = metric(url, "mla_jax_pages_in_use")
      rows.append([repeat + 1, len(results), f"{tokens / wall:.0f}",
                   *(f"{1e3 * v:.0f}" for v in np.percentile(ttft or [np.nan], [50, 99])),
                   *(f"{1e3 * v:.0f}" for v in np.percentile(latency or [np.nan], [50, 99])),
                   f"{np.percentile(ttft or [np.nan], 99) / np.median(ttft or [np.nan]):.1f}x",
                   len(errors), f"{leaked:.0f}", f"{metric(url, 'mla_jax_step_programs'):.0f}",
                   f"{metric(url, 'mla_jax_step_programs') - programs:.0f}",
                   f"{before:.0f}", f"{rss_mb(proc.pid):.0f}"])
      if errors:
        print(f"repeat {repeat + 1}: first error: {errors[0]!r}", file=sys.stderr)
  finally:
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=120)
  header = ["repeat", "requests", "output tok/s", "TTFT p50 ms", "TTFT p99 ms",
            "latency p50 ms", "latency p99 ms", "TTFT p99 / p50", "errors", "pages leaked",
            "programs", "compiled during the repeat", "RSS before MB", "RSS after MB"]
  print(f"mla-jax serve --preset {args.preset}: {args.clients} concurrent streaming clients x "
        f"{args.requests} requests, {args.max_tokens} tokens each, greedy, after {args.warmup} "
        f"warm-up run(s); server exit code {code} after SIGTERM")
  print("| " + " | ".join(header) + " |")
  print("|" + "---|" * len(header))
  for row in rows:
    print("| " + " | ".join(str(v) for v in row) + " |")


if __name__ == "__main__":
  main()
