"""Folding per-node results for people (cluster.report.fold) and the folded tables built on it."""

from __future__ import annotations

import io

from rich.console import Console

from cluster.report.fold import Row, compress, distinct_fixes, exact, fold, grid_fits, nodes_text, shape
from cluster.nodes.remote import CommandResult
from cluster.report.render import command_results_folded, fix_lines, folded_table


def _rows(n: int, bad: dict[int, str]):
    for i in range(1, n + 1):
        if i in bad:
            yield Row(f"node{i}", "gpudirect", "fail", bad[i], "modprobe nvidia_peermem")
        else:
            yield Row(f"node{i}", "gpudirect", "ok", "peer memory loaded")
        yield Row(f"node{i}", "clock", "ok", f"synchronized (offset +0.{i:02d} ms)")


def test_identical_results_fold_and_failures_keep_their_nodes():
    groups = fold(_rows(128, {37: "peer-memory module not loaded"}))
    assert [(g.key, g.status, g.count) for g in groups] == [
        ("gpudirect", "fail", 1), ("gpudirect", "ok", 127), ("clock", "ok", 128)]
    clock = groups[2]
    assert clock.varies and clock.summary.startswith("synchronized")
    assert nodes_text(groups[0], 128) == "node37"
    assert nodes_text(clock, 128) == "all 128 nodes"


def test_distinct_failures_stay_apart_and_fixes_are_listed_once():
    groups = fold(_rows(6, {2: "module missing", 3: "module missing", 5: "other reason"}))
    fails = [g for g in groups if g.status == "fail"]
    assert [(g.summary, g.nodes) for g in fails] == [("module missing", ("node2", "node3")),
                                                     ("other reason", ("node5",))]
    fixes = distinct_fixes(groups)
    assert fixes == [("gpudirect", "modprobe nvidia_peermem", ("node2", "node3", "node5"))]


def test_numbers_do_not_fold_for_problems():
    rows = [Row("a1", "clock", "fail", "clock 7.8 s off"), Row("a2", "clock", "fail", "clock 9.1 s off")]
    assert len(fold(rows)) == 2
    assert shape("clock 7.8 s off, 12 ms") == "clock # s off, # ms"


def test_exact_label_keeps_outputs_apart():
    rows = [Row(f"n{i}", "out", "ok", f"n{i}") for i in range(3)]
    assert len(fold(rows, label=exact)) == 3
    assert len(fold(rows)) == 1


def test_compress_like_dshbak():
    assert compress(["node1", "node2", "node3", "node7", "gpu-a", "node9"]) == "node[1-3,7,9],gpu-a"
    assert compress(["node5"]) == "node5"
    assert compress(["n01", "n02"]) == "n[01-02]"  # zero-padded names keep their width
    many = [f"r{i}n1" for i in range(30)]
    assert "(+" in compress(many, limit=5)


def test_grid_only_while_it_fits():
    assert grid_fits(3, 120) and not grid_fits(3, 80) and not grid_fits(128, 400)


def _render(renderable) -> str:
    console = Console(file=io.StringIO(), width=100, force_terminal=False)
    console.print(renderable)
    return console.file.getvalue()


def test_folded_preflight_at_1000_nodes_stays_short():
    rows = list(_rows(1000, {37: "peer-memory module not loaded"}))
    groups = fold(rows)
    text = _render(folded_table(groups, 1000, title="preflight"))
    assert len(text.splitlines()) < 15
    assert "node37" in text and "all 1000 nodes" in text and "999 nodes" in text
    fixes = [_render(line) for line in fix_lines(groups, 1000)]
    assert len(fixes) == 1 and "node37" in fixes[0] and "modprobe" in fixes[0]


def test_exec_outputs_fold_like_dshbak_and_cap_distinct_blocks():
    results = [CommandResult(f"node{i}", "uname", 0, "Linux\n", "", 0.1, "ok")
               for i in range(1, 101)]
    results.append(CommandResult("node101", "uname", None, "", "", 5.0, "unreachable",
                                 "node101: connect timed out"))
    parts = command_results_folded(results, title="$ uname")
    text = "".join(_render(p) for p in parts)
    assert "100 nodes" in text and "node101" in text and "connect timed out" in text
    distinct = [CommandResult(f"node{i}", "hostname", 0, f"node{i}\n", "", 0.1, "ok")
                for i in range(1, 61)]
    parts = command_results_folded(distinct)
    assert len(parts) == 2 and "20 more distinct outputs" in _render(parts[1])
