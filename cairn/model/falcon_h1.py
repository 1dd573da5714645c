"""Falcon-H1 (TII, model_type `falcon_h1`): attention and Mamba2 side by side in every layer.

What transformers 5.24 (`models/falcon_h1/modeling_falcon_h1.py`) computes, and cairn with it. Every
layer is "hybrid": it holds one attention mixer (a KV cache) AND one Mamba2 mixer (a conv state and an
SSM state), both reading the same normed input; no layer is attention-only or SSM-only.

    x = embed_tokens(ids) * embedding_multiplier
    for each layer:
        h = input_layernorm(x)                                     plain RMSNorm: w * x / rms(x), eps rms_norm_eps
        m = mamba(h)                                               see below
        a = attention(h * attention_in_multiplier)                 see below
        x = x + m * ssm_out_multiplier + a * attention_out_multiplier
        g = pre_ff_layernorm(x)
        x = x + down_proj(up_proj(g) * silu(gate_proj(g) * mlp_multipliers[0])) * mlp_multipliers[1]
    logits = lm_head(final_layernorm(x)) * lm_head_multiplier     lm_head = embed_tokens when tied

Mamba2 mixer (cairn.layers.mamba2 with the Falcon-H1 options of its Mamba2Spec):

    [z | xBC | dt] = in_proj(h * ssm_in_multiplier) * mup       mup: ssm_multipliers[0..4] on the z, x, B, C
                                                                 and dt segments of the projection
    xBC = silu(causal depthwise conv1d over mamba_d_conv taps)   conv state: the last K-1 xBC rows
    y   = SSD scan: dt' = clamp(softplus(dt + dt_bias), time_step_limit), A = -exp(A_log), B/C per group
          (mamba_n_groups), D skip; state [mamba_n_heads, mamba_d_head, mamba_d_state] in fp32
    y   = mamba_rms_norm ?  norm(y, z)  :  y * silu(z)
          norm: RMSNorm over each group's channels (eps rms_norm_eps), gated by silu(z):
          mamba_norm_before_gate=True: w * rms(y) * silu(z); False: w * rms(y * silu(z))
    m   = out_proj(y)

    widths: inner = mamba_d_ssm (absent: 1024, the transformers default; null: mamba_expand * hidden_size),
    mamba_d_head = inner / mamba_n_heads ("auto"), conv channels = inner + 2 * n_groups * d_state,
    in_proj rows = inner (z) + conv channels (x, B, C) + n_heads (dt).
    transformers clamps dt by time_step_limit in its chunked prefill but not in its decode step; cairn
    clamps in both (one recurrence), which equals transformers whenever the limit is (0, inf), the default.

Attention (plain grouped-query attention, no q/k norm, no output gate):

    q = q_proj(h'), k = k_proj(h') * key_multiplier, v = v_proj(h')          h' = h * attention_in_multiplier
    rotary over the whole head_dim (rope_theta; only rope_type "default"), causal, scale head_dim^-0.5,
    num_key_value_heads groups; a = o_proj(attn). head_dim defaults to hidden_size / num_attention_heads but
    real checkpoints set it (Falcon-H1-0.5B: hidden 1024, 8 heads, head_dim 64).

Checkpoint tensors (names of `FalconH1ForCausalLM`, i = layer index):

    model.embed_tokens.weight                     [vocab, hidden]
    lm_head.weight                                [vocab, hidden]   absent or ignored when tie_word_embeddings
    model.final_layernorm.weight                  [hidden]
    model.layers.i.input_layernorm.weight         [hidden]
    model.layers.i.pre_ff_layernorm.weight        [hidden]
    model.layers.i.self_attn.q_proj.weight        [heads * head_dim, hidden]    (.bias iff attention_bias)
    model.layers.i.self_attn.k_proj.weight        [kv_heads * head_dim, hidden]
    model.layers.i.self_attn.v_proj.weight        [kv_heads * head_dim, hidden]
    model.layers.i.self_attn.o_proj.weight        [hidden, heads * head_dim]
    model.layers.i.mamba.in_proj.weight           [inner + conv + n_heads, hidden]  (.bias iff mamba_proj_bias)
    model.layers.i.mamba.conv1d.weight            [conv, 1, d_conv]                 (.bias iff mamba_conv_bias)
    model.layers.i.mamba.dt_bias, A_log, D        [n_heads]
    model.layers.i.mamba.norm.weight              [inner]                           (iff mamba_rms_norm)
    model.layers.i.mamba.out_proj.weight          [hidden, inner]                   (.bias iff projectors_bias)
    model.layers.i.feed_forward.gate_proj.weight  [intermediate, hidden]            (.bias iff mlp_bias)
    model.layers.i.feed_forward.up_proj.weight    [intermediate, hidden]
    model.layers.i.feed_forward.down_proj.weight  [hidden, intermediate]
    `mup_vector` is derived from ssm_multipliers and never stored (a non-persistent buffer in transformers).
    Note: projectors_bias governs the Mamba out_proj only; the attention biases follow attention_bias.

config.json keys (anything else is refused, naming the key):

    read          vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads
                  num_key_value_heads head_dim rms_norm_eps max_position_embeddings tie_word_embeddings
                  rope_theta rope_parameters rope_scaling mamba_d_ssm mamba_n_heads mamba_d_head mamba_n_groups
                  mamba_d_state mamba_d_conv mamba_expand mamba_chunk_size mamba_conv_bias mamba_proj_bias
                  mamba_rms_norm mamba_norm_before_gate time_step_limit projectors_bias embedding_multiplier
                  lm_head_multiplier key_multiplier attention_in_multiplier attention_out_multiplier
                  ssm_in_multiplier ssm_out_multiplier ssm_multipliers mlp_multipliers
                  bos_token_id eos_token_id pad_token_id
    one value     hidden_act=silu, attention_bias=false, mlp_bias=false, mamba_use_mlp=true (every layer has
                  its MLP), attn_layer_indices=null (attention in every layer), quantization_config=null
    no effect     initializer_range use_cache num_logits_to_keep attention_dropout mlp_expansion_factor
                  (intermediate_size is what shapes the MLP) time_step_min time_step_max time_step_floor
                  time_step_rank (initialisation only) model_type architectures transformers_version
                  torch_dtype dtype _name_or_path
"""
