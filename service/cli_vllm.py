"""What `lora-serve` takes from `vllm serve`'s command line (vLLM 0.32): the forms of --lora-modules and
--max-model-len, and the log flags. The aliases themselves sit on lora-serve's own options (service/cli.py), so
each knob is defined once; docs/api.md lists them with their vLLM counterparts."""
from __future__ import annotations

import argparse
import json
import re
from typing import NamedTuple

# vLLM's LoRAModulePath fields; is_3d_lora_weight is taken only at its neutral value.
_LORA_MODULE_FIELDS = ("name", "path", "base_model_name", "is_3d_lora_weight")
# vLLM's human_readable_int: 1k = 1000, 1K = 1024 (decimals with the decimal suffixes only).
_TOKEN_COUNT = re.compile(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


class LoraModule(NamedTuple):
    """An adapter registered at start (--adapter / --lora-modules)."""

    name: str
    path: str
    base_model_name: str | None = None  # vLLM's: the base model it is for (checked against the served names)


def lora_module(value: str) -> LoraModule:
    """NAME=DIR, or vLLM's JSON form {"name": ..., "path": ..., "base_model_name": ...}; NAME follows the one rule
    for adapter names (lora_compile.lora.adapters.check_adapter_name)."""
    module = _lora_module(value)
    from lora_compile.lora.adapters import check_adapter_name
    from lora_compile.errors import AdapterNameError
    try:
        check_adapter_name(module.name)
    except AdapterNameError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return module


def _lora_module(value: str) -> LoraModule:
    if not value.lstrip().startswith("{"):
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise argparse.ArgumentTypeError(
                f'expected NAME=DIR or {{"name": NAME, "path": DIR, "base_model_name": MODEL}}, got {value!r}')
        return LoraModule(name, path)
    try:
        spec = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(
            f"invalid JSON for an adapter ({e.msg} at character {e.pos}): {value!r}") from None
    if not isinstance(spec, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object for an adapter, got {value!r}")
    unknown = sorted(set(spec) - set(_LORA_MODULE_FIELDS))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown field(s) {', '.join(map(repr, unknown))} in {value!r}; an "
                                         f"adapter takes {', '.join(_LORA_MODULE_FIELDS)}")
    if spec.get("is_3d_lora_weight", False) is not False:
        raise argparse.ArgumentTypeError(f"is_3d_lora_weight is not supported (3D MoE LoRA weights): {value!r}")
    for key in ("name", "path"):
        if not isinstance(spec.get(key), str) or not spec[key]:
            raise argparse.ArgumentTypeError(f"{key!r} must be a non-empty string in {value!r}")
    base = spec.get("base_model_name")
    if base is not None and not isinstance(base, str):
        raise argparse.ArgumentTypeError(f"'base_model_name' must be a string in {value!r}")
    return LoraModule(spec["name"], spec["path"], base)


def check_base_models(modules: list[LoraModule], base_names: tuple[str, ...]) -> None:
    """ValueError for an adapter declared for another base model than the one served (vLLM's base_model_name)."""
    for m in modules:
        if m.base_model_name is not None and m.base_model_name not in base_names:
            raise ValueError(f"adapter {m.name!r} is for base model {m.base_model_name!r}, but this server serves "
                             f"{', '.join(map(repr, base_names))} (--served-model-name)")


def token_count(value: str) -> int:
    """A count of tokens, as vLLM's --max-model-len takes it: 4096, 4k (4000), 4K (4096), 25.6k."""
    m = _TOKEN_COUNT.fullmatch(value.strip())
    if m is None or ("." in m.group(1) and m.group(2) not in _DECIMAL):
        hint = " (-1 / auto: vLLM derives it from the model; give the number here)" if value.strip().lower() in (
            "-1", "auto") else ""
        raise argparse.ArgumentTypeError(f"expected a number of tokens such as 4096, 4k (4000) or 4K (4096), got "
                                         f"{value!r}{hint}")
    number, suffix = m.groups()
    return int(float(number) * _DECIMAL[suffix]) if suffix in _DECIMAL else int(number) * _BINARY.get(suffix, 1)


def add_log_flags(p: argparse.ArgumentParser) -> None:
    from service.server import LogConfig

    d = LogConfig()
    g = p.add_argument_group("logs (see docs/operations.md)")
    g.add_argument("--disable-access-log", "--disable-uvicorn-access-log", dest="disable_access_log",
                   action="store_true",
                   help="no line per HTTP request (method, path, status, adapter, tokens, latency); "
                        "--disable-uvicorn-access-log: vLLM's name")
    g.add_argument("--disable-access-log-for-endpoints", default="", metavar="PATHS",
                   help='comma-separated paths left out of the access log, e.g. "/health,/metrics" (as vLLM)')
    g.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic stats line (throughput, running and waiting requests, KV cache usage, prefix "
                        "cache hit rate)")
    g.add_argument("--log-stats-interval", type=float, default=d.stats_interval_s, metavar="SECONDS",
                   help="seconds between stats lines (vLLM: env VLLM_LOG_STATS_INTERVAL) (default: %(default)s)")


def log_config(args: argparse.Namespace):
    from service.server import LogConfig

    return LogConfig(
        access_log=not args.disable_access_log,
        access_log_skip_paths=tuple(p.strip() for p in args.disable_access_log_for_endpoints.split(",") if p.strip()),
        log_stats=not args.disable_log_stats, stats_interval_s=args.log_stats_interval)
