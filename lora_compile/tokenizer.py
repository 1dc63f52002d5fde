"""tokenizer.json (Hugging Face `tokenizers`) plus the ids the engine needs: EOS."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from .errors import CheckpointError

_RELEASE_GIL_CHARS = 4096


class Tokenizer:
    def __init__(self, model_dir: str | Path, eos_token_ids: tuple[int, ...] = ()):
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{path}: missing; the model directory needs a tokenizer.json")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the Rust library raises plain Exceptions
            raise CheckpointError(f"{path}: cannot be read by the tokenizers library ({e})") from e
        eos = set(eos_token_ids) | set(_generation_eos(Path(model_dir)))
        self.eos_token_ids = frozenset(eos)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        # No token covers more characters of the text than its own string has (byte-level pieces are one char
        # per byte, SentencePiece ones one per char), so N tokens cover at most N * max_token_chars characters.
        self.max_token_chars = max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > _RELEASE_GIL_CHARS:  # encode() holds the GIL throughout; encode_batch() releases it
            return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)


def _generation_eos(model_dir: Path) -> tuple[int, ...]:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return ()
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (json.JSONDecodeError, UnicodeDecodeError):
        return ()
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)
