"""Native Hugging Face architectures a lenext model is exactly: the same computation under transformers' own code.

Each architecture says whether a model is one of its kind (``refusal``: None, or why not) and converts the weights
(``convert``). lenext rotates interleaved pairs (x[2t], x[2t+1]); GPT-NeoX and Llama rotate halves (x[t],
x[t + d/2]): the rows of each head's q and k are reordered so that the pairs meet, which leaves q.k unchanged.
docs/export.md tables which PEs and models export natively.
"""

from dataclasses import dataclass

import torch
from torch import nn

from lenext.model import NORM_EPS, Decoder
from lenext.pe import Learned, RoPE
from lenext.pe.rope import TRANSFORMERS_ROPE_TYPES, ntk_exponent, transformers_rope_parameters

# lenext's RoPE scalings with a fixed factor -> transformers' rope_type (static NTK is RoPE at a larger base; dynamic
# NTK's frequencies differ, refused below).
ROPE_TYPES = {**TRANSFORMERS_ROPE_TYPES, "ntk": TRANSFORMERS_ROPE_TYPES["none"]}


def plain_attention(net: Decoder) -> str | None:
    """Why the model's attention is not transformers' plain causal softmax attention, or None."""
    attention = net.blocks[0].attn
    if attention.window is not None:
        return f"a sliding window of {attention.window} keys"
    if attention.length_scale.kind != "none":
        return f"attention.scale={attention.length_scale.kind}"
    if attention.stick_breaking:
        return "stick-breaking attention"
    if attention.q_norm is not None:
        return "QK-norm (attention.qk_norm)"
    return None


def block_kind(net: Decoder) -> tuple[str, str]:
    """(norm, mlp) of the model's blocks: ``layernorm`` or ``rmsnorm``, ``gelu`` or ``swiglu``."""
    norm = "layernorm" if isinstance(net.norm, nn.LayerNorm) else "rmsnorm"
    return norm, "swiglu" if net.blocks[0].mlp.gated else "gelu"


def rope_parameters(rope: RoPE) -> dict | str:
    """transformers' rope_parameters for the model's RoPE, or why it has none."""
    if type(rope) is not RoPE:
        return f"its PE is {type(rope).__name__}, not RoPE"
    if rope.fraction != 1:
        return "p-RoPE (pe.fraction < 1) leaves some pairs unrotated, which no transformers architecture does"
    if rope.scaling == "dynamic_ntk":
        return (
            "pe.scaling=dynamic_ntk: transformers' dynamic RoPE keeps the frequencies of the longest sequence it saw, "
            "so a shorter one after it is not scored as lenext scores it"
        )
    if rope.scaling not in ROPE_TYPES:
        return f"pe.scaling={rope.scaling} is not a scaling transformers defines"
    if rope.scaling != "none" and rope.factor is None:
        return (
            f"pe.scaling={rope.scaling} with factor null takes its factor from each sequence's length; transformers "
            "fixes it in the config"
        )
    if rope.scaling == "ntk":  # a fixed NTK scaling is RoPE of a larger base
        theta = rope.base * rope.factor ** ntk_exponent(rope.settings(rope.original_len))
        return {"rope_type": TRANSFORMERS_ROPE_TYPES["none"], "rope_theta": theta}
    return {"rope_theta": rope.base, **transformers_rope_parameters(rope.scaling, rope.factor, rope.original_len, rope)}


def half_rotation_order(n_heads: int, head_dim: int) -> torch.Tensor:
    """Row order turning each head's interleaved pairs into halves: new row t is old 2t, new t + d/2 is old 2t+1."""
    within = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    return (torch.arange(n_heads)[:, None] * head_dim + within).flatten()


def lenext_contexts(net: Decoder, context: int) -> dict:
    """What lenext's HF import reads before transformers' settings (``lenext.hf``): ``lenext_context``, the run's
    first L_train, which eval.factors multiply (a scaling's original context may differ); and for a RoPE,
    ``lenext_scaling_context``, the C its evaluation-time scalings extend from (``RoPE.variant``: the span of
    positions training reached; N under randomized positions, a second stage's L')."""
    rope = {"lenext_scaling_context": net.pe.shape.trained_positions} if isinstance(net.pe, RoPE) else {}
    return {"lenext_context": context, **rope}


def shape_settings(net: Decoder) -> dict:
    """The model's shape in transformers' config names (Llama's, GPT-NeoX's; tools read them from any config)."""
    return {
        "vocab_size": net.vocab_size,
        "hidden_size": net.d_model,
        "num_hidden_layers": len(net.blocks),
        "num_attention_heads": net.blocks[0].attn.n_heads,
        "intermediate_size": net.blocks[0].mlp.down.in_features,
        "tie_word_embeddings": False,  # a tied lenext head is written untied (``output_head``)
    }


