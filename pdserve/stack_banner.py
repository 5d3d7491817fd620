"""What ``pdserve up`` prints: while it waits for the stack, and the banner once it is up."""

from __future__ import annotations

import contextlib
import shutil
import sys
from pathlib import Path
from typing import Protocol

from pdserve.scheduler.redis_client import redact_url
from pdserve.stack_spec import StackSpec


class Shown(Protocol):
    """What the banner shows of a started stack (``stack.Stack``)."""

    spec: StackSpec
    device: str
    redis_url: str
    metrics_ports: dict[str, int]

    @property
    def urls(self) -> list[str]: ...
    @property
    def routers(self) -> list: ...


def command(name: str) -> str:
    """How to run this installation's ``name`` script from a shell here: bare when PATH finds it in
    this installation's bin folder, else its path (e.g. ``.venv/bin/python`` when the venv is not
    activated). Folders are compared, not files: a venv's ``python`` is a link to the base
    interpreter, and a base ``python`` first on PATH (pyenv, Docker images) lacks the venv's packages."""
    mine = Path(sys.executable).parent / name
    found = shutil.which(name)
    if found and Path(found).parent.resolve() == mine.parent.resolve():
        return name
    with contextlib.suppress(ValueError):
        return str(mine.relative_to(Path.cwd()))
    return str(mine)


def waiting_line(pending: str, elapsed_s: float) -> str:
    """What ``pdserve up`` prints while it waits for ``pending`` (a router URL it polls)."""
    if pending.endswith("/v1/instances"):
        what = "the workers to register (a first start compiles the kernels: about a minute)"
    else:
        what = f"{pending.removesuffix('/ready')} to answer"
    return f"starting ({elapsed_s:.0f} s): waiting for {what} ..."


def banner(stack: Shown, model_name: str, elapsed: float) -> str:
    url = stack.urls[0]
    more = f"        (also {', '.join(f'{u}/v1' for u in stack.urls[1:])})" if len(stack.urls) > 1 else ""
    workers_metrics = "".join(
        f"\n               {name}: http://127.0.0.1:{port}/metrics"
        for name, port in stack.metrics_ports.items()
    )
    return f"""
pdserve is up in {elapsed:.1f} s: {len(stack.routers)} router(s), {stack.spec.prefill} prefill, \
{stack.spec.decode} decode, {stack.spec.mixed} mixed.

  OpenAI API:  {url}/v1{more}
  layout:      {stack.spec.layout_reason}
  device:      {stack.device if stack.spec.engine_kind == "model" else "none (--engine echo)"}
  Redis:       {redact_url(stack.redis_url)}  (cluster {stack.spec.cluster!r})
  status:      {command("pdserve")} status      (finds this stack's Redis by itself; --watch: live)
  metrics:     {url}/metrics{workers_metrics}

  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{model_name}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 32}}'

  {command("python")} -c 'from openai import OpenAI
c = OpenAI(base_url="{url}/v1", api_key="none")
print(c.chat.completions.create(model="{model_name}", max_tokens=32,
      messages=[{{"role": "user", "content": "Hello!"}}]).choices[0].message.content)'

Ctrl-C stops everything.
"""
