"""Regenerate the committed Python stubs in service/_proto/ from proto/ (`python -m service.tools.gen_proto`).

protoc names modules after the proto path (`loraserve/v1/...`) and writes absolute imports
(`from loraserve.v1 import lora_serve_pb2`); we flatten the output into one package and make those
imports relative, so the stubs import as `service._proto` without touching sys.path. The descriptor
keeps its proto path (`loraserve/v1/lora_serve.proto`), which is what reflection clients see.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = ROOT / "proto"
PROTO_FILES = ("loraserve/v1/lora_serve.proto",)
OUT_DIR = ROOT / "service" / "_proto"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")

_ABSOLUTE_IMPORT = re.compile(r"^from loraserve\.v1 import ", re.MULTILINE)


def protoc_command(out_dir: Path) -> list[str]:
    # google/protobuf/*.proto, which `python -m grpc_tools.protoc` would add too
    well_known = resources.files("grpc_tools") / "_proto"
    return [
        sys.executable, "-m", "grpc_tools.protoc",
        f"-I{PROTO_ROOT}", f"-I{well_known}",
        f"--python_out={out_dir}", f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}",
        *PROTO_FILES,
    ]


def generate(out_dir: Path = OUT_DIR) -> list[Path]:
    """Run protoc into a temp dir, then write the flattened, import-fixed files to out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(protoc_command(Path(tmp)), check=True, cwd=PROTO_ROOT)
        for proto in PROTO_FILES:
            stem = Path(proto).with_suffix("")
            for suffix in GENERATED_SUFFIXES:
                src = Path(tmp) / f"{stem}{suffix}"
                dst = out_dir / f"{stem.name}{suffix}"
                dst.write_text(_ABSOLUTE_IMPORT.sub("from . import ", src.read_text()))
                written.append(dst)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT_DIR, help="output package directory (default: %(default)s)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)


if __name__ == "__main__":
    main()
