"""The LoRA adapters a server serves by name, as vLLM's does: --lora-modules from the start, the
request's `model` choosing one (the base model's name: none), /v1/models listing each with its
`parent`, and, only with --allow-runtime-lora-updating, /v1/load_lora_adapter and
/v1/unload_lora_adapter.

Every adapter loaded gets a new lora_int_id, never reused: one loaded again under an old name never
meets the old one's host copy or prefix-cache blocks, which the engine keys by the id. Unloading
takes the name off this server; requests already running finish with it, and the engine drops its
copy when its LRUs (max_loras slots, max_cpu_loras host copies) need the room."""
import asyncio
import itertools
import logging

from vlinfer.lora_request import LoRARequest
from vlinfer.serve.config import ServeConfig
from vlinfer.serve.errors import ApiError
from vlinfer.serve.limits import RUNTIME_FLAG
from vlinfer.serve.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

logger = logging.getLogger("vlinfer.serve")
# lora_int_ids, unique in the process: two servers on one engine (an app beside the server, tests)
# never give one id to two adapters.
_LORA_IDS = itertools.count(1)


class Adapters:
    """name -> (LoRARequest, parent model name) of the adapters served now."""

    def __init__(self, engine, config: ServeConfig):
        self.engine = engine
        self.base_names = config.served_model_names
        self.runtime_updates = config.allow_runtime_lora_updating
        self.served: dict[str, tuple[LoRARequest, str]] = {}
        # one load at a time: its name checked and its adapter added as one step
        self._load_lock = asyncio.Lock()
        if not (config.lora_modules or self.runtime_updates):
            return
        if not engine.config.enable_lora:
            raise ValueError(
                "serving LoRA adapters needs an engine with enable_lora=True (--enable-lora)")
        if engine.pooling is not None or not engine.can_generate:
            raise ValueError(
                f"model {self.base_names[0]!r} is a pooling model (embeddings, scores): LoRA "
                "adapters "
                "are served on generating models")
        for module in config.lora_modules:
            try:
                request, parent = self.new(module.name, module.path, module.base_model_name)
                engine.input_processor.check_lora(request)
            except ValueError as e:
                raise ValueError(f"LoRA module {module.name!r}: {e}") from None
            self.served[module.name] = (request, parent)
            logger.info("serving LoRA adapter %r from %s", module.name, module.path)

    def new(self, name: str, path: str, parent: str | None = None) -> tuple[LoRARequest, str]:
        """A LoRARequest with a new id for an adapter not served yet, and its parent; ValueError
        naming what is wrong with the name."""
        if name in self.base_names:
            raise ValueError(f"the LoRA adapter name {name!r} is a served model name")
        if name in self.served:
            raise ValueError(f"the LoRA adapter {name!r} has already been loaded")
        if parent is not None and parent not in self.base_names:
            raise ValueError(
                f"base_model_name {parent!r} is not a served model name ({list(self.base_names)})")
        return LoRARequest(name, next(_LORA_IDS), path), parent or self.base_names[0]

    def get(self, name: str) -> LoRARequest | None:
        entry = self.served.get(name)
        return entry[0] if entry is not None else None

    def cards(self) -> list[tuple[str, str, str]]:
        """(name, path, parent) of each adapter, in the order loaded."""
        return [(name, request.lora_path, parent)
                for name, (request, parent) in self.served.items()]

    def check_runtime(self, route: str) -> None:
        if not self.runtime_updates:
            raise ApiError(
                404,
                f"{route} is off: loading and unloading LoRA adapters at runtime needs the server "
                f"flag {RUNTIME_FLAG}", code="not_found")

    async def load(self, req: LoadLoRAAdapterRequest) -> str:
        """Read and check the adapter (in a worker thread), then serve it under its name."""
        async with self._load_lock:
            try:
                request, parent = self.new(req.lora_name, req.lora_path)
            except ValueError as e:
                raise ApiError(400, str(e), param="lora_name", code="invalid_value") from None
            try:
                await asyncio.to_thread(self.engine.input_processor.check_lora, request)
            except ValueError as e:
                raise ApiError(400, str(e), param="lora_path", code="invalid_value") from None
            self.served[req.lora_name] = (request, parent)
        logger.info("loaded LoRA adapter %r from %s", req.lora_name, req.lora_path)
        return f"Success: LoRA adapter '{req.lora_name}' added successfully."

    def unload(self, req: UnloadLoRAAdapterRequest) -> str:
        if self.served.pop(req.lora_name, None) is None:
            raise ApiError(
                404,
                f"the LoRA adapter {req.lora_name!r} cannot be found; loaded: {list(self.served)}",
                param="lora_name", code="not_found")
        logger.info("unloaded LoRA adapter %r", req.lora_name)
        return f"Success: LoRA adapter '{req.lora_name}' removed successfully."
