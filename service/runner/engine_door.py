"""EngineDoor: the service's door to the engine (model facts, tokenizer, adapters): nothing else in service/
touches the engine object. EngineRunner (engine_runner.py) is one; these calls need none of its state."""
from __future__ import annotations

import asyncio
import logging

import service.runner.engine_thread as engine_thread
from lora_compile import Engine
from lora_compile.lora.manager import AdapterInfo
from lora_compile.lora.mixes import AdapterMix
from lora_compile.sample.structured_output import StructuredOutput
from service.runner.detokenizer import TokenText, token_texts
from service.runner.request import ModelInfo

log = logging.getLogger(__name__)


class EngineDoor:
    engine: Engine
    served_model_names: tuple[str, ...]  # --served-model-name: the first is reported

    def model_info(self) -> ModelInfo:
        engine, cfg, tok, kv = self.engine, self.engine.config, self.engine.tokenizer, self.engine.kv_cache
        return ModelInfo(
            model=self.served_model_names[0], served_model_names=self.served_model_names,
            architecture=engine.model_config.architecture,
            vocab_size=min(engine.model_config.vocab_size, tok.vocab_size), max_seq_len=cfg.max_seq_len,
            max_num_seqs=cfg.max_num_seqs, max_loras_per_batch=cfg.max_loras_per_batch,
            max_lora_rank=cfg.max_lora_rank, dtype=str(engine.dtype).removeprefix("torch."),
            device=str(engine.device), compiled=cfg.compile, eos_token_ids=tuple(sorted(tok.eos_token_ids)),
            max_token_chars=tok.max_token_chars, max_cpu_lora_bytes=engine.adapters.max_cpu_lora_bytes,
            on_demand_adapters=bool(engine.adapters.adapter_dirs), num_kv_blocks=kv.num_blocks,
            block_size=kv.block_size, prefix_caching=cfg.enable_prefix_caching)

    @property
    def model_dir(self) -> str:
        """The directory of the model's tokenizer_config.json (the chat template): the model's own, --tokenizer's,
        or what a GGUF file's metadata was derived into."""
        return str(self.engine.tokenizer_dir)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Tokenize (thread-safe: the tokenizer is not torch; long texts release the GIL)."""
        return self.engine.tokenizer.encode(text, add_special_tokens)

    def token_strings(self, ids: list[int]) -> list[str]:
        """The vocabulary's pieces ("Ġmate"), as a tokenizer lists them."""
        return [self.engine.tokenizer.id_to_token(i) or "" for i in ids]

    def token_texts(self, ids: list[int]) -> list[TokenText]:
        """Each token's own text and bytes (" mate"), as logprobs show them."""
        return token_texts(self.engine.tokenizer, ids)

    def decode(self, ids: list[int]) -> str:
        """The text of `ids`, special tokens written out (as vLLM's /detokenize: a prompt's own text)."""
        return self.engine.tokenizer.decode(ids, skip_special_tokens=False)

    def compile_grammar(self, spec: StructuredOutput) -> None:
        """Compile a structured output's grammar into the engine's cache (thread-safe; call it off the engine
        thread: a large schema takes milliseconds). Raises GrammarError naming the problem."""
        self.engine.grammars.compile(spec)

    def has_adapter(self, name: str) -> bool:
        """Registered, or found in an adapter directory. Raises AdapterNameError (INVALID_ARGUMENT) for a name
        that cannot be an adapter directory's entry, before any file is touched."""
        return self.engine.adapters.knows(name)

    def check_mix(self, mix: AdapterMix) -> None:
        """AdapterMixError (INVALID_ARGUMENT) where the members read already show `mix` cannot be served."""
        self.engine.adapters.check_mix(mix)

    def is_adapter_known(self, name: str) -> bool:
        """Registered or read once (no file access): for telemetry labels."""
        return name in self.engine.adapters

    def adapter_tiers(self) -> dict[str, int]:
        return self.engine.adapters.tier_counts()

    def list_adapters(self) -> list[AdapterInfo]:
        return self.engine.adapters.list()

    def adapter_name(self, adapter_id: int) -> str | None:
        """The known adapter numbered `adapter_id` (AdapterInfo.id: llama.cpp's ids), if any."""
        return self.engine.adapters.name_of(adapter_id)

    @property
    def adapter_roots(self) -> tuple[str, ...]:
        return self.engine.adapters.roots

    async def load_adapter(self, name: str, path: str | None) -> AdapterInfo:
        """Register `name` from `path`, or with no path read an adapter-directory adapter into host memory
        (a prefetch). The files are read on the loader threads; streams keep stepping meanwhile."""
        manager = self.engine.adapters
        if not path:
            future = manager.prefetch(name)
            if future is not None:
                result = await asyncio.wrap_future(future)
                if result.error is not None:
                    raise result.error
            return next(a for a in manager.list() if a.name == name)
        adapter = await asyncio.wrap_future(manager.loader.run(manager.read, name, path))
        # Between steps: replacing an adapter clears its device slot, which a step must not see half-done.
        return await engine_thread.run(manager.register_loaded, adapter)

    async def unload_adapter(self, name: str) -> None:
        # Between steps: unloading clears the adapter's device slot, which a step must not see half-done.
        await engine_thread.run(self.engine.adapters.unregister, name)

    async def warmup(self) -> float:
        """Compile every graph variant in the engine thread; the seconds it took."""
        if self.engine.thread_id != engine_thread.ident():
            log.warning("the engine was built outside the engine thread: on few cores its steps may run ~2x "
                        "slower; build it with service.runner.engine_thread.call(Engine, config)")
        seconds = await engine_thread.run(self.engine.warmup)
        # Structured outputs' compiler reads the whole vocabulary once, holding the GIL (~0.2 s for 49k tokens):
        # made now, not when the first constrained request arrives, when it would stall every stream.
        await engine_thread.run(lambda: self.engine.grammars)
        return seconds