def output_head(net: Decoder) -> torch.Tensor:
    """The output projection (V, d): a tied one (T5's) holds the embedding scaled by d^-0.5."""
    return net.head.weight if net.head is not None else net.embedding.weight * net.d_model**-0.5


@dataclass(frozen=True)
class Architecture:
    """A transformers architecture lenext exports to natively (``name`` as ``lenext-export --architecture``)."""

    name: str
    model_class: str  # transformers' class of the causal LM

    def refusal(self, net: Decoder) -> str | None:
        raise NotImplementedError

    def convert(self, net: Decoder, context: int) -> tuple[dict, dict]:
        """(config keyword arguments, state dict in transformers' names); ``context``: the run's first L_train, the
        context eval.factors multiply (max_position_embeddings, where it is not a table's size)."""
        raise NotImplementedError

    def write(self, net: Decoder, folder, context: int, special_tokens: dict) -> None:
        """The model as this architecture, its config naming ``special_tokens`` (BOS and EOS ids), saved by
        transformers into ``folder``."""
        import transformers

        settings, state = self.convert(net, context)
        settings |= special_tokens | lenext_contexts(net, context)
        model_class = getattr(transformers, self.model_class)
        model = model_class(model_class.config_class(**settings))
        missing, unexpected = model.load_state_dict({k: v.detach().clone() for k, v in state.items()}, strict=False)
        parameters = dict(model.named_parameters())
        if unexpected or any(key in parameters for key in missing):  # buffers transformers makes are not weights
            raise RuntimeError(f"{self.name} export: weights missing {missing}, unexpected {unexpected}")
        model.save_pretrained(folder)


class RotaryArchitecture(Architecture):
    norm: str
    mlp: str

    def refusal(self, net):
        reason = plain_attention(net)
        parameters = rope_parameters(net.pe)
        if isinstance(parameters, str):
            reason = parameters
        kind = block_kind(net)
        if kind != (self.norm, self.mlp):
            reason = reason or f"its blocks use {kind[0]} and {kind[1]}; {self.name}'s use {self.norm} and {self.mlp}"
        return reason

    def rotary_rows(self, net: Decoder) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Each block's q, k (rows reordered into halves) and v weights: (d, d) each."""
        heads, head_dim = net.blocks[0].attn.n_heads, net.d_model // net.blocks[0].attn.n_heads
        order = half_rotation_order(heads, head_dim)
        return [(q[order], k[order], v) for q, k, v in (b.attn.qkv.weight.chunk(3) for b in net.blocks)]


class GPTNeoX(RotaryArchitecture):
    """GPT-NeoX (Pythia): LayerNorm, a GeLU MLP, RoPE on every dimension, sequential residuals. lenext has no
    biases: GPT-NeoX's are written as zeros."""

    norm, mlp = "layernorm", "gelu"

    def convert(self, net, context):
        heads, d = net.blocks[0].attn.n_heads, net.d_model
        head_dim = d // heads
        rope = rope_parameters(net.pe)
        config = {
            **shape_settings(net),
            "hidden_act": "gelu",
            "layer_norm_eps": NORM_EPS,
            "use_parallel_residual": False,
            "rope_parameters": {**rope, "partial_rotary_factor": 1.0},
            "attention_bias": True,
            "max_position_embeddings": context,
        }
        state = {"gpt_neox.embed_in.weight": net.embedding.weight, "lm_head.weight": output_head(net)}
        for i, (block, (q, k, v)) in enumerate(zip(net.blocks, self.rotary_rows(net), strict=True)):
            prefix = f"gpt_neox.layers.{i}."
            # GPT-NeoX's fused projection is per head: [q_h, k_h, v_h] for each head h.
            fused = torch.stack([w.view(heads, head_dim, d) for w in (q, k, v)], dim=1).reshape(3 * d, d)
            state |= {
                prefix + "input_layernorm.weight": block.attn_norm.weight,
                prefix + "input_layernorm.bias": block.attn_norm.bias,
                prefix + "post_attention_layernorm.weight": block.mlp_norm.weight,
                prefix + "post_attention_layernorm.bias": block.mlp_norm.bias,
                prefix + "attention.query_key_value.weight": fused,
                prefix + "attention.query_key_value.bias": torch.zeros(3 * d),
                prefix + "attention.dense.weight": block.attn.out.weight,
                prefix + "attention.dense.bias": torch.zeros(d),
                prefix + "mlp.dense_h_to_4h.weight": block.mlp.up.weight,
                prefix + "mlp.dense_h_to_4h.bias": torch.zeros(block.mlp.up.out_features),
                prefix + "mlp.dense_4h_to_h.weight": block.mlp.down.weight,
                prefix + "mlp.dense_4h_to_h.bias": torch.zeros(d),
            }
        state |= {"gpt_neox.final_layer_norm.weight": net.norm.weight, "gpt_neox.final_layer_norm.bias": net.norm.bias}
        return config, state


