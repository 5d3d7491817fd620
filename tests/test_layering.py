"""The one-way dependency rule holds in the source and when Python imports the modules.

router -> scheduler, batchstore; batch -> router, batchstore; batchstore -> scheduler; worker -> engine,
scheduler, cache_transfer; engine -> cache_transfer; localredis (our own redis-server processes) -> none;
scheduler, cache_transfer and engine import none of the upper layers; the router never imports
engine or worker code (docs/design.md, "Layout"). ``errors``, ``flags``, ``sampling_params``,
``block_hash`` and ``tokenizer`` are leaves every layer may use; ``cli``, ``cli_commands``, ``stack``,
``status``, ``bench`` and the package root are the composition root and may import anything. No
import cycle inside the package, counting imports inside functions and under ``TYPE_CHECKING``.
Inside the engine: the core, ``models/`` and ``tiers/`` name no tensor library and no platform
package, ``cpu/`` (Paddle) never names torch, Triton or ``cuda/``, ``cuda/`` (torch) never names
Paddle, numba or ``cpu/``; ``platform`` is the seam, naming the platforms inside functions only.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "pdserve"
LEAVES = {"errors", "flags", "sampling_params", "block_hash", "tokenizer", "grammar_limits", "priority"}
ALLOWED = {  # layer -> the pdserve layers its modules may import
    "errors": set(),
    "flags": set(),
    "sampling_params": {"errors", "block_hash"},
    "block_hash": set(),  # the prefix cache's block ids: the engine's and the router's
    "tokenizer": {"errors"},  # the engine tokenizes what it runs; a router, for prefix routing
    "grammar_limits": {"errors"},  # what a schema may cost to prepare: router and worker judge alike
    "priority": set(),  # preparation threads at a lower OS priority: router and worker
    "scheduler": {"scheduler", *LEAVES},
    "batchstore": {"batchstore", "scheduler", *LEAVES},  # the Batch API's files, batches and queue
    "localredis": {"localredis", *LEAVES},  # redis-server processes of our own (up, pdserve redis, tests)
    "cache_transfer": {"cache_transfer", "errors"},
    "engine": {"engine", "cache_transfer", *LEAVES},
    "router": {"router", "scheduler", "batchstore", *LEAVES},
    "worker": {"worker", "engine", "scheduler", "cache_transfer", *LEAVES},
    "batch": {"batch", "router", "scheduler", "batchstore", *LEAVES},  # a router without a listener, on rq
    "planner": {"planner", "scheduler", *LEAVES},  # roles while serving: reads Redis, sends SetRole
}
NO_PADDLE = (
    "batch",
    "planner",
    "batchstore",
    "localredis",
    "scheduler",
    "cache_transfer",
    "router",
    "errors",
    "flags",
    "sampling_params",
    "block_hash",
    "tokenizer",
)
# third-party packages a layer must not import: the engine computes; serving is the worker's job
FORBIDDEN_PACKAGES = {"engine": ("redis", "asyncio", "fastapi", "starlette", "uvicorn", "httpx")}


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


MODULES = sorted(module_name(p) for p in PACKAGE.rglob("*.py"))


def imports(path: Path) -> list[tuple[int, str]]:
    """Every module an import statement names, at module level or inside functions."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path}:{node.lineno}: use absolute imports"
            names = [f"{node.module}.{a.name}" for a in node.names]
            # `from pdserve.x import y`: y may be a module (pdserve.x.y) or a name in pdserve.x
            found += [
                (node.lineno, n if n in MODULES or node.module == "pdserve" else node.module) for n in names
            ]
    return found


def test_every_module_has_a_layer() -> None:
    for path in PACKAGE.rglob("*.py"):
        assert is_composition_root(path) or layer(module_name(path)) in ALLOWED, path


