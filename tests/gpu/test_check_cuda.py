"""The GPU check script runs (on the CPU here, on CUDA where there is one) and finds nothing wrong."""

from __future__ import annotations

import pytest
import torch

from . import check_cuda


def test_quick_check_on_the_cpu_finds_nothing_wrong(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # the Triton rows run in the interpreter on the CPU; keep them short
    monkeypatch.setattr(check_cuda, "KERNEL_SPECS", [{"T": 70, "C": 3, "seed": 1, "impl": "torch"}])
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    status = check_cuda.main(["--device", "cpu", "--quick"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert " | WRONG | " not in out and " | CRASH | " not in out
    assert out.count(" | ok | ") >= len(check_cuda.CASES) + len(check_cuda.nn_cases())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_full_check_on_cuda() -> None:
    assert check_cuda.main(["--device", "cuda"]) == 0


def test_shards_run_each_row_once(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(check_cuda, "KERNEL_SPECS", [{"T": 5, "C": 2, "seed": 1, "impl": "torch"}])
    monkeypatch.setattr(check_cuda, "LAX_SPECS", {"scan": [{"T": 3, "C": 1, "seed": 1}], "cond": [{"T": 1, "C": 1, "seed": 1}]})
    cells = []
    for shard in ("0/1", "0/2", "1/2"):
        assert check_cuda.main(["--device", "cpu", "--quick", "--shard", shard]) == 0
        cells.append(sorted(line for line in capsys.readouterr().out.splitlines() if " | ok | " in line))
    strip = lambda lines: sorted(line.rsplit(" | ", 3)[0] for line in lines)  # without time and errors
    assert len(cells[0]) == 1 + 2 + len(check_cuda.nn_cases())
    assert strip(cells[1] + cells[2]) == strip(cells[0]) and cells[1] and cells[2]
    assert check_cuda.main(["--device", "cpu", "--quick", "--only", "lax.cond"]) == 0
    assert [line.split(" | ")[0] for line in capsys.readouterr().out.splitlines() if " | ok | " in line] == ["lax.cond T=1 C=1"]
    with pytest.raises(SystemExit):
        check_cuda.main(["--device", "cpu", "--shard", "2/2"])


@pytest.mark.parametrize("name", ["scan", "associative_scan"])
def test_the_replayed_training_step_path_runs_on_the_cpu(name: str) -> None:
    """check_cuda's `inductor+grad+graphs` path (the training step with cuda_graphs=True, called
    three times) gives the float64 oracle's values on the CPU too, where no graph is recorded: the
    path's code cannot rot between GPU runs."""
    from ..differential import harness

    out_err, grad_err = harness.compare(name, {"T": 5, "C": 3, "seed": 1}, "inductor+grad+graphs", torch.float32, "cpu")
    assert out_err <= harness.TOLERANCE[torch.float32][0] and grad_err <= harness.TOLERANCE[torch.float32][1]
