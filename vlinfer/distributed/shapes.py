"""Whether a model's shapes split over a tensor-parallel group: checked before any worker loads a
weight."""


def check_tensor_parallel_shapes(text_config, tp: int, expert_parallel: bool = False,
                                 speculative: bool = False) -> None:
    """Query heads, linear-attention key heads and the MLP split evenly; KV heads split evenly
    or, when fewer than ranks, replicate. MoE experts split along their intermediate dimension,
    or (expert_parallel) whole experts over the ranks. A hybrid model does not speculate across
    ranks: a rejection puts back the linear-attention state on rank 0's slots only."""
    if tp == 1:
        return
    heads, kv = text_config.num_attention_heads, text_config.num_key_value_heads
    problems = []
    if heads % tp:
        problems.append(f"num_attention_heads={heads} is not divisible by it")
    if kv % tp and tp % kv:
        problems.append(f"num_key_value_heads={kv} neither divides it nor is divisible by it")
    intermediate = getattr(text_config, "intermediate_size", 0) or 0  # none in Qwen3.5-MoE's
    if intermediate % tp:
        problems.append(f"intermediate_size={intermediate} is not divisible by it")
    linear_heads = getattr(text_config, "linear_num_key_heads", None)  # Gated DeltaNet layers
    hybrid = "linear_attention" in (getattr(text_config, "layer_types", None) or ())
    if hybrid and speculative:
        problems.append("speculative decoding on a hybrid model runs on one rank only (a "
                        "rejection puts back the linear-attention state of rank 0's slots)")
    if hybrid and isinstance(linear_heads, int) and linear_heads % tp:
        problems.append(f"linear_num_key_heads={linear_heads} is not divisible by it (each rank "
                        "holds whole key heads and the value heads they serve)")
    shared = getattr(text_config, "shared_expert_intermediate_size", 0) or 0
    if shared % tp:
        problems.append(f"shared_expert_intermediate_size={shared} is not divisible by it")
    num_experts = getattr(text_config, "num_experts", 0) or 0
    if num_experts and expert_parallel and num_experts % tp:
        problems.append(
            f"num_experts={num_experts} is not divisible by it (enable_expert_parallel)")
    if num_experts and not expert_parallel and text_config.moe_intermediate_size % tp:
        problems.append(
            f"moe_intermediate_size={text_config.moe_intermediate_size} is not divisible by it")
    if problems:
        raise ValueError(f"tensor_parallel_size={tp} does not fit this model: " +
                         "; ".join(problems))