def is_composition_root(path: Path) -> bool:
    # cli, cli_commands, stack, status, bench, the package
    return path.parent == PACKAGE and path.stem not in LEAVES


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the package's modules it imports (module level, in functions, under TYPE_CHECKING)."""
    names = {module_name(p, package) for p in package.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in package.rglob("*.py"):
        me = module_name(path, package)
        graph[me] = set()
        for _, target in imports(path):
            while target and target not in names:  # pdserve.x.Name -> pdserve.x
                target = target.rpartition(".")[0]
            if target and target != me:
                graph[me].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_every_class_name_is_unique_in_the_package() -> None:
    """A class name says which class it is: no two classes in pdserve share one."""
    where: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(f"{module_name(path)}:{node.lineno}")
    shared = {name: places for name, places in where.items() if len(places) > 1}
    assert not shared, shared


MAX_MODULE_LINES = 500


def test_no_module_is_over_500_lines() -> None:
    """A module a reader can hold in mind: past 500 lines one is cut by concept (as ``planner/rule.py``
    into the rule and its ``records``); benchmarks/ has the same bound in test_benchmarks_layout."""
    long = {
        module_name(path): n
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_import_cycle_inside_the_package() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_check_finds_a_cycle_added_on_purpose(tmp_path: Path) -> None:
    """The same check over a copy of the package with one import added inside a function."""
    import shutil

    copy = tmp_path / "pdserve"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    errors = copy / "errors.py"
    errors.write_text(errors.read_text() + "\n\ndef _late() -> None:\n    import pdserve.cli  # noqa\n")
    cycle = find_cycle(import_graph(copy))
    assert cycle is not None and "pdserve.errors" in cycle and "pdserve.cli" in cycle, cycle


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: module_name(p))
def test_imports_follow_the_rule(path: Path) -> None:
    if is_composition_root(path):
        return  # it wires the layers together and may import anything
    me = module_name(path)
    mine = layer(me)
    for line, target in imports(path):
        if target.split(".")[0] == "paddle":
            assert mine not in NO_PADDLE, f"{me}:{line} imports Paddle"
        assert target.split(".")[0] not in FORBIDDEN_PACKAGES.get(mine, ()), f"{me}:{line} imports {target}"
        if target == "pdserve.__version__":
            continue  # the package root's one plain constant
        if target.startswith("pdserve.") and target.split(".")[1] not in ALLOWED:
            pytest.fail(f"{me}:{line} imports {target} from the composition root")
        if target.startswith("pdserve."):
            assert layer(target) in ALLOWED[mine], f"{me}:{line} imports {target} ({mine} -> {layer(target)})"


# The engine's groups (docs/design.md, "Layout"): a device-free core, models/ (model sources),
# tiers/ (KV tiers), cpu/ (the Paddle platform) and cuda/ (the torch platform). Per group, what no
# import statement in it may name (module level, inside functions, under TYPE_CHECKING alike).
DEVICE_LIBRARIES = ("paddle", "torch", "numba", "llvmlite", "triton")
ENGINE_GROUP_FORBIDS = {
    "core": (*DEVICE_LIBRARIES, "pdserve.engine.cpu", "pdserve.engine.cuda"),
    "models": (*DEVICE_LIBRARIES, "pdserve.engine.cpu", "pdserve.engine.cuda"),
    "tiers": (*DEVICE_LIBRARIES, "pdserve.engine.cpu", "pdserve.engine.cuda"),
    "cpu": ("torch", "triton", "pdserve.engine.cuda"),
    "cuda": ("paddle", "numba", "llvmlite", "pdserve.engine.cpu"),
}
# The seam: the one core module that may name the platforms (and torch, to probe for a GPU), and
# only inside functions, so that importing it loads neither.
SEAM = "pdserve.engine.platform"
SEAM_MAY_NAME = ("torch", "pdserve.engine.cpu", "pdserve.engine.cuda")


def engine_group(module: str) -> str:
    """core, models, tiers, cpu or cuda for a module of pdserve.engine."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[2] in ENGINE_GROUP_FORBIDS else "core"


def names(target: str, prefix: str) -> bool:
    return target == prefix or target.startswith(prefix + ".")


def module_level_imports(path: Path) -> set[int]:
    """Line numbers of the import statements outside every function (module and class bodies)."""
    found: set[int] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.add(child.lineno)
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def engine_group_violations(package: Path = PACKAGE) -> list[str]:
    """Every import in pdserve.engine that its group's rule forbids."""
    bad = []
    for path in sorted((package / "engine").rglob("*.py")):
        me = module_name(path, package)
        forbidden = ENGINE_GROUP_FORBIDS[engine_group(me)]
        top = module_level_imports(path)
        for line, target in imports(path):
            if me == SEAM and line not in top and any(names(target, s) for s in SEAM_MAY_NAME):
                continue  # the seam, inside a function
            if any(names(target, f) for f in forbidden):
                bad.append(f"{me}:{line} imports {target} ({engine_group(me)})")
    return bad


def test_the_engine_groups_keep_to_their_side_of_the_seam() -> None:
    """The core, models/ and tiers/ name no tensor library and no platform package; cpu/ never
    names torch, Triton or cuda/; cuda/ never names Paddle, numba or cpu/; platform.py names the
    platforms inside functions only."""
    assert not engine_group_violations(), "\n".join(engine_group_violations())


@pytest.mark.parametrize(
    ("module", "added", "inside_a_function"),
    [
        ("llm_engine", "import pdserve.engine.cpu.paddle_executor", True),
        ("platform", "import pdserve.engine.cuda.torch_executor", False),
        ("platform", "import paddle", True),
        ("sampler", "import torch", True),
        ("models/weights", "import pdserve.engine.cuda.torch_cache", True),
        ("models/weights", "import paddle", False),
        ("tiers/host_tier", "import numba", True),
        ("cpu/gemm", "import torch", True),
        ("cpu/gemm", "import pdserve.engine.cuda.layer_ops", False),
        ("cuda/torch_cache", "import paddle", True),
        ("cuda/torch_cache", "import numba", False),
        ("cuda/torch_cache", "from pdserve.engine.cpu.kv_cache import KVCache", True),
    ],
)
def test_the_group_check_finds_an_import_added_on_purpose(
    tmp_path: Path, module: str, added: str, inside_a_function: bool
) -> None:
    """The same check over a copy of the package with one forbidden import added."""
    import shutil

    copy = tmp_path / "pdserve"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    path = copy / "engine" / f"{module}.py"
    line = f"\n\ndef _late() -> None:\n    {added}  # noqa\n" if inside_a_function else f"\n{added}  # noqa\n"
    path.write_text(path.read_text() + line)
    found = engine_group_violations(copy)
    assert len(found) == 1 and added.split()[1] in found[0], found


LOAD_CHECKS = {
    # module to import in a fresh interpreter -> what must not be loaded afterwards
    **{
        m: ("paddle", "pdserve.worker", "pdserve.router", "pdserve.cli", "pdserve.cli_commands")
        for m in MODULES
        if layer(m) == "scheduler"
    },
    **{
        m: ("paddle", "torch", "redis", "pdserve.worker", "pdserve.router", "pdserve.scheduler")
        for m in MODULES
        if layer(m) == "cache_transfer"
    },
    **{
        m: ("paddle", "pdserve.engine", "pdserve.worker", "pdserve.cli", "pdserve.cli_commands")
        for m in MODULES
        if layer(m) == "router"
    },
    # the engine's entry points load no Redis and nothing of the layers above it
    **{
        f"pdserve.engine.{m}": (
            "redis",
            "torch",
            "pdserve.scheduler",
            "pdserve.worker",
            "pdserve.router",
            "pdserve.cli",
            "pdserve.cli_commands",
        )
        for m in ("llm_engine", "llm", "disaggregate", "echo")
    },
    # the CPU path never loads torch, the torch (CUDA) path never loads Paddle
    **{
        f"pdserve.engine.{m}": ("torch", "triton", "pdserve.engine.cuda")
        for m in (
            "cpu.paddle_executor",
            "platform",
            "cpu.paddle_model",
            "cpu.kv_cache",
            "model_runner",
            "step_input",
        )
    },
    **{
        f"pdserve.engine.{m}": (
            "paddle",
            "numba",
            "redis",
            "pdserve.engine.cpu",
            "pdserve.worker",
            "pdserve.router",
        )
        for m in (
            "cuda.torch_executor",
            "cuda.torch_model",
            "cuda.torch_cache",
            "cuda.cuda_graphs",
            "cuda.triton_attention",
        )
    },
    "pdserve.engine.config": ("paddle", "torch", "numba", "redis", "pdserve.worker"),
    "pdserve.sampling_params": ("paddle", "redis", "pdserve.worker", "pdserve.router"),
    "pdserve.tokenizer": ("paddle", "numba", "redis", "pdserve.engine", "pdserve.worker", "pdserve.router"),
    "pdserve.scheduler.keys": ("paddle", "redis"),
    "pdserve": ("paddle", "redis", "pdserve.worker", "pdserve.router"),
    # the worker's service half runs (and is unit-tested) without the model: Paddle loads with the engine
    **{
        m: ("paddle", "numba", "pdserve.engine.llm_engine", "pdserve.router")
        for m in MODULES
        if layer(m) == "worker"
    },
}


def test_imports_load_only_what_the_rule_allows() -> None:
    code = (
        "import importlib, json, sys\n"
        "m = sys.argv[1]\n"
        "importlib.import_module(m)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    failures = []
    for module, forbidden in sorted(LOAD_CHECKS.items()):
        out = subprocess.run([sys.executable, "-c", code, module], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        loaded = __import__("json").loads(out.stdout)
        bad = [m for m in loaded if any(m == f or m.startswith(f + ".") for f in forbidden)]
        if bad:
            failures.append(f"import {module} loads {', '.join(bad[:5])}")
    assert not failures, "\n".join(failures)


ENGINE_SIDES = {  # modules imported together in a fresh interpreter -> what must not load afterwards
    "core": (*DEVICE_LIBRARIES, "pdserve.engine.cpu", "pdserve.engine.cuda"),
    "models": (*DEVICE_LIBRARIES, "pdserve.engine.cpu", "pdserve.engine.cuda"),
    "tiers": (*DEVICE_LIBRARIES, "pdserve.engine.cpu", "pdserve.engine.cuda"),
    "cpu": ("torch", "triton", "pdserve.engine.cuda"),
    "cuda": ("paddle", "numba", "llvmlite", "pdserve.engine.cpu"),
}


@pytest.mark.parametrize("group", sorted(ENGINE_SIDES))
def test_importing_an_engine_group_loads_nothing_of_the_other_side(group: str) -> None:
    """Every module of the group at once: the core, models/ and tiers/ load neither Paddle nor
    torch (nor numba, Triton or a platform package); the CPU platform loads no torch, the CUDA
    platform (where torch and Triton are installed) no Paddle and no numba."""
    if group == "cuda":
        pytest.importorskip("torch")
        pytest.importorskip("triton")
    members = [m for m in MODULES if m.startswith("pdserve.engine.") and engine_group(m) == group]
    code = (
        "import importlib, json, sys\n"
        "for m in sys.argv[1:]:\n"
        "    importlib.import_module(m)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, *members], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = __import__("json").loads(out.stdout)
    forbidden = ENGINE_SIDES[group]
    bad = [m for m in loaded if any(m == f or m.startswith(f + ".") for f in forbidden)]
    assert members and not bad, f"importing {group} ({len(members)} modules) loads {', '.join(bad[:5])}"


def test_batcher_and_block_manager_run_with_paddle_and_redis_blocked() -> None:
    """The bookkeeping half of the engine is free of the tensor library and of Redis."""
    code = """
import importlib.abc, sys

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("paddle", "redis"):
            raise ImportError(f"{name} is blocked in this test")

sys.meta_path.insert(0, Block())
from pdserve.sampling_params import SamplingParams
from pdserve.engine.batcher import Batcher, BatcherConfig
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.sequence import Sequence

b = Batcher(BatcherConfig(block_size=4, max_num_seqs=4, max_num_batched_tokens=32, prefill_chunk_size=16), BlockManager(16))
b.add(Sequence("r", list(range(1, 11)), SamplingParams(max_tokens=4)))
batch = b.schedule()
assert [(c.start, c.end) for c in batch.prefills] == [(0, 10)], batch
print("ok", b.blocks.num_free)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ok", "12"]  # 15 usable blocks, 3 taken by a 10-token prompt
