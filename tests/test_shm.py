"""A /dev/shm too small for a decode instance's KV cache is a clear error at start, never a SIGBUS
under load (Docker's and Kubernetes' default /dev/shm is 64 MiB). Runs in a private mount
namespace with an 8 MiB tmpfs on /dev/shm; needs root and `unshare` (CI has both)."""

from __future__ import annotations

import subprocess
import sys

from host_support import need_root_and


def in_small_shm(*cmd: str, size: str = "8m") -> subprocess.CompletedProcess:
    need_root_and("unshare", required_by="PDSERVE_REQUIRE_MULTIHOST")  # a private mount namespace
    script = f'mount -t tmpfs -o size={size} tmpfs /dev/shm && exec "$@"'
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *cmd],
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip


def test_a_segment_larger_than_dev_shm_is_refused_up_front() -> None:
    code = (
        "from pdserve.cache_transfer.shm import create_segment\n"
        "from pdserve.errors import ConfigError\n"
        "small = create_segment('pdserve-test-fits', 4 << 20); small.close(); small.unlink()\n"
        "try:\n    create_segment('pdserve-test-big', 16 << 20)\nexcept ConfigError as e:\n    print(e)\n"
        "import os; print(sorted(os.listdir('/dev/shm')))\n"
    )
    out = in_small_shm(sys.executable, "-c", code)
    assert out.returncode == 0, out.stderr
    assert "/dev/shm cannot hold this instance's 16 MiB KV cache" in out.stdout and "--shm-size" in out.stdout
    assert out.stdout.strip().endswith("[]")  # the refused segment is not left behind


def test_a_decode_worker_says_so_and_exits(redis_url, tmp_path) -> None:
    # 4096 echo blocks of 64 bytes fit; 1M blocks (64 MiB) do not
    cmd = [sys.executable, "-m", "pdserve.cli", "worker", "--role", "decode", "--engine", "echo",
           "--model", str(tmp_path), "--redis-url", redis_url, "--cluster", "shmtest", "--num-blocks", "1048576"]  # fmt: skip
    out = in_small_shm(*cmd)
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])  # a clear error, not -SIGBUS
    assert "cannot hold this instance's 64 MiB KV cache" in out.stderr and "--kv-cache-gb" in out.stderr
