"""adapter_config.json, read and checked at bounded cost (it comes from whoever wrote the adapter directory).

The file's size and nesting are capped before any value is looked at, and every regular expression it holds
(`target_modules` as a string, the keys of `rank_pattern` / `alpha_pattern`) is compiled by RE2, whose matching
time is linear in the input. Python's `re` backtracks: "(.+)+X" takes 1-1.4 s on a 24-character string and about
4 times longer per 2 characters more (module paths have about 30), inside one C call that holds the GIL, so every
thread of the server stalls.
"""
from __future__ import annotations

import json
import math
import reprlib
from dataclasses import dataclass
from pathlib import Path

import re2

from ..errors import AdapterError
from ..model.causal_lm import LORA_TARGETS

MAX_CONFIG_BYTES = 1 << 20   # a PEFT adapter_config.json is a few KiB
MAX_CONFIG_DEPTH = 32        # nested JSON arrays / objects; PEFT's configs nest a few levels
MAX_PATTERN_CHARS = 1024     # target_modules as a regex, and each rank_pattern / alpha_pattern key
MAX_PATTERN_KEYS = 1024      # entries of rank_pattern / alpha_pattern (one per module of a 146-layer model)
_UNSUPPORTED_TARGETS = ("embed_tokens", "lm_head")


def _repr() -> reprlib.Repr:
    """repr for messages: bounded in length and depth, whatever the file holds."""
    r = reprlib.Repr()
    r.maxstring = r.maxother = 80
    r.maxlist = r.maxdict = 8
    r.maxlevel = 3
    return r


_short = _repr().repr


def _re2_options() -> re2.Options:
    options = re2.Options()
    options.log_errors = False  # a bad pattern is the adapter's mistake, reported in its AdapterError; not logged
    options.max_mem = 1 << 20   # per pattern; MAX_PATTERN_CHARS fits in it
    return options


_RE2_OPTIONS = _re2_options()


