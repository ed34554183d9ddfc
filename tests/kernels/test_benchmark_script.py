"""benchmarks/kernels.py, the script gpu_check.sh runs on a GPU: its check compares against
float32, and a shape whose reference cannot run still gets the kernel's row."""

import pytest

from benchmarks import kernels


def test_check_passes_a_correct_kernel_and_reports_both_errors(capsys):
  with pytest.raises(SystemExit) as done:
    kernels.main(["--check", "--iters", "0", "--only", "tiny_decode_b4_fp8"])
  assert done.value.code == 0
  row = [line for line in capsys.readouterr().out.splitlines() if "tiny_decode_b4_fp8" in line]
  assert row and "| ok " in row[0] and "(XLA bf16 " in row[0]


def test_check_fails_a_wrong_kernel(monkeypatch, capsys):
  right = kernels.sparse_mqa

  def off_by_ten_percent(*args, **kw):
    out, lse = right(*args, **kw)
    return out * 1.1, lse

  monkeypatch.setattr(kernels, "sparse_mqa", off_by_ten_percent)
  with pytest.raises(SystemExit) as done:
    kernels.main(["--check", "--iters", "0", "--only", "tiny_decode_b4"])
  assert done.value.code == 1
  assert "MISMATCH" in capsys.readouterr().out
