"""Loading and unloading adapters at run time, one implementation for both doors (through the request front,
front.py): gRPC's Adapters.LoadAdapter / UnloadAdapter and HTTP's /v1/load_lora_adapter / /v1/unload_lora_adapter
(vLLM's). The argument checks, the adapter roots and the in-use refusal live here; the runner reads the files
(loader threads) and registers them (between steps). Who may call them is the door's business (the management
policy of service/security.py)."""
from __future__ import annotations

import logging
import os
from pathlib import Path

from lora_compile.lora.manager import AdapterInfo
from service.errors import FailedPrecondition, FieldViolation, InvalidArgument, NotFound
from service.limits import MAX_NAME_CHARS
from service.runner.engine_runner import EngineRunner

log = logging.getLogger(__name__)

MAX_PATH_CHARS = 4096


class AdapterManagement:
    def __init__(self, runner: EngineRunner):
        self._runner = runner

    async def load(self, name: str, path: str) -> AdapterInfo:
        """Register adapter `name` from directory `path` on the server, replacing an idle adapter of that name.
        With an adapter directory (--adapter-dir) and no path: read adapter `name` from it into host memory (a
        prefetch; its name is checked before any file is touched)."""
        runner = self._runner
        required = ("name",) if runner.model_info().on_demand_adapters else ("name", "path")
        given = {"name": name, "path": path}
        bad = [FieldViolation(f, "must not be empty") for f in required if not given[f]]
        bad += [FieldViolation(f, f"at most {n} characters") for f, n in (("name", MAX_NAME_CHARS),
                                                                          ("path", MAX_PATH_CHARS))
                if len(given[f]) > n]
        if bad:
            raise InvalidArgument(bad)
        if not path:
            if not runner.has_adapter(name):
                raise NotFound("adapter", name)
            return await runner.load_adapter(name, None)
        check_adapter_path(path, runner.adapter_roots)  # a precise message for escapes
        if runner.adapter_users(name):
            raise FailedPrecondition(f"adapter {name!r} is in use by in-flight requests; it cannot be replaced now")
        # (An unreadable path is an AdapterError from load_adapter: FAILED_PRECONDITION, docs/errors.md L06.)
        info = await runner.load_adapter(name, path)
        log.info("loaded adapter %r from %r (rank %d)", info.name, str(info.path), info.rank)
        return info

    async def unload(self, name: str) -> None:
        """Forget adapter `name` (its weights leave host memory and its device slot), unless requests in flight
        (waiting or running) use it."""
        runner = self._runner
        if not name:
            raise InvalidArgument([FieldViolation("name", "must not be empty")])
        if len(name) > MAX_NAME_CHARS:
            raise InvalidArgument([FieldViolation("name", f"at most {MAX_NAME_CHARS} characters")])
        if not runner.has_adapter(name):
            raise NotFound("adapter", name)
        users = runner.adapter_users(name)
        if users:
            raise FailedPrecondition(f"adapter {name!r} is in use by {users} in-flight requests")
        await runner.unload_adapter(name)
        log.info("unloaded adapter %r", name)


def check_adapter_path(path: str, roots: tuple[str, ...]) -> None:
    """INVALID_ARGUMENT (field "path") for a LoadAdapter path outside the adapter roots, saying exactly why.
    The engine checks again when it reads the files (also after eviction), so this is the message, not the
    only guard."""
    if "\x00" in path:
        raise InvalidArgument([FieldViolation("path", "must not contain NUL characters")])
    try:
        given = Path(path).expanduser()
    except RuntimeError:  # "~someone/..." where there is no such user
        raise InvalidArgument([FieldViolation("path", f"{path!r}: '~' cannot be expanded (no such user)")]) from None
    if not roots:
        return
    resolved = given.resolve()
    root_dirs = [Path(r).expanduser().resolve() for r in roots]
    if any(resolved.is_relative_to(r) for r in root_dirs):
        return
    lexical = Path(os.path.normpath(given.absolute()))  # ".." folded, symlinks not followed
    if ".." in given.parts:
        why = f"{path!r} leaves the adapter roots through '..' (it resolves to {resolved})"
    elif any(lexical.is_relative_to(r) for r in root_dirs):
        why = f"{path!r} is under an adapter root but a symlink takes it to {resolved}, outside every root"
    elif given.is_absolute():
        why = f"absolute path {path!r} is outside the adapter roots"
    else:
        why = f"relative path {path!r} resolves to {resolved}, outside the adapter roots"
    raise InvalidArgument([FieldViolation("path", f"{why}; allowed roots: {', '.join(map(str, root_dirs))}")])
