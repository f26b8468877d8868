"""The model: what defines it, finds its parts, changes it and exports it.

    modeling_llama     the decoder, its norm placements (PLACEMENTS) and config; the one file every checkpoint
                       carries a copy of, so it imports only torch and transformers
    model_parts        a model's parts through any wrapper: the model, its backbone and layers, whether it is ours
    layernorm_scaling  LNS as forward hooks on a stock Hugging Face decoder, and folding them into the weights
    head_losses        the lm_head and its next-token loss without full fp32 logits (the trainer's --loss)
    llama_export       export to a stock transformers LlamaForCausalLM
"""
