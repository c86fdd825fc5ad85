"""The one way a model runner is built, for every model an engine runs: rank 0's, each
tensor-parallel worker's shard, and a speculative draft model. What makes them differ is an argument
here (op table, parallel group, dtypes, load options), so each caller says what its runner is."""
import torch

from vlinfer import ops
from vlinfer.config import EngineConfig
from vlinfer.engine import sizing
from vlinfer.engine.build_model import load_model
from vlinfer.engine.model_runner import ModelRunner
from vlinfer.engine.mtp_head import check_mtp_target
from vlinfer.layers import ModelContext
from vlinfer.layers.distributed import SINGLE, TPGroup


def build_runner(config: EngineConfig, source, hf_config, device: torch.device, block_size: int, *,
                 ops_choice: str | None, dtype: torch.dtype, kv_cache_dtype: torch.dtype | None,
                 group: TPGroup = SINGLE, expert_parallel: bool = False,
                 quantization: str | None = None, pooling=None, tensors: dict | None = None,
                 eos_token_ids: set[int] | None = None, driver=None,
                 grammar_matchers=None) -> ModelRunner:
    """Build the model of `source` on its own op table (ops_choice forced, else the device's) for
    group's rank, in `dtype` with K and V stored in kv_cache_dtype (None: dtype), whole experts per
    rank under expert_parallel, weights quantized on load as `quantization` says; load its
    checkpoint shard (build_model.load_model: pooling, tensors); wrap it in a ModelRunner of
    block_size-token KV blocks that runs as `config` says (graphs, LoRA, max_num_seqs).

    With speculative_config method "mtp" the model is built with the checkpoint's MTP head, or
    refused by name before any weight is read (mtp_head.py check_mtp_target).

    Rank 0 passes what sampling needs: eos_token_ids, its TP driver and the grammar matchers; with a
    driver, this returns once every worker has built its shard too."""
    # The runner's own op table, dtype and step state: no other engine in the process sees them.
    ctx = ModelContext(ops.select(device.type, forced=ops_choice), group,
                       expert_parallel=expert_parallel, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                       state_dtype=sizing.state_dtype(config, hf_config, device))
    mtp = check_mtp_target(config.speculative_config, hf_config, tensors, source.name)
    net, bytes_read = load_model(source, hf_config, device, ctx, quantization, pooling, tensors,
                                 config.language_model_only, mtp)
    runner = ModelRunner(config, hf_config, net, ctx, device, block_size,
                         eos_token_ids if eos_token_ids is not None else set(), driver,
                         grammar_matchers, checkpoint_bytes_read=bytes_read)
    if driver is not None:  # the workers load their shards while this rank loads its own
        driver.wait_ready()
    return runner
