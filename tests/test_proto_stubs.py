"""The committed stubs in service/_proto/ must be exactly what the proto generates (no stale stubs)."""
from __future__ import annotations

import difflib
from pathlib import Path

import pytest

grpc_tools = pytest.importorskip("grpc_tools")

from service.tools import gen_proto  # noqa: E402


def test_committed_stubs_match_proto(tmp_path: Path) -> None:
    fresh = gen_proto.generate(tmp_path)
    assert fresh, "protoc generated nothing"
    for path in fresh:
        committed = gen_proto.OUT_DIR / path.name
        assert committed.is_file(), f"{committed} is missing; run scripts/gen_proto.sh"
        new, old = path.read_text(), committed.read_text()
        if new != old:
            diff = "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                                str(committed), "regenerated", n=1))
            pytest.fail(f"{committed.name} is stale (or was made by another grpcio-tools version); "
                        f"run scripts/gen_proto.sh and commit the result\n{diff[:4000]}")


def test_stubs_import_inside_the_package() -> None:
    from service._proto import pb, pb_grpc

    assert pb.DESCRIPTOR.package == "loraserve.v1"
    assert pb.DESCRIPTOR.name == "loraserve/v1/lora_serve.proto"  # reflection clients see the proto path
    assert set(pb.DESCRIPTOR.services_by_name) == {"Generation", "Adapters"}
    assert hasattr(pb_grpc, "GenerationStub") and hasattr(pb_grpc, "AdaptersStub")


def test_unset_optional_fields_differ_from_zero() -> None:
    from service._proto import pb

    sampling = pb.SamplingParams()
    assert not sampling.HasField("temperature")
    sampling.temperature = 0.0
    assert sampling.HasField("temperature")
    assert not pb.StoppingCriteria().HasField("max_new_tokens")
