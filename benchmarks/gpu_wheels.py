"""The wheels a GPU machine lacks, as one consistent set (benchmarks/gpu_fetch_wheels.sh runs this).

One pip resolver run (``pip install --dry-run --report``, for CPython 3.12 on manylinux x86_64,
binary wheels only) resolves pdserve's runtime dependencies as pyproject.toml states them, less
Paddle (the GPU machine runs the torch platform), with each direct dependency pinned to the version
this checkout's venv has (what the tests ran) where it has one. Everything else comes from the
resolution: pydantic-core is the version pydantic's own metadata pins (checked), starlette the one
fastapi allows, and so on. Carried: what pdserve reaches through packages the GPU machine does not
ship (MACHINE), and typing-extensions always (pydantic needs a newer one than a torch image may
hold). Then ``pip download --no-deps`` of exactly those name==version into .whl/ (the previous set
removed first: two versions of one project would stop the install there), and .whl/requirements.txt,
which the device check's smoke step (gpu_smoke.py) holds the installed versions to.

    python benchmarks/gpu_wheels.py [--mooncake]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata as md
import json
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / ".whl"
PYTHON = "3.12"
# pip matches each manylinux tag exactly: name the ones these projects publish
PLATFORMS = [
    f"{tag}_x86_64"
    for tag in (
        "manylinux_2_39",
        "manylinux_2_35",
        "manylinux_2_34",
        "manylinux_2_31",
        "manylinux_2_28",
        "manylinux_2_27",
        "manylinux_2_24",
        "manylinux_2_17",
        "manylinux2014",
        "manylinux_2_5",
        "manylinux1",
    )
]
# What the GPU machine's image ships (PyTorch, Triton, CuPy, numba, transformers, tokenizers,
# safetensors, numpy, huggingface-hub, httpx, uvloop, rich, prometheus-client, jinja2, tqdm, filelock,
# click, psutil, pytest) and what those surely bring (torch's sympy, numba's llvmlite, httpx's
# httpcore, ...): never carried, never overridden. A package left out here is carried, which costs
# a few hundred KB, not a failure.
MACHINE = {
    "torch", "triton", "cupy-cuda12x", "cupy-cuda13x", "numba", "llvmlite", "transformers", "tokenizers",
    "safetensors", "numpy", "huggingface-hub", "httpx", "httpcore", "anyio", "h11", "idna", "certifi",
    "uvloop", "rich", "markdown-it-py", "mdurl", "pygments", "prometheus-client", "jinja2", "markupsafe",
    "tqdm", "filelock", "click", "psutil", "pytest", "iniconfig", "pluggy", "packaging", "pyyaml", "regex",
    "sympy", "mpmath", "networkx", "fsspec", "setuptools",
}  # fmt: skip
ALWAYS = {"typing-extensions"}  # carried even though the machine has one: pydantic needs a recent one
NOT_THERE = {
    "paddlepaddle"
}  # the CPU platform's; the GPU machine has none and the torch path never imports it


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(mooncake: bool) -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [
        r
        for r in project["dependencies"]
        if norm(re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0]) not in NOT_THERE
    ]
    if mooncake:
        reqs += project["optional-dependencies"]["mooncake"]
    return reqs


def tested_pins(reqs: list[str]) -> list[str]:
    """name==version for each direct dependency this interpreter (the checkout's venv) has, unless
    the GPU machine ships it (its own version is the one that will run there)."""
    pins = []
    for text in reqs:
        name = re.split(r"[\s\[<>=!~;]", text, maxsplit=1)[0]
        if norm(name) in MACHINE:
            continue
        with contextlib.suppress(md.PackageNotFoundError):
            pins.append(f"{name}=={md.version(name)}")
    return pins


def pip(*args: str, **kw: object) -> subprocess.CompletedProcess:
    target = ["--python-version", PYTHON, "--implementation", "cp", "--only-binary=:all:"]
    for p in PLATFORMS:
        target += ["--platform", p]
    cmd = [sys.executable, "-m", "pip", *args, *target]
    return subprocess.run(cmd, check=True, text=True, **kw)  # type: ignore[call-overload]


def resolve(reqs: list[str], pins: list[str]) -> list[dict]:
    """One resolver run over the whole set: each package's report entry (name, version, metadata)."""
    with tempfile.TemporaryDirectory() as tmp:
        constraints = Path(tmp) / "tested.txt"
        constraints.write_text("\n".join(pins) + "\n")
        report = Path(tmp) / "report.json"
        pip(
            "install",
            "--dry-run",
            "--ignore-installed",
            "--quiet",
            "--report",
            str(report),
            "--target",
            str(Path(tmp) / "target"),
            "-c",
            str(constraints),
            *reqs,
        )
        return json.loads(report.read_text())["install"]


def check_pydantic(resolved: dict[str, dict]) -> None:
    """pydantic-core is the exact version pydantic's metadata requires (else pydantic raises at import)."""
    if "pydantic" not in resolved:
        return
    wants = [
        r
        for r in resolved["pydantic"]["metadata"].get("requires_dist", [])
        if norm(r).startswith("pydantic-core")
    ]
    pinned = re.search(r"==\s*([\w.]+)", wants[0]) if wants else None
    have = resolved.get("pydantic-core", {}).get("metadata", {}).get("version")
    if not pinned or pinned[1] != have:
        raise SystemExit(
            f"pydantic {resolved['pydantic']['metadata']['version']} requires {wants}, resolved {have}"
        )


def carried(reqs: list[str], resolved: dict[str, dict]) -> list[str]:
    """name==version of what pdserve needs that the machine lacks: from pdserve's direct requirements
    along each package's own (markers evaluated for the target, with the extras requested), never
    into a package the machine ships (its dependencies are its own business), plus ALWAYS."""
    from packaging.requirements import Requirement

    # the target's Python: Marker.evaluate lays these over this interpreter's default_environment()
    target = {"python_version": PYTHON, "python_full_version": f"{PYTHON}.0"}

    def deps(item: dict) -> list[str]:
        out = []
        for text in item["metadata"].get("requires_dist") or []:
            req = Requirement(text)
            extras = ["", *(item.get("requested_extras") or [])]
            if req.marker is None or any(req.marker.evaluate({**target, "extra": e}) for e in extras):
                out.append(norm(req.name))
        return out

    todo = [norm(Requirement(r).name) for r in reqs] + sorted(ALWAYS)
    carry: set[str] = set()
    while todo:
        name = todo.pop()
        if name in carry or name not in resolved or (name in MACHINE and name not in ALWAYS):
            continue  # not needed on this target (a marker), or the machine's own
        carry.add(name)
        todo += deps(resolved[name])
    return sorted(f"{resolved[n]['metadata']['name']}=={resolved[n]['metadata']['version']}" for n in carry)


def travelling_bytes() -> int:
    """What goes to the GPU machine: the files git tracks or would add, and .whl."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout
    files = {ROOT / f for f in out.decode().split("\0") if f} | set(WHEELS.glob("*"))
    return sum(f.stat().st_size for f in files if f.is_file())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mooncake", action="store_true", help="also mooncake-transfer-engine-non-cuda")
    args = ap.parse_args()
    reqs = requirements(args.mooncake)
    pins = tested_pins(reqs)
    print(
        f"resolving {len(reqs)} requirements for CPython {PYTHON} manylinux x86_64; tested pins: {' '.join(pins)}"
    )
    resolved = {norm(i["metadata"]["name"]): i for i in resolve(reqs, pins)}
    check_pydantic(resolved)
    carry = carried(reqs, resolved)
    left = sorted(set(resolved) - {norm(c.split("==")[0]) for c in carry})
    print(f"carried ({len(carry)}): {' '.join(carry)}\nnot carried (the machine's): {' '.join(left)}")
    WHEELS.mkdir(exist_ok=True)
    for old in WHEELS.glob("*.whl"):
        old.unlink()
    pip("download", "--quiet", "--no-deps", "-d", str(WHEELS), *carry)
    (WHEELS / "requirements.txt").write_text("\n".join(carry) + "\n")
    got = sorted(WHEELS.glob("*.whl"))
    if len(got) != len(carry):
        raise SystemExit(f"{len(got)} wheels in {WHEELS} for {len(carry)} pins")
    size = sum(w.stat().st_size for w in got)
    total = travelling_bytes()
    print(
        f"{len(got)} wheels, {size / 2**20:.1f} MiB in {WHEELS}; with the working tree {total / 2**20:.1f} MiB "
        "travel (the device tool carries at most 64 MiB)"
    )
    return 0 if total < 64 * 2**20 else 1


if __name__ == "__main__":
    sys.exit(main())