class Llama(RotaryArchitecture):
    """Llama: RMSNorm, a SwiGLU MLP, RoPE, no biases (lenext's ``model=llama``)."""

    norm, mlp = "rmsnorm", "swiglu"

    def convert(self, net, context):
        heads, d = net.blocks[0].attn.n_heads, net.d_model
        rope = rope_parameters(net.pe)
        config = {
            **shape_settings(net),
            "num_key_value_heads": heads,
            "head_dim": d // heads,
            "hidden_act": "silu",
            "rms_norm_eps": NORM_EPS,
            "rope_parameters": rope,
            "attention_bias": False,
            "mlp_bias": False,
            "max_position_embeddings": context,
        }
        state = {"model.embed_tokens.weight": net.embedding.weight, "lm_head.weight": output_head(net)}
        for i, (block, (q, k, v)) in enumerate(zip(net.blocks, self.rotary_rows(net), strict=True)):
            prefix = f"model.layers.{i}."
            gate, up = block.mlp.up.weight.chunk(2)  # lenext's SwiGLU: silu(first half) * second half
            state |= {
                prefix + "input_layernorm.weight": block.attn_norm.weight,
                prefix + "post_attention_layernorm.weight": block.mlp_norm.weight,
                prefix + "self_attn.q_proj.weight": q,
                prefix + "self_attn.k_proj.weight": k,
                prefix + "self_attn.v_proj.weight": v,
                prefix + "self_attn.o_proj.weight": block.attn.out.weight,
                prefix + "mlp.gate_proj.weight": gate,
                prefix + "mlp.up_proj.weight": up,
                prefix + "mlp.down_proj.weight": block.mlp.down.weight,
            }
        state["model.norm.weight"] = net.norm.weight
        return config, state


class GPT2(Architecture):
    """GPT-2: learned absolute positions, LayerNorm, a GeLU MLP (exact GeLU, not GPT-2's tanh one); its Conv1D
    weights are lenext's transposed, its biases zeros."""

    def refusal(self, net):
        if type(net.pe) is not Learned:
            return f"its PE is {type(net.pe).__name__}, not learned positions"
        kind = block_kind(net)
        if kind != ("layernorm", "gelu"):
            return f"its blocks use {kind[0]} and {kind[1]}; GPT-2's use layernorm and gelu"
        return plain_attention(net)

    def convert(self, net, context):  # n_positions is its table's size: lengths beyond it are n/a
        heads, d = net.blocks[0].attn.n_heads, net.d_model
        hidden = net.blocks[0].mlp.down.in_features
        config = {
            "vocab_size": net.vocab_size,
            "n_positions": net.pe.max_len,
            "n_embd": d,
            "n_layer": len(net.blocks),
            "n_head": heads,
            "n_inner": hidden,
            "activation_function": "gelu",
            "layer_norm_epsilon": NORM_EPS,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "tie_word_embeddings": False,
        }
        state = {
            "transformer.wte.weight": net.embedding.weight,
            "transformer.wpe.weight": net.pe.table.weight,
            "lm_head.weight": output_head(net),
        }
        for i, block in enumerate(net.blocks):
            prefix = f"transformer.h.{i}."
            state |= {
                prefix + "ln_1.weight": block.attn_norm.weight,
                prefix + "ln_1.bias": block.attn_norm.bias,
                prefix + "ln_2.weight": block.mlp_norm.weight,
                prefix + "ln_2.bias": block.mlp_norm.bias,
                prefix + "attn.c_attn.weight": block.attn.qkv.weight.t(),
                prefix + "attn.c_attn.bias": torch.zeros(3 * d),
                prefix + "attn.c_proj.weight": block.attn.out.weight.t(),
                prefix + "attn.c_proj.bias": torch.zeros(d),
                prefix + "mlp.c_fc.weight": block.mlp.up.weight.t(),
                prefix + "mlp.c_fc.bias": torch.zeros(hidden),
                prefix + "mlp.c_proj.weight": block.mlp.down.weight.t(),
                prefix + "mlp.c_proj.bias": torch.zeros(d),
            }
        state |= {"transformer.ln_f.weight": net.norm.weight, "transformer.ln_f.bias": net.norm.bias}
        return config, state


# In the order ``--architecture auto`` tries them.
NATIVE = {
    a.name: a
    for a in (
        Llama("llama", "LlamaForCausalLM"),
        GPTNeoX("gpt_neox", "GPTNeoXForCausalLM"),
        GPT2("gpt2", "GPT2LMHeadModel"),
    )
}
