"""The charts of `bench serving --plot` and benchmarks/ablation.py --plot (matplotlib, an optional extra)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from mlaserve.bench import plot

matplotlib = pytest.importorskip("matplotlib")
ROOT = Path(__file__).resolve().parents[2]


def read_png(path: Path):
    import matplotlib.image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return matplotlib.image.imread(str(path))


def test_serving_panels_take_one_point_per_level_and_skip_missing_values(tmp_path: Path):
    recs = [{"max_concurrency": c, "output_throughput": 10.0 * c, "total_throughput": 30.0 * c,
             "median_ttft_ms": 5.0 + c, "p99_ttft_ms": None if c == 16 else 9.0 + c, "median_tpot_ms": 2.0,
             "p99_tpot_ms": 3.0, "median_itl_ms": 2.0, "p99_itl_ms": 4.0} for c in (1, 16, 64)]
    panels = plot.serving_panels(recs)
    assert [p.title for p in panels] == ["throughput", "time to first token", "time per output token"]
    assert panels[0].lines["output"] == [(1.0, 10.0), (16.0, 160.0), (64.0, 640.0)]
    assert panels[1].lines["p99"][1] == (16.0, None)
    png = tmp_path / "s.png"
    plot.draw(panels, str(png), "title")
    img = read_png(png)
    assert img.shape[1] > 2 * img.shape[0]


def test_ablation_writes_a_chart_of_its_rows(tmp_path: Path, monkeypatch, capsys):
    """benchmarks/ablation.py --plot with the servers and clients faked (no model runs): one line per runnable row,
    the single-query TPS as its point at concurrency 1."""
    spec = importlib.util.spec_from_file_location("ablation", ROOT / "benchmarks" / "ablation.py")
    ablation = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ablation)

    class FakeServer:
        def __init__(self, args, flags):
            self.error, self.info, self.flags = ("boom" if "--enable-dp-attention" in flags else None), {}, flags

        def stop(self):
            pass

    drawn = {}
    monkeypatch.setattr(ablation, "Server", FakeServer)
    monkeypatch.setattr(ablation, "single", lambda server, args: 50.0 + len(server.flags))
    monkeypatch.setattr(ablation, "offline", lambda server, args, c: (100.0 * c, 40.0 / c) if c < 64 else "failed: X")
    monkeypatch.setattr(ablation, "draw_bars", lambda panels, path, title: drawn.update(panels=panels, path=path))
    png = tmp_path / "ablation.png"
    assert ablation.main(["--model-path", "m", "--tp", "2", "--concurrency", "4", "16", "64", "--plot", str(png)]) == 0
    single, throughput, per_req = drawn["panels"]
    runnable = [r.label() for r in ablation.ROWS if not r.dp]
    assert single.categories == throughput.categories == per_req.categories == runnable    # in the run's order
    some = ablation.ROWS[0]
    assert single.series == {"concurrency 1": [50.0 + len(r.flags(2)) for r in ablation.ROWS if not r.dp]}
    assert list(throughput.series) == ["concurrency 4", "concurrency 16"]      # the failed level is left out
    assert throughput.series["concurrency 16"][0] == 1600.0 and per_req.series["concurrency 4"][0] == 10.0
    assert some.label() == runnable[0]
    assert "| ❌ boom" in capsys.readouterr().out
    plot.draw_bars(drawn["panels"], str(png))                                # and the real chart renders
    img = read_png(png)
    assert img.shape[1] > img.shape[0]


def test_bars_leave_out_missing_values(tmp_path: Path):
    png = tmp_path / "b.png"
    plot.draw_bars([plot.BarPanel("t", "tok/s", ["a", "b"], {"x": [1.0, None], "y": [2.0, 3.0]})], str(png), "T")
    read_png(png)
