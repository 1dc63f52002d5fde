"""OpenAI's `response_format` and vLLM's `structured_outputs` → GenerateParams.structured_output (kind, spec), with
the field a refusal names. Whether the spec compiles is service/front/prepare.py's question (the engine's grammar
compiler), asked the same way for both doors."""
from __future__ import annotations

import json
from typing import Any

from service.errors import FieldViolation, InvalidArgument

# vLLM's StructuredOutputsParams: the constraint (exactly one), then options at their neutral values only.
_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")
_NEUTRAL_OPTIONS = {"disable_fallback": (False,), "disable_any_whitespace": (False,),
                    "disable_additional_properties": (False,), "whitespace_pattern": (None,),
                    "structural_tag": (None,), "backend": (None, "auto", "guidance")}


def structured_output(response_format: dict[str, Any] | None,
                      structured_outputs: dict[str, Any] | None) -> tuple[tuple[str, str], str] | None:
    """((kind, spec), the field it came from), or None for free text. Raises InvalidArgument."""
    fmt = _response_format(response_format)
    so = _structured_outputs(structured_outputs)
    if fmt and so:
        raise InvalidArgument([FieldViolation("structured_outputs", "send either response_format or "
                                                                    "structured_outputs, not both")])
    if fmt:
        return fmt, "response_format"
    if so:
        return so, "structured_outputs"
    return None


def _response_format(body: dict[str, Any] | None) -> tuple[str, str] | None:
    if not body:
        return None
    kind = body.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_object", ""
    if kind == "json_schema":
        spec = body.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise InvalidArgument([FieldViolation("response_format.json_schema.schema", (
                "a JSON schema object is required (OpenAI's form: {\"type\": \"json_schema\", \"json_schema\": "
                "{\"name\": ..., \"schema\": {...}}})"))])
        return "json", json.dumps(spec["schema"])
    raise InvalidArgument([FieldViolation("response_format.type", (
        f"must be \"text\", \"json_object\" or \"json_schema\", got {kind!r}"))])


def _structured_outputs(body: dict[str, Any] | None) -> tuple[str, str] | None:
    if not body:
        return None
    unknown = [k for k in body if k not in _CONSTRAINTS and k not in _NEUTRAL_OPTIONS]
    if unknown:
        raise InvalidArgument([FieldViolation(f"structured_outputs.{k}", "not a structured_outputs field")
                               for k in unknown])
    bad = [FieldViolation(f"structured_outputs.{k}", f"not supported: only {neutral[0]!r} (the default)")
           for k, neutral in _NEUTRAL_OPTIONS.items() if k in body and body[k] not in neutral]
    if bad:
        raise InvalidArgument(bad)
    given = [k for k in _CONSTRAINTS if body.get(k) not in (None, False)]
    if len(given) != 1:
        raise InvalidArgument([FieldViolation("structured_outputs", (
            f"set exactly one of {', '.join(_CONSTRAINTS)}; got {', '.join(given) or 'none'}"))])
    kind, value = given[0], body[given[0]]
    field = f"structured_outputs.{kind}"
    if kind == "json_object":
        if value is not True:
            raise InvalidArgument([FieldViolation(field, "must be true")])
        return "json_object", ""
    if kind == "json":  # a schema object, or its JSON text
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise InvalidArgument([FieldViolation(field, f"not valid JSON: {e}")]) from None
        if not isinstance(value, dict):
            raise InvalidArgument([FieldViolation(field, "must be a JSON schema object")])
        return "json", json.dumps(value)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise InvalidArgument([FieldViolation(field, "must be a non-empty list of non-empty strings")])
        return "choice", json.dumps(value)
    if not isinstance(value, str):
        raise InvalidArgument([FieldViolation(field, "must be a string")])
    return kind, value
