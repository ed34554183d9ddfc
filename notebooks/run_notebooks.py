"""Executes the notebooks top to bottom with nbclient; exit status 1 if any cell errors.

    python notebooks/run_notebooks.py                 # run both, leave the files untouched
    python notebooks/run_notebooks.py --small         # MLA_NOTEBOOK_SMALL=1 (CI sizes)
    python notebooks/run_notebooks.py --jobs 2        # two notebooks at once (two kernels)
    python notebooks/run_notebooks.py --write         # save the executed outputs into the .ipynb
    python notebooks/run_notebooks.py compare_routes.ipynb --timeout 900

The kernel is the current interpreter (a kernel spec written to a temporary JUPYTER_PATH
entry; nothing is installed). The repository root is put on the kernel's PYTHONPATH and the
kernel starts in ``notebooks/``. Saved notebooks name the standard ``python3`` kernel.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
NOTEBOOKS = ("compare_routes.ipynb", "misrouting.ipynb", "retrieval_probe.ipynb")
KERNEL_NAME = "mla-jax-current-python"


def kernel_for_this_interpreter() -> str:
  """A kernel spec that runs ``sys.executable``, written to a temporary JUPYTER_PATH entry.

  The stock ``python3`` spec runs whatever ``python`` is first on PATH, which need not be this
  interpreter; a private spec avoids that without installing anything for the user.
  """
  spec_dir = os.path.join(tempfile.mkdtemp(prefix="mla_jax_kernels_"), "kernels", KERNEL_NAME)
  os.makedirs(spec_dir)
  with open(os.path.join(spec_dir, "kernel.json"), "w") as f:
    json.dump({"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
               "display_name": "Python 3 (mla_jax)", "language": "python"}, f)
  os.environ["JUPYTER_PATH"] = os.pathsep.join(
      p for p in (os.path.dirname(os.path.dirname(spec_dir)), os.environ.get("JUPYTER_PATH", ""))
      if p)
  return KERNEL_NAME


def run_notebook(path: str, *, kernel: str, timeout: int, write: bool) -> tuple[bool, float, str]:
  """Executes one notebook; returns (ok, seconds, error summary)."""
  import nbformat
  from nbclient import NotebookClient
  from nbclient.exceptions import CellExecutionError

  nb = nbformat.read(path, as_version=4)
  client = NotebookClient(nb, kernel_name=kernel, timeout=timeout, allow_errors=False,
                          resources={"metadata": {"path": HERE}})
  t0 = time.perf_counter()
  ok, error = True, ""
  try:
    client.execute()
  except CellExecutionError as exc:
    ok, error = False, str(exc)
  except Exception as exc:  # a dead kernel, a timeout: still a failure, not a crash
    ok, error = False, f"{type(exc).__name__}: {exc}"
  seconds = time.perf_counter() - t0
  if write and ok:
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nbformat.write(nb, path)
  return ok, seconds, error


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("notebooks", nargs="*", default=list(NOTEBOOKS),
                      help="notebook file names under notebooks/ (default: all)")
  parser.add_argument("--small", action="store_true", help="set MLA_NOTEBOOK_SMALL=1")
  parser.add_argument("--write", action="store_true",
                      help="save executed outputs back into each .ipynb (only if it ran clean)")
  parser.add_argument("--timeout", type=int, default=600, help="seconds per cell")
  parser.add_argument("--jobs", type=int, default=1,
                      help="notebooks run at once, each in its own kernel (default 1)")
  args = parser.parse_args(argv)
  if args.jobs < 1:
    parser.error(f"--jobs must be at least 1, got {args.jobs}")

  os.environ["MLA_NOTEBOOK_SMALL"] = "1" if args.small else "0"
  os.environ["PYTHONPATH"] = os.pathsep.join(
      p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
  kernel = kernel_for_this_interpreter()
  def run(name):
    path = name if os.path.isabs(name) else os.path.join(HERE, name)
    return name, run_notebook(path, kernel=kernel, timeout=args.timeout, write=args.write)

  results = {}
  with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:  # kernels are processes
    done = pool.map(run, args.notebooks)
  for name, (ok, seconds, error) in done:
    results[name] = {"ok": ok, "seconds": round(seconds, 1)}
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {seconds:.1f} s"
          f"{' (written)' if args.write and ok else ''}", flush=True)
    if not ok:
      print(error[-4000:], file=sys.stderr)
  print(json.dumps({"small": args.small, "kernel": kernel, "results": results}))
  return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
  sys.exit(main())
