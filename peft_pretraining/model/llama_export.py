"""Export to stock `transformers.LlamaForCausalLM`, for the placements whose row in PLACEMENTS says it exports.

Kept out of modeling_llama.py, which every checkpoint carries a copy of: loading a checkpoint needs none of this.
"""

from __future__ import annotations

from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlamaForCausalLM

from peft_pretraining.model.modeling_llama import PLACEMENTS, LlamaForCausalLM

EXPORTABLE_PLACEMENTS = tuple(name for name, placement in PLACEMENTS.items() if placement.exports_to_stock_llama)
_OUR_CONFIG_KEYS = ("norm_type", "post_num", "init_method", "layer_norm_types", "layer_depths",
                    "depth_scaling_num_layers", "auto_map", "layerscale_form", "layerscale_init", "completep_alpha",
                    "deepnorm_init", "embed_init_std", "dyt_alpha_init", "bhyt_lambda_init", "bhyt_kappa")


def export_to_hf_llama(model: LlamaForCausalLM) -> HFLlamaForCausalLM:
    """A stock `transformers.LlamaForCausalLM` computing the same function as `model` (placements in
    EXPORTABLE_PLACEMENTS).

    Each sublayer's residual module gives (s, b) with x + b * F(s * N(x)) = x + F'(N'(x)), N' = s * N and the rows
    of F's output projection times b (`stock_llama_factors`). LNS's 1/sqrt(l) multiplies the norm output after its
    gain, so it folds exactly into the two gains of layer l; LayerScale/SkipInit gates and CompleteP's L^-alpha
    multiply the branch output, so they fold into the rows of o_proj and down_proj. The other placements have no
    stock-Llama form: they load with trust_remote_code=True.
    """
    placements = [layer.placement for layer in model.model.layers]
    unsupported = sorted(set(placements) - set(EXPORTABLE_PLACEMENTS))
    if unsupported:
        raise ValueError(
            f"norm placement {', '.join(unsupported)} has no stock-HF equivalent (exportable: "
            f"{', '.join(EXPORTABLE_PLACEMENTS)}); load it with AutoModelForCausalLM(..., trust_remote_code=True)"
        )
    values = model.config.to_dict()
    values.pop("model_type")  # ours; the stock class has "llama"
    config = LlamaConfig.from_dict(values)
    for key in _OUR_CONFIG_KEYS:
        if hasattr(config, key):
            delattr(config, key)
    config.architectures = ["LlamaForCausalLM"]
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    for i, layer in enumerate(model.model.layers):
        for norm_name, output_name, residual in (
                ("input_layernorm", "self_attn.o_proj", layer.attn_residual),
                ("post_attention_layernorm", "mlp.down_proj", layer.mlp_residual)):
            norm_factor, branch_factor = residual.stock_llama_factors()
            state[f"model.layers.{i}.{norm_name}.weight"] *= norm_factor
            state[f"model.layers.{i}.{output_name}.weight"] *= branch_factor
    state = {name: tensor for name, tensor in state.items() if "_residual." not in name}  # the gates, now folded
    hf_model = HFLlamaForCausalLM(config).to(next(model.parameters()).dtype)
    hf_model.load_state_dict(state, strict=True)
    return hf_model.eval()
