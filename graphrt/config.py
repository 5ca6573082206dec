"""ModelConfig: the shapes and switches graphrt needs, normalised from a Hugging Face config.json.

One frozen dataclass describes a target LM (Llama, Qwen2, Qwen3) or a draft (a standalone LM, an
EAGLE-1/2 head, an EAGLE-3 head). `ModelConfig.from_hf_dict` reads the spellings published
config.json files use and rejects what graphrt does not run, naming the file and the field. The
published EAGLE-1/2 and original EAGLE-3 heads say `"architectures": ["LlamaForCausalLM"]` with one
layer, so the checkpoint's {name: shape} table decides what they are (`midlayer.*`/`d2t` ->
EAGLE-3; `fc.weight` of width 2H -> EAGLE-1/2).

EAGLE-3 aux layer id j is the target's residual stream *entering* decoder layer j (0 = the token
embeddings, L = the last layer's output before the final norm), as the EAGLE reference
(SafeAILab/EAGLE modeling_llama_kv.py) and vLLM capture them; the states are concatenated low, mid,
high along the feature dimension before `fc`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from graphrt.errors import CheckpointError, ConfigMismatchError

ARCHITECTURES = ("llama", "qwen2", "qwen3", "eagle", "eagle3")

# HF `architectures[0]` spellings graphrt accepts, by what they mean.
LM_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
EAGLE_ARCHITECTURES = ("EagleLlamaForCausalLM", "LlamaForCausalLMEagle")
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
# model_type values that may accompany LlamaForCausalLM (mistral-style configs without a sliding window).
LLAMA_MODEL_TYPES = ("llama", "mistral")

DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "float": "float32", "float16": "float16",
               "fp16": "float16", "half": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16"}

# ModelConfig.architecture -> (architectures[0], model_type) written by to_hf_dict.
# The published EAGLE-1/2 heads (yuhuili/EAGLE-*) say LlamaForCausalLM; the loader tells them apart
# by their weights, so the writer keeps the published spelling.
_HF_NAMES = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
             "qwen3": ("Qwen3ForCausalLM", "qwen3"), "eagle": ("LlamaForCausalLM", "llama"),
             "eagle3": ("LlamaForCausalLMEagle3", "llama")}


def default_eagle3_aux_layer_ids(num_target_layers: int) -> tuple[int, int, int]:
    """The target layers an EAGLE-3 head reads when its config pins none: (2, L//2, L-3).

    Same default in the EAGLE reference, vLLM (`get_eagle3_aux_hidden_state_layers`) and SGLang
    (`set_eagle3_layers_to_capture(None)`); ids use the "entering layer j" convention (module doc).
    """
    n = int(num_target_layers)
    # For L < 5 that formula leaves [0, L] or is out of order (L=4 gives (2, 2, 1)): clamp and sort,
    # which changes nothing for L >= 5. Tiny test targets only; real targets have L >= 16.
    return tuple(sorted(min(max(i, 0), n) for i in (2, n // 2, n - 3)))


def _where(path: str | None, file: str = "config.json") -> str:
    if path is None:
        return file
    if str(path).endswith(".gguf"):  # a GGUF file's metadata stands in for config.json
        return str(path)
    if os.path.basename(str(path)) == file:
        return str(path)
    return os.path.join(str(path), file)


@dataclass(frozen=True)
class ModelConfig:
    """Everything graphrt needs to build a model or validate its weights.

    Sizes follow HF names. `head_dim` is explicit (Qwen3 and Llama-3.2 configs carry it; otherwise
    hidden_size // num_attention_heads). Biases: `attention_bias` is q/k/v bias, `o_proj_bias` the
    output projection's (Llama/Qwen3 `attention_bias: true` sets both; Qwen2 has q/k/v bias and no
    o_proj bias). `rope_scaling` is None (plain RoPE) or the normalised llama3 dict
    {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"}.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    o_proj_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    torch_dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # drafts
    target_hidden_size: int | None = None  # EAGLE-3: width of each fused target state; fc is [H, 3 * this]
    draft_vocab_size: int | None = None  # EAGLE-3: rows of the draft lm_head (d2t maps them to target ids)
    eagle_fc_bias: bool = False  # EAGLE-1/2: fc has a bias (the EAGLE repo's config key `bias`)
    # EAGLE-3: the target layers fused low/mid/high; None: the default, resolved by aux_layer_ids_for
    eagle_aux_layer_ids: tuple[int, ...] | None = None
    has_input_layernorm: bool = True  # EAGLE-1/2: layer 0 has input_layernorm (published heads do not)
    has_embed_tokens: bool = True  # drafts: an embed_tokens.weight of its own, else the target's table
    norm_before_residual: bool = False  # EAGLE-3 (vLLM's switch): layer 0's residual is hidden_norm(fc_out)
    # where it came from, for error messages only
    source: str | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        where = _where(self.source)
        s = object.__setattr__

        def fail(msg):
            raise CheckpointError(f"{where}: {msg}")

        if self.architecture not in ARCHITECTURES:
            fail(f"architecture {self.architecture!r} is not one of {', '.join(ARCHITECTURES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "max_position_embeddings"):
            _check_int(where, name, getattr(self, name))
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                fail(f"field 'num_attention_heads' ({self.num_attention_heads}) does not divide "
                     f"hidden_size ({self.hidden_size}) and no head_dim is given")
            s(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_key_value_heads is None:
            s(self, "num_key_value_heads", self.num_attention_heads)
        _check_int(where, "num_key_value_heads", self.num_key_value_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            fail(f"field 'num_key_value_heads' ({self.num_key_value_heads}) must divide "
                 f"num_attention_heads ({self.num_attention_heads})")
        _check_int(where, "head_dim", self.head_dim)
        if self.head_dim % 2:
            fail(f"field 'head_dim' must be even for RoPE, found {self.head_dim}")
        for name in ("rms_norm_eps", "rope_theta"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                fail(f"field {name!r} must be a positive number, found {v!r}")
            s(self, name, float(v))
        for name in ("tie_word_embeddings", "attention_bias", "o_proj_bias", "qk_norm", "eagle_fc_bias",
                     "has_input_layernorm", "has_embed_tokens", "norm_before_residual"):
            if not isinstance(getattr(self, name), bool):
                fail(f"field {name!r} must be true or false, found {getattr(self, name)!r}")
        if self.hidden_act != "silu":
            fail(f"field 'hidden_act' is {self.hidden_act!r}; graphrt runs SiLU-gated MLPs only")
        if self.torch_dtype is not None and self.torch_dtype not in ("float32", "float16", "bfloat16"):
            fail(f"field 'torch_dtype' {self.torch_dtype!r} is not a float dtype")
        if self.rope_scaling is not None:
            s(self, "rope_scaling", _normalise_rope_scaling(dict(self.rope_scaling), where, "rope_scaling"))
        if self.bos_token_id is not None:
            _check_int(where, "bos_token_id", self.bos_token_id, 0)
        eos = tuple(self.eos_token_ids)
        for t in eos:
            _check_int(where, "eos_token_id", t, 0)
        s(self, "eos_token_ids", eos)
        if self.architecture == "eagle3":
            if self.target_hidden_size is None:
                s(self, "target_hidden_size", self.hidden_size)
            if self.draft_vocab_size is None:
                s(self, "draft_vocab_size", self.vocab_size)
            _check_int(where, "target_hidden_size", self.target_hidden_size)
            _check_int(where, "draft_vocab_size", self.draft_vocab_size)
            if self.draft_vocab_size > self.vocab_size:
                fail(f"field 'draft_vocab_size' ({self.draft_vocab_size}) exceeds vocab_size ({self.vocab_size})")
        else:
            for name in ("target_hidden_size", "draft_vocab_size"):
                if getattr(self, name) is not None:
                    fail(f"field {name!r} is only meaningful for an EAGLE-3 head, "
                         f"not architecture {self.architecture!r}")
        if self.eagle_aux_layer_ids is not None:
            ids = tuple(self.eagle_aux_layer_ids)
            if self.architecture != "eagle3":
                fail("field 'eagle_aux_layer_ids' is only meaningful for EAGLE-3")
            if not ids:
                fail("field 'eagle_aux_hidden_state_layer_ids' is empty")
            for i in ids:
                _check_int(where, "eagle_aux_hidden_state_layer_ids", i, 0)
            s(self, "eagle_aux_layer_ids", ids)

    # -- derived ------------------------------------------------------------------------------------

    @property
    def kind(self) -> str:
        """ "lm" for Llama/Qwen LMs (targets or standalone drafts), else "eagle" / "eagle3"."""
        return self.architecture if self.architecture in ("eagle", "eagle3") else "lm"

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def aux_layer_ids_for(self, target: ModelConfig) -> tuple[int, ...]:
        """EAGLE-3: the target layer ids to capture, pinned or default; ConfigMismatchError when
        they are not three boundaries of `target`'s layers."""
        ids = self.eagle_aux_layer_ids or default_eagle3_aux_layer_ids(target.num_hidden_layers)
        n = target.num_hidden_layers
        if len(ids) != 3 or not all(0 <= i <= n for i in ids):
            raise ConfigMismatchError(f"draft {self.source or 'draft'} does not fit target {target.source or 'target'}"
                                      f": field 'eagle_aux_hidden_state_layer_ids' {list(ids)}: an EAGLE-3 head "
                                      f"fuses three target layer boundaries in [0, {n}]")
        return ids

    def with_(self, **changes) -> ModelConfig:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    # -- HF dict conversion -------------------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], path: str | os.PathLike | None = None, *,
                     weight_shapes: Mapping[str, tuple[int, ...]] | None = None) -> ModelConfig:
        """Normalise a parsed HF config.json.

        path: the checkpoint folder or the config.json path (for messages).
        weight_shapes: {stored tensor name: shape} of the checkpoint, which tells EAGLE heads from
            one-layer Llamas and says what only the weights say (fc bias, layer-0 input norm,
            EAGLE-3 fc width, whether the draft carries embeddings).
        """
        src = None if path is None else str(path)
        where = _where(src)

        def fail(msg):
            raise CheckpointError(f"{where}: {msg}")

        if not isinstance(d, Mapping):
            fail(f"expected a JSON object at top level, found {type(d).__name__}")
        shapes = dict(weight_shapes or {})
        stripped = {n[len("model."):] if n.startswith("model.") else n: shp for n, shp in shapes.items()}

        archs = d.get("architectures")
        if archs is not None and (not isinstance(archs, list) or not all(isinstance(a, str) for a in archs)):
            fail(f"field 'architectures' must be a list of strings, found {archs!r}")
        arch0 = archs[0] if archs else None
        model_type = d.get("model_type")
        if model_type is not None and not isinstance(model_type, str):
            fail(f"field 'model_type' must be a string, found {model_type!r}")
        architecture = _detect_architecture(where, arch0, model_type, d, set(shapes), stripped)

        def req(name):
            if name not in d or d[name] is None:
                fail(f"required field {name!r} is missing")
            return d[name]

        def opt(name, default):
            v = d.get(name)
            return default if v is None else v

        hidden = req("hidden_size")
        rope_theta, rope_scaling = _read_rope(d, where)
        eos = d.get("eos_token_id")
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        dtype_raw = d.get("torch_dtype") if d.get("torch_dtype") is not None else d.get("dtype")
        torch_dtype = None
        if dtype_raw is not None:
            if not isinstance(dtype_raw, str) or dtype_raw.replace("torch.", "") not in DTYPE_NAMES:
                fail(f"field 'torch_dtype' {dtype_raw!r} is not a float dtype")
            torch_dtype = DTYPE_NAMES[dtype_raw.replace("torch.", "")]
        if d.get("mlp_bias"):
            fail("field 'mlp_bias' is true; graphrt supports bias-free MLPs only")
        if d.get("use_sliding_window") or (architecture == "llama" and d.get("sliding_window") is not None):
            fail("field 'use_sliding_window'/'sliding_window' asks for sliding-window attention, which graphrt "
                 "does not run")
        if d.get("pretraining_tp") not in (None, 1):
            fail(f"field 'pretraining_tp' must be 1, found {d.get('pretraining_tp')!r}")
        att_bias = opt("attention_bias", False)
        qkv_bias, o_bias = (True, False) if architecture == "qwen2" else (att_bias, att_bias)

        extra: dict[str, Any] = {}
        if architecture == "eagle":
            extra["eagle_fc_bias"] = ("fc.bias" in stripped) if shapes else bool(opt("bias", True))
            extra["has_input_layernorm"] = ("layers.0.input_layernorm.weight" in stripped) if shapes else False
            extra["has_embed_tokens"] = ("embed_tokens.weight" in stripped) if shapes else True
        elif architecture == "eagle3":
            th = d.get("target_hidden_size")
            fc = stripped.get("fc.weight")
            if th is None and fc is not None and len(fc) == 2 and fc[1] % 3 == 0:
                th = fc[1] // 3  # the config pins none: the fc width says it
            extra.update(target_hidden_size=th, draft_vocab_size=d.get("draft_vocab_size"),
                         has_embed_tokens=("embed_tokens.weight" in stripped) if shapes else False,
                         eagle_aux_layer_ids=_read_aux_ids(d, where),
                         norm_before_residual=bool(opt("norm_before_residual", False)))
        try:
            return cls(architecture=architecture, vocab_size=req("vocab_size"), hidden_size=hidden,
                       intermediate_size=req("intermediate_size"), num_hidden_layers=req("num_hidden_layers"),
                       num_attention_heads=req("num_attention_heads"),
                       num_key_value_heads=d.get("num_key_value_heads"), head_dim=d.get("head_dim"),
                       rms_norm_eps=opt("rms_norm_eps", 1e-6), rope_theta=rope_theta, rope_scaling=rope_scaling,
                       max_position_embeddings=opt("max_position_embeddings", 2048),
                       tie_word_embeddings=opt("tie_word_embeddings", False), attention_bias=qkv_bias,
                       o_proj_bias=o_bias, qk_norm=architecture == "qwen3", hidden_act=opt("hidden_act", "silu"),
                       torch_dtype=torch_dtype, bos_token_id=d.get("bos_token_id"), eos_token_ids=eos_ids,
                       source=src, **extra)
        except TypeError as exc:  # pragma: no cover - defensive: a field of a type we did not expect
            raise CheckpointError(f"{where}: malformed field ({exc})") from exc

    def to_hf_dict(self) -> dict[str, Any]:
        """An HF-style config.json dict that `from_hf_dict` reads back to an equal ModelConfig, in the
        published (transformers 4) spelling: `torch_dtype`, `rope_theta`, `rope_scaling`; transformers
        5 reads these too."""
        arch_name, model_type = _HF_NAMES[self.architecture]
        d: dict[str, Any] = {"architectures": [arch_name], "model_type": model_type}
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "rope_theta"):
            d[name] = getattr(self, name)
        d.update(rope_scaling=None if self.rope_scaling is None else dict(self.rope_scaling),
                 max_position_embeddings=self.max_position_embeddings,
                 tie_word_embeddings=self.tie_word_embeddings, initializer_range=0.02, use_cache=True)
        if self.architecture != "qwen2":
            d["attention_bias"] = self.attention_bias
        if self.architecture in ("qwen2", "qwen3"):
            d["use_sliding_window"] = False
            d["sliding_window"] = None
        if self.torch_dtype is not None:
            d["torch_dtype"] = self.torch_dtype
        if self.bos_token_id is not None:
            d["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            d["eos_token_id"] = self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids)
        if self.architecture == "eagle":
            d["bias"] = self.eagle_fc_bias  # the EAGLE repo's name for the fc bias switch
        if self.architecture == "eagle3":
            d["draft_vocab_size"] = self.draft_vocab_size
            d["target_hidden_size"] = self.target_hidden_size
            if self.norm_before_residual:
                d["norm_before_residual"] = True
            if self.eagle_aux_layer_ids is not None:
                # top-level spelling = vLLM/speculators convention = "entering layer j", as stored.
                d["eagle_aux_hidden_state_layer_ids"] = list(self.eagle_aux_layer_ids)
        return d


def read_config_json(path: str | os.PathLike) -> dict[str, Any]:
    """config.json as a dict, merged with generation_config.json's eos ids; errors name the file."""
    path = str(path)
    cfg_file = path if path.endswith(".json") else os.path.join(path, "config.json")
    d = _read_json(cfg_file, required=True)
    gen_file = os.path.join(os.path.dirname(cfg_file), "generation_config.json")
    extra = (_read_json(gen_file, required=False) or {}).get("eos_token_id")
    if extra is not None:
        base = d.get("eos_token_id")
        base_l = [] if base is None else (list(base) if isinstance(base, list) else [base])
        extra_l = list(extra) if isinstance(extra, list) else [extra]
        for t in extra_l:
            if not isinstance(t, int) or isinstance(t, bool):
                raise CheckpointError(f"{gen_file}: field 'eos_token_id' holds {t!r}, not a token id")
        d = {**d, "eos_token_id": base_l + [t for t in extra_l if t not in base_l]}
    return d


def _read_json(file: str, *, required: bool) -> dict[str, Any] | None:
    if not os.path.exists(file):
        if required:
            raise CheckpointError(f"{file}: file not found (a checkpoint folder needs config.json)")
        return None
    try:
        with open(file, encoding="utf-8") as f:
            d = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{file}: not valid JSON ({exc})") from exc
    if not isinstance(d, dict):
        raise CheckpointError(f"{file}: expected a JSON object at top level, found {type(d).__name__}")
    return d


# -- helpers ---------------------------------------------------------------------------------------


def _check_int(where: str, name: str, v: Any, least: int = 1) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < least:
        what = "a positive" if least == 1 else "a non-negative"
        raise CheckpointError(f"{where}: field {name!r} must be {what} integer, found {v!r}")


def _detect_architecture(where, arch0, model_type, d, names, stripped) -> str:
    """Decide llama / qwen2 / qwen3 / eagle / eagle3 from the config and (if given) the weight names."""
    fc, hidden = stripped.get("fc.weight"), d.get("hidden_size")
    eagle3 = (any(n.startswith(("midlayer.", "model.midlayer.")) for n in names) or "d2t" in stripped
              or arch0 in EAGLE3_ARCHITECTURES or (arch0 == "LlamaForCausalLM" and "draft_vocab_size" in d
                                                   and not names))
    eagle = (arch0 in EAGLE_ARCHITECTURES or (fc is not None and isinstance(hidden, int) and len(fc) == 2
                                              and tuple(fc) == (hidden, 2 * hidden)))
    if eagle3:
        if arch0 is not None and arch0 not in EAGLE3_ARCHITECTURES and arch0 != "LlamaForCausalLM":
            raise CheckpointError(f"{where}: field 'architectures' is {[arch0]!r}, not an EAGLE-3 Llama head "
                                  f"({', '.join(EAGLE3_ARCHITECTURES)} or LlamaForCausalLM with midlayer.* weights)")
        return "eagle3"
    if eagle:
        if arch0 is not None and arch0 not in EAGLE_ARCHITECTURES and arch0 != "LlamaForCausalLM":
            raise CheckpointError(f"{where}: field 'architectures' is {[arch0]!r}, not an EAGLE-1/2 Llama head")
        return "eagle"
    if arch0 is None:  # no architectures list: model_type decides (some hand-written configs)
        by_type = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
        if model_type in by_type:
            return by_type[model_type]
        raise CheckpointError(
            f"{where}: field 'architectures' is missing and model_type {model_type!r} is not one graphrt "
            f"runs (supported: {', '.join(LM_ARCHITECTURES)}, EAGLE-1/2 and EAGLE-3 Llama heads)")
    if arch0 not in LM_ARCHITECTURES:
        raise CheckpointError(
            f"{where}: field 'architectures' is {[arch0]!r}, which graphrt does not run (supported: "
            f"{', '.join(LM_ARCHITECTURES)}, EAGLE-1/2 heads, {', '.join(EAGLE3_ARCHITECTURES)})")
    arch = LM_ARCHITECTURES[arch0]
    if arch == "llama" and model_type is not None and model_type not in LLAMA_MODEL_TYPES:
        raise CheckpointError(f"{where}: field 'model_type' is {model_type!r} but architectures says "
                              "LlamaForCausalLM")
    return arch


def _read_rope(d: Mapping[str, Any], where: str) -> tuple[float, dict | None]:
    """(rope_theta, normalised rope_scaling) from either spelling."""
    rp = d.get("rope_parameters")
    if rp is not None:
        if not isinstance(rp, dict):
            raise CheckpointError(f"{where}: field 'rope_parameters' must be an object, found {rp!r}")
        if rp and all(isinstance(v, dict) for v in rp.values()):
            raise CheckpointError(f"{where}: field 'rope_parameters' holds per-layer-type RoPE settings "
                                  f"({', '.join(rp)}); graphrt runs one RoPE for every layer")
        return rp.get("rope_theta", d.get("rope_theta", 10000.0)), _normalise_rope_scaling(dict(rp), where,
                                                                                          "rope_parameters")
    theta = d.get("rope_theta")
    theta = 10000.0 if theta is None else theta
    rs = d.get("rope_scaling")
    if rs is None:
        return theta, None
    if not isinstance(rs, dict):
        raise CheckpointError(f"{where}: field 'rope_scaling' must be an object or null, found {rs!r}")
    return theta, _normalise_rope_scaling(dict(rs), where, "rope_scaling")


def _normalise_rope_scaling(rs: dict, where: str, field_name: str) -> dict | None:
    rope_type = rs.get("rope_type", rs.get("type", "default"))
    if rope_type in (None, "default"):
        return None
    at = f"{where}: field '{field_name}"
    if rope_type != "llama3":
        raise CheckpointError(f"{at}.rope_type' is {rope_type!r}; graphrt supports 'default' and 'llama3'")
    out: dict[str, Any] = {"rope_type": "llama3"}
    for key, typ in (("factor", float), ("low_freq_factor", float), ("high_freq_factor", float),
                     ("original_max_position_embeddings", int)):
        v = rs.get(key)
        if v is None:
            raise CheckpointError(f"{at}.{key}' is missing (needed by llama3 RoPE)")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise CheckpointError(f"{at}.{key}' must be a positive number, found {v!r}")
        if typ is int and v != int(v):
            raise CheckpointError(f"{at}.{key}' must be an integer, found {v!r}")
        out[key] = typ(v)
    if out["high_freq_factor"] <= out["low_freq_factor"]:
        raise CheckpointError(f"{at}.high_freq_factor' ({out['high_freq_factor']}) must exceed "
                              f"low_freq_factor ({out['low_freq_factor']})")
    return out


def _read_aux_ids(d: Mapping[str, Any], where: str) -> tuple[int, ...] | None:
    """EAGLE-3 aux layer ids, converted to the "entering layer j" convention.

    Two spellings exist and the two serving stacks read them differently:
      * top-level `eagle_aux_hidden_state_layer_ids` (vLLM speculators format): vLLM uses the ids as
        "entering layer j" directly -> kept as is;
      * `eagle_config.eagle_aux_hidden_state_layer_ids` (written by SpecForge, read by SGLang): SGLang's
        `set_eagle3_layers_to_capture` adds 1 ("output of layer k" -> entering layer k+1) -> +1 here.
        (vLLM's gpu_model_runner also reads this nested key but without the +1: the stacks disagree;
        graphrt follows the writer of the key.)
    """
    def ints(ids, key):
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise CheckpointError(f"{where}: field {key!r} must be a list of ints")
        return tuple(ids)

    top = d.get("eagle_aux_hidden_state_layer_ids")
    if top:
        return ints(top, "eagle_aux_hidden_state_layer_ids")
    ec = d.get("eagle_config")
    if isinstance(ec, dict) and ec.get("eagle_aux_hidden_state_layer_ids"):
        ids = ints(ec["eagle_aux_hidden_state_layer_ids"], "eagle_config.eagle_aux_hidden_state_layer_ids")
        return tuple(i + 1 for i in ids)
    if isinstance(ec, dict) and ec.get("use_aux_hidden_state") is False:
        raise CheckpointError(f"{where}: field 'eagle_config.use_aux_hidden_state' is false; graphrt runs "
                              "EAGLE-3 heads that fuse three target layers")
    return None

