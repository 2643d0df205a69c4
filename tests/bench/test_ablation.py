"""benchmarks/ablation.py's single-query TPS@1 against a faked server (no model runs): what it times."""
from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ablation():
    spec = importlib.util.spec_from_file_location("ablation", ROOT / "benchmarks" / "ablation.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class FakeServer:
    """A server with the radix cache: a prompt seen before is a cache hit, a different path from its first
    prefill; each path pays `compile_s` on its first use (the JIT compiles), then `per_token_s` a token."""

    def __init__(self, compile_s: float, per_token_s: float):
        self.model, self.compile_s, self.per_token_s = "m", compile_s, per_token_s
        self.prompts: set[str] = set()
        self.paths: set[str] = set()
        self.calls: list[tuple[str, int]] = []

    def client(self):
        return self

    def complete(self, prompt: str, max_tokens: int) -> tuple[int, int, float]:
        path = "hit" if prompt in self.prompts else "prefill"
        self.prompts.add(prompt)
        once = 0.0 if path in self.paths else self.compile_s
        self.paths.add(path)
        self.calls.append((prompt, max_tokens))
        return 20, max_tokens, once + max_tokens * self.per_token_s


def test_single_query_tps_leaves_out_every_first_use_cost(ablation, monkeypatch):
    """The radix hit's path compiles on its first use: that request is a warm-up, not the timed one."""
    server = FakeServer(compile_s=3.3, per_token_s=0.0025)
    monkeypatch.setattr(ablation, "complete", lambda client, model, prompt, max_tokens:
                        client.complete(prompt, max_tokens))
    args = argparse.Namespace(single_new=256, single_repeats=3)
    assert ablation.single(server, args) == pytest.approx(1 / 0.0025)
    warm = server.calls[: ablation.SINGLE_WARMUPS]
    assert len(server.calls) == ablation.SINGLE_WARMUPS + 3
    assert set(warm) == set(server.calls) == {(ablation.QUERY, 256)}     # the warm-ups are the timed request


def test_single_query_tps_is_the_median_of_the_timed_requests(ablation, monkeypatch):
    times = iter([9.0, 9.0, 2.0, 1.0, 4.0])                # two warm-ups, then three timed requests
    monkeypatch.setattr(ablation, "complete", lambda client, model, prompt, max_tokens:
                        (20, max_tokens, next(times)))
    server = FakeServer(0.0, 0.0)
    assert ablation.single(server, argparse.Namespace(single_new=100, single_repeats=3)) == pytest.approx(50.0)


def test_one_server_per_row_for_both_tables_and_rows_selected(ablation, monkeypatch, tmp_path, capsys):
    started, names = [], []

    class Started:
        error, info, model = None, {}, "m"

        def __init__(self, args, flags, name):
            started.append(flags)
            names.append(name)

        def stop(self):
            pass

    monkeypatch.setattr(ablation, "Server", Started)
    monkeypatch.setattr(ablation, "single", lambda server, args: 123.0)
    monkeypatch.setattr(ablation, "offline", lambda server, args, c: (10.0 * c, 1.0))
    out = tmp_path / "t.md"
    assert ablation.main(["--model-path", "m", "--tp", "1", "--rows", "13", "0", "--concurrency", "4", "8",
                          "--prompts-per-level", "0.5", "--out", str(out)]) == 0
    assert started == [ablation.ROWS[13].flags(1), ablation.ROWS[0].flags(1)]      # one start a row, in order
    assert names == ["row13", "row0"]                                               # (--server-logs' file names)
    text = capsys.readouterr().out
    assert text == out.read_text()
    single = [ln for ln in text.splitlines() if "123.0" in ln]
    offline = [ln for ln in text.splitlines() if "40.00<br>80.00" in ln]
    assert len(single) == 2 and len(offline) == 2
    assert offline[0].endswith("| 4<br>8 |")                   # max(c, 0.5 c) requests a level
    assert ablation.main(["--model-path", "m", "--rows", "16"]) == 2


def test_plot_from_merges_the_halves_points(ablation, tmp_path, monkeypatch):
    """Two device calls' --points files make one chart: every row's points, from both files."""
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text('{"throughput": {"graph": [[256, 5000.0]]}, "per_req": {"graph": [[1, 90.0], [256, 20.0]]}}')
    b.write_text('{"throughput": {"graph + ep": [[256, 6000.0]]}, "per_req": {"graph + ep": [[1, 80.0]]}}')
    drawn = {}
    monkeypatch.setattr(ablation, "missing_matplotlib", lambda: None)
    monkeypatch.setattr(ablation, "draw_bars", lambda panels, path, title: drawn.update(panels=panels, title=title))
    assert ablation.main(["--plot-from", str(a), str(b), "--plot", str(tmp_path / "x.png"), "--title", "T"]) == 0
    single, throughput, per_req = drawn["panels"]
    assert single.categories == ["graph", "graph + ep"] and drawn["title"] == "T"
    assert single.series == {"concurrency 1": [90.0, 80.0]}
    assert throughput.series == {"concurrency 256": [5000.0, 6000.0]}
    assert per_req.series == {"concurrency 256": [20.0, None]}
    assert ablation.main(["--plot-from", str(a)]) == 2                      # no --plot: nothing to draw to
    again = tmp_path / "c.json"                                    # a later call measured "graph" at 1 again
    again.write_text('{"throughput": {}, "per_req": {"graph": [[1, 95.0]]}}')
    assert ablation.main(["--plot-from", str(a), str(b), str(again), "--plot", str(tmp_path / "y.png")]) == 0
    single, throughput, per_req = drawn["panels"]
    assert single.series == {"concurrency 1": [95.0, 80.0]} and per_req.series == {"concurrency 256": [20.0, None]}


def test_server_logs_are_kept_where_asked(ablation, tmp_path):
    """--server-logs DIR: a row's server log stays as DIR/rowN.log; a server that does not start reports its last
    line as the row's error."""
    args = argparse.Namespace(model_path=str(tmp_path / "nowhere"), port=30999, serve_args="", start_timeout=120.0,
                              server_logs=str(tmp_path))
    server = ablation.Server(args, [], "row7")
    assert server.error is not None and "no such directory" in server.error, server.error
    assert "no such directory" in (tmp_path / "row7.log").read_text()


def test_plot_of_the_offline_table_alone_draws_no_empty_single_query_panel(ablation, tmp_path, monkeypatch):
    """Points of `--table offline` runs have no TPS@1: the chart has the two offline panels, titled by its files."""
    a = tmp_path / "call6b.json"
    a.write_text('{"throughput": {"graph": [[768, 9000.0]]}, "per_req": {"graph": [[768, 7.0]]}}')
    drawn = {}
    monkeypatch.setattr(ablation, "missing_matplotlib", lambda: None)
    monkeypatch.setattr(ablation, "draw_bars", lambda panels, path, title: drawn.update(panels=panels, title=title))
    assert ablation.main(["--plot-from", str(a), "--plot", str(tmp_path / "x.png")]) == 0
    assert [p.title for p in drawn["panels"]] == ["offline throughput (p + d)", "per-request throughput (d)"]
    assert drawn["title"] == "ablation: call6b"
