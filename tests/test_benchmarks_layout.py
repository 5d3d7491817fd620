"""benchmarks/ stays small and untangled (issue 48): no import cycle among its scripts, counting
imports inside functions, under ``TYPE_CHECKING`` and ``__import__("name")`` in a child's code (the
scripts import each other as top-level names: benchmarks/ is on sys.path when one runs), and no file
over 500 lines. The cycle search is the layering test's own."""

from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

from test_layering import find_cycle

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
MAX_LINES = 500


CHILD_IMPORT = re.compile(r"""(?:__import__|import_module)\(\s*['"]([\w.]+)['"]""")


def imported_names(source: str) -> set[str]:
    """Every top-level module name ``source`` imports, wherever the import is (also in the code it
    hands a child process: ``__import__('name')`` inside a string)."""
    out = {m.split(".")[0] for m in CHILD_IMPORT.findall(source)}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


def benchmark_graph(folder: Path = BENCHMARKS) -> dict[str, set[str]]:
    """Script -> the scripts of ``folder`` it imports."""
    scripts = {p.stem: p for p in folder.glob("*.py")}
    return {name: imported_names(p.read_text()) & set(scripts) - {name} for name, p in scripts.items()}


def test_no_import_cycle_among_the_benchmarks() -> None:
    cycle = find_cycle(benchmark_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_check_finds_a_circle_added_on_purpose(tmp_path: Path) -> None:
    """The same check over a copy of benchmarks/ with the old circle put back, inside a function:
    the job helpers importing a job that imports them."""
    copy = tmp_path / "benchmarks"
    shutil.copytree(BENCHMARKS, copy, ignore=shutil.ignore_patterns("__pycache__", "results"))
    cells = copy / "gpu_cells.py"
    cells.write_text(
        cells.read_text() + "\n\ndef _late() -> None:\n    from gpu_exact import job_exact  # noqa\n"
    )
    cycle = find_cycle(benchmark_graph(copy))
    assert cycle is not None and "gpu_cells" in cycle and "gpu_exact" in cycle, cycle


def test_the_graph_sees_the_imports_the_scripts_make() -> None:
    """The graph is not empty by mistake: what is known to import what is in it (a lazy import, a
    top-level one, and a child's ``__import__``)."""
    graph = benchmark_graph()
    assert {"gpu_jobs", "gpu_cells"} <= graph["gpu_bench"]  # job_main is imported inside main()
    assert "harness" in graph["serve_bench"] and "dense_reference" in graph["engine_bench"]


def test_no_file_in_benchmarks_over_500_lines() -> None:
    sizes = {
        p.name: len(p.read_text().splitlines()) for p in BENCHMARKS.iterdir() if p.suffix in (".py", ".sh")
    }
    over = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert not over, f"over {MAX_LINES} lines: {over}"