def compile_pattern(pattern: str, where: str, field: str, suffix: bool = False) -> re2._Regexp:
    """`pattern` compiled by RE2, or an AdapterError naming `field` (RE2 has no backreferences or lookaround).
    suffix: as PEFT matches pattern keys, the pattern matches the end of a dotted path (`(.*\\.)?(pattern)`)."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise AdapterError(f"{where}: {field} is a pattern of {len(pattern)} characters; at most {MAX_PATTERN_CHARS}")
    try:
        return re2.compile(rf"(?:.*\.)?(?:{pattern})" if suffix else pattern, _RE2_OPTIONS)
    except re2.error as e:
        reason = e.args[0].decode(errors="replace") if e.args and isinstance(e.args[0], bytes) else str(e)
        raise AdapterError(f"{where}: {field} {_short(pattern)} is not a valid regular expression ({reason}; RE2 "
                           "syntax: no backreferences or lookaround)") from None


def read_config(path: Path, where: str) -> dict:
    """The file's JSON object, refused before parsing when over MAX_CONFIG_BYTES and after when it nests deeper
    than MAX_CONFIG_DEPTH (Python's json raises RecursionError from about 1000 levels: 993 in a thread here)."""
    size = path.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise AdapterError(f"{where}: {path} is {size} bytes; an adapter_config.json may be at most "
                           f"{MAX_CONFIG_BYTES} bytes")
    with path.open("rb") as f:
        data = f.read(MAX_CONFIG_BYTES + 1)  # the file may have grown since stat
    if len(data) > MAX_CONFIG_BYTES:
        raise AdapterError(f"{where}: {path} is over {MAX_CONFIG_BYTES} bytes; an adapter_config.json may be at "
                           f"most {MAX_CONFIG_BYTES} bytes")
    too_deep = AdapterError(f"{where}: {path} nests JSON arrays / objects more than {MAX_CONFIG_DEPTH} levels "
                            "deep; a PEFT adapter_config.json nests a few")
    try:
        raw = json.loads(data.decode("utf-8"))
    except RecursionError:
        raise too_deep from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdapterError(f"{where}: {path} is not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise AdapterError(f"{where}: {path} must hold a JSON object")
    if json_depth(raw) > MAX_CONFIG_DEPTH:
        raise too_deep
    return raw


def json_depth(value, limit: int = MAX_CONFIG_DEPTH) -> int:
    """Nesting depth of parsed JSON (a scalar 0, [] and {} 1), level by level without recursion; stops counting
    past `limit`."""
    depth, level = 0, [value]
    while depth <= limit:
        containers = [v for v in level if isinstance(v, (list, dict))]
        if not containers:
            break
        depth += 1
        level = [child for v in containers for child in (v.values() if isinstance(v, dict) else v)]
    return depth


def check_config(raw: dict, where: str) -> None:
    """PEFT features the engine does not implement are refused, never ignored."""
    if raw.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{where}: peft_type {_short(raw.get('peft_type'))} is not supported; only LORA")
    if raw.get("use_dora") not in (None, False, True):
        raise AdapterError(f"{where}: use_dora must be true or false, got {_short(raw['use_dora'])}")
    if raw.get("modules_to_save"):
        raise AdapterError(f"{where}: modules_to_save {_short(raw['modules_to_save'])} is not supported")
    if raw.get("bias", "none") != "none" or raw.get("lora_bias"):
        raise AdapterError(f"{where}: trained biases (bias={_short(raw.get('bias'))}) are not supported")
    if raw.get("target_parameters"):
        raise AdapterError(f"{where}: target_parameters is not supported")


def targets_from_config(raw: dict, where: str, table: dict[str, str] = LORA_TARGETS) -> tuple[str, ...]:
    """The modules `target_modules` names: a list of module names (or paths), "all-linear", or a regex that PEFT
    matches in full against each module's path (here: the path of each module of the model, `table`: the model
    family's, model.lora_targets)."""
    targets = raw.get("target_modules")
    if targets is None:
        return ()
    if isinstance(targets, str):
        if targets == "all-linear":
            return tuple(table)
        pattern = compile_pattern(targets, where, "target_modules")
        paths = {m: f"model.layers.0.{table[m]}" for m in table}
        paths |= {m: f"model.{m}" for m in _UNSUPPORTED_TARGETS}
        names = {m for m, path in paths.items() if pattern.fullmatch(path)}
    elif isinstance(targets, list) and all(isinstance(t, str) for t in targets):
        names = {t.rsplit(".", 1)[-1] for t in targets}
    else:
        raise AdapterError(f"{where}: target_modules must be a list of module names or a regular expression "
                           f"(a string), got {_short(targets)}")
    if not names:  # (PEFT refuses such a config too: "Target modules ... not found in the base model")
        raise AdapterError(f"{where}: target_modules {_short(targets)} matches no module of the model; its LoRA "
                           f"modules: {', '.join(table)}")
    bad = sorted(n for n in names if n not in table)
    if bad:
        raise AdapterError(f"{where}: target_modules {_short(bad)} are not supported; supported: "
                           f"{', '.join(table)}")
    return tuple(sorted(names, key=list(table).index))


class PatternTable:
    """rank_pattern / alpha_pattern as PEFT reads them (peft.utils.other.get_pattern_key): a module takes the
    value of the first key, in the file's order, that matches the end of its dotted path, the key being a regex
    (`(.*\\.)?(key)$`); otherwise the default. Each key is compiled once, by RE2."""

    def __init__(self, values: dict, where: str, field: str):
        self._entries = [(compile_pattern(key, where, f"{field} key", suffix=True), value)
                         for key, value in values.items()]

    def get(self, module_path: str, default):
        return next((value for pattern, value in self._entries if pattern.fullmatch(module_path)), default)


@dataclass(frozen=True)
class ConfigNumbers:
    r: int
    lora_alpha: float
    use_rslora: bool
    rank_pattern: PatternTable
    alpha_pattern: PatternTable


def config_numbers(raw: dict, where: str) -> ConfigNumbers:
    """Every number adapter_config.json sets, checked: Python's json reads NaN, Infinity and 1e309 (inf), and a
    non-finite or zero scaling would turn the adapter's output, and its KV entries, into NaN."""
    def rank(value, field: str) -> int:
        whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())  # NaN, inf: not
        if isinstance(value, bool) or not whole or value < 1:
            raise AdapterError(f"{where}: {field} must be a whole number >= 1, got {_short(value)}")
        return int(value)

    def alpha(value, field: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value == 0:
            raise AdapterError(f"{where}: {field} must be a finite, non-zero number, got {_short(value)}")
        return float(value)

    def pattern(field: str, check) -> PatternTable:
        value = raw.get(field) or {}
        if not isinstance(value, dict):
            raise AdapterError(f"{where}: {field} must be a JSON object, got {_short(value)}")
        if len(value) > MAX_PATTERN_KEYS:
            raise AdapterError(f"{where}: {field} has {len(value)} entries; at most {MAX_PATTERN_KEYS}")
        checked = {k: check(v, f"{field}[{_short(k)}]") for k, v in value.items()}
        return PatternTable(checked, where, field)

    # PEFT's defaults (LoraConfig: r=8, lora_alpha=8) for a config that leaves them out.
    r = rank(raw.get("r", 8), "r")
    use_rslora = raw.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise AdapterError(f"{where}: use_rslora must be true or false, got {_short(use_rslora)}")
    return ConfigNumbers(r, alpha(raw.get("lora_alpha", 8), "lora_alpha"), use_rslora,
                         pattern("rank_pattern", rank), pattern("alpha_pattern", alpha))


MAX_INVOCATION_TOKENS = 256  # an activated adapter's invocation sequence (each prompt is searched for it once)


def invocation_tokens(raw: dict, where: str, vocab_size: int) -> tuple[int, ...] | None:
    """Activated LoRA (PEFT's `alora_invocation_tokens`): the token ids whose last occurrence in a prompt starts
    the adapter's part of it; None for a plain adapter."""
    value = raw.get("alora_invocation_tokens")
    if value is None:
        return None
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_INVOCATION_TOKENS:
        raise AdapterError(f"{where}: alora_invocation_tokens must be a list of 1 to {MAX_INVOCATION_TOKENS} token "
                           f"ids, got {_short(value)}")
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise AdapterError(f"{where}: alora_invocation_tokens holds {_short(t)}, not a token id of this model "
                               f"[0, {vocab_size})")
    return tuple(value)
