"""Huge pages by default (lora_compile.huge_pages): importing lora_compile asks torch's allocator for them, the
user's own setting wins, and the kernel really backs large tensors with them where its mode lets a process ask."""
from __future__ import annotations

import os
import subprocess
import sys

from lora_compile import huge_pages

# In a fresh process: import lora_compile first (as the service does), then allocate and touch 64 MiB.
PROBE = """
import lora_compile, os, torch
from lora_compile import huge_pages
x = torch.empty(64 << 20, dtype=torch.uint8)
x.fill_(1)
print(os.environ.get(huge_pages.ENV), huge_pages.anon_huge_bytes(), flush=True)
"""


def probe(**env: str) -> tuple[str, int]:
    environ = {k: v for k, v in os.environ.items() if k != huge_pages.ENV} | env
    out = subprocess.run([sys.executable, "-c", PROBE], env=environ, capture_output=True, text=True, check=True)
    value, held = out.stdout.split()[-2:]
    return value, int(held)


def test_set_by_default_user_setting_wins_and_the_kernel_backs_large_tensors():
    value, held = probe()
    value_off, held_off = probe(**{huge_pages.ENV: "0"})
    assert (value, value_off) == ("1", "0")
    if huge_pages.kernel_mode() == "madvise":  # only a process that asks gets huge pages: the setting decides
        assert held >= 32 << 20, f"only {held} bytes in huge pages after touching a 64 MiB tensor"
        assert held_off < held // 4


def test_status_names_the_setting():
    line = huge_pages.status()
    mode = huge_pages.kernel_mode()
    assert (f"kernel mode {mode}" in line) if mode else ("not available" in line)
