"""The MoE shape of a model from its Hugging Face config.json (DESIGN §9).

    from moe_ep_client import ModelConfig
    model = ModelConfig.load("DeepSeek-V3.json")   # or a dict, or a directory
    model.hidden_size, model.num_experts, model.top_k, model.moe_intermediate_size
    model.sparse_layer_indices()                    # [3, 4, ..., 60]

The same rules as the worker's and the CLI's reader, core/model_config.cc
(ParseModelConfig), for the keys a Group needs: the family from model_type;
routed experts from n_routed_experts, num_experts or num_local_experts, top-k
from num_experts_per_tok or experts_per_token (present keys must agree; top-k
at most the experts); the expert FFN size from moe_intermediate_size where
present, else intermediate_size (Llama-4: intermediate_size of text_config;
Jamba: intermediate_size); the sparse layers by each family's rule. Shared
experts, routed scaling and quantization are not read here: the worker reads
its weights itself (LoadExperts), and `moe-ep plan --model` reports them.

Errors: ValueError naming the key, with core/model_config.cc's wording
("model config key 'hidden_size' must be an integer, got ..."); FileNotFoundError
for a path that does not exist. Standard library only; pure and thread-safe.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, List, Mapping, Optional, Sequence, Tuple, Union

_INT_MAX = 2**31 - 1
_INT64_MAX = 2**63 - 1

# model_type -> family (core/model_config.cc Families()).
_FAMILIES = {
    "deepseek_v2": "deepseek",
    "deepseek_v3": "deepseek",
    "kimi_k2": "deepseek",
    "qwen2_moe": "qwen_moe",
    "qwen3_moe": "qwen_moe",
    "mixtral": "all_sparse",
    "gpt_oss": "all_sparse",
    "minimax_m2": "all_sparse",
    "llama4": "llama4",
    "llama4_text": "llama4",
    "jamba": "jamba",
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The sizes a Group configures and allocates with (core::ModelDescription)."""

    name: str  # the file's stem ("DeepSeek-V3"), or what the caller named it
    model_type: str  # e.g. "deepseek_v3"
    hidden_size: int  # H, elements
    num_layers: int  # decoder layers
    num_experts: int  # routed experts per sparse layer
    top_k: int  # K, routed experts per token
    moe_intermediate_size: int  # I of one routed expert, elements
    sparse_layers: Tuple[bool, ...]  # [num_layers]; True = MoE layer

    def sparse_layer_indices(self) -> List[int]:
        """Indices of the sparse (MoE) layers, ascending."""
        return [i for i, sparse in enumerate(self.sparse_layers) if sparse]

    @staticmethod
    def load(config: Union[str, "os.PathLike[str]", Mapping[str, Any]], name: str = "") -> "ModelConfig":
        """Reads a config.json path (a directory: its config.json) or a parsed dict.

        `name` defaults to the file's stem (a dict: its model_type).
        """
        if isinstance(config, Mapping):
            return _parse(config, name or str(config.get("model_type", "")))
        path = os.fspath(config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"model config file '{path}' does not exist")
        with open(path, encoding="utf-8") as f:
            try:
                parsed = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"model config file '{path}' is not valid JSON: {e}") from e
        stem = os.path.splitext(os.path.basename(path))[0]
        try:
            return _parse(parsed, name or stem)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from e


class _Reader:
    """Key lookups in one JSON object; `where` prefixes key names ("text_config.")."""

    def __init__(self, obj: Mapping[str, Any], where: str = ""):
        self.obj = obj
        self.where = where

    def key(self, k: str) -> str:
        return self.where + k

    def has(self, k: str) -> bool:
        return self.obj.get(k) is not None

    def optional_int(self, k: str, lo: int, hi: int) -> Optional[int]:
        if not self.has(k):
            return None
        v = self.obj[k]
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(
                f"model config key '{self.key(k)}' must be an integer, got "
                f"{_json_type(v)} {json.dumps(v)}"
            )
        if not lo <= v <= hi:
            raise ValueError(f"model config key '{self.key(k)}' must be in [{lo}, {hi}], got {v}")
        return v

    def required_int(self, k: str, lo: int, hi: int) -> int:
        v = self.optional_int(k, lo, hi)
        if v is None:
            raise ValueError(f"model config is missing required key '{self.key(k)}'")
        return v

    def int_or(self, k: str, fallback: int, lo: int, hi: int) -> int:
        v = self.optional_int(k, lo, hi)
        return fallback if v is None else v

    def one_of_int(self, keys: Sequence[str], lo: int, hi: int) -> int:
        found: Optional[int] = None
        found_key = ""
        for k in keys:
            v = self.optional_int(k, lo, hi)
            if v is None:
                continue
            if found is not None and v != found:
                raise ValueError(
                    f"model config keys '{self.key(found_key)}' ({found}) and "
                    f"'{self.key(k)}' ({v}) disagree"
                )
            if found is None:
                found, found_key = v, k
        if found is None:
            names = ", ".join(f"'{self.key(k)}'" for k in keys)
            raise ValueError(f"model config is missing required key: one of {names}")
        return found

    def layer_list(self, k: str, num_layers: int) -> List[int]:
        if not self.has(k):
            return []
        v = self.obj[k]
        if not isinstance(v, list):
            raise ValueError(
                f"model config key '{self.key(k)}' must be a list of layer indices, got "
                f"{_json_type(v)}"
            )
        out = []
        for i, e in enumerate(v):
            if isinstance(e, bool) or not isinstance(e, int) or not 0 <= e < num_layers:
                raise ValueError(
                    f"model config key '{self.key(k)}' entry {i} must be a layer index in "
                    f"[0, {num_layers}), got {json.dumps(e)}"
                )
            out.append(e)
        return out


def _json_type(v: Any) -> str:
    """nlohmann::json's type_name() of a parsed JSON value."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "object"


def _parse(config: Mapping[str, Any], name: str) -> ModelConfig:
    if not isinstance(config, Mapping):
        raise ValueError(f"model config must be a JSON object, got {_json_type(config)}")
    supported = ", ".join(sorted(_FAMILIES))
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        raise ValueError(
            f"model config key 'model_type' is missing or not a string; supported: {supported}"
        )
    family = _FAMILIES.get(model_type)
    if family is None:
        raise ValueError(
            f"model config key 'model_type' is '{model_type}', not a supported MoE family "
            f"(supported: {supported})"
        )
    r = _Reader(config)
    if model_type == "llama4":  # the language model sits under text_config
        text = config.get("text_config")
        if not isinstance(text, Mapping):
            raise ValueError(
                "model config key 'text_config' is missing or not an object (required for llama4)"
            )
        r = _Reader(text, "text_config.")

    hidden = r.required_int("hidden_size", 1, _INT64_MAX)
    num_layers = r.required_int("num_hidden_layers", 1, _INT_MAX)
    experts = r.one_of_int(["n_routed_experts", "num_experts", "num_local_experts"], 1, _INT_MAX)
    top_k = r.one_of_int(["num_experts_per_tok", "experts_per_token"], 1, _INT_MAX)
    if top_k > experts:
        raise ValueError(
            f"model config top-k ({r.key('num_experts_per_tok')}) {top_k} exceeds the number "
            f"of routed experts {experts}"
        )
    # Expert and dense MLP sizes (0: no dense MLP).
    if family == "llama4":
        moe_intermediate = r.required_int("intermediate_size", 1, _INT64_MAX)
        dense_intermediate = r.int_or("intermediate_size_mlp", 0, 1, _INT64_MAX)
    elif family == "jamba":  # both MLPs are intermediate_size wide
        moe_intermediate = dense_intermediate = r.required_int("intermediate_size", 1, _INT64_MAX)
    elif r.has("moe_intermediate_size"):
        moe_intermediate = r.required_int("moe_intermediate_size", 1, _INT64_MAX)
        dense_intermediate = r.int_or("intermediate_size", 0, 1, _INT64_MAX)
    else:  # Mixtral, gpt-oss, MiniMax: intermediate_size is the expert's; no dense MLP
        moe_intermediate = r.required_int("intermediate_size", 1, _INT64_MAX)
        dense_intermediate = 0

    L = num_layers
    rule_keys = ""
    if family == "deepseek":
        first_dense = r.int_or("first_k_dense_replace", 0, 0, L)
        freq = r.int_or("moe_layer_freq", 1, 1, _INT_MAX)
        sparse = [i >= first_dense and i % freq == 0 for i in range(L)]
        rule_keys = f"'{r.key('first_k_dense_replace')}', '{r.key('moe_layer_freq')}'"
    elif family == "qwen_moe":
        step = r.int_or("decoder_sparse_step", 1, 1, _INT_MAX)
        mlp_only = set(r.layer_list("mlp_only_layers", L))
        sparse = [(i + 1) % step == 0 and i not in mlp_only for i in range(L)]
        rule_keys = f"'{r.key('decoder_sparse_step')}', '{r.key('mlp_only_layers')}'"
    elif family == "all_sparse":
        sparse = [True] * L
    elif family == "jamba":
        period = r.int_or("expert_layer_period", 2, 1, _INT_MAX)
        offset = r.int_or("expert_layer_offset", 1, 0, period - 1)
        sparse = [i % period == offset for i in range(L)]
        rule_keys = f"'{r.key('expert_layer_period')}', '{r.key('expert_layer_offset')}'"
    else:  # llama4
        if r.has("moe_layers"):
            moe_layers = set(r.layer_list("moe_layers", L))
            sparse = [i in moe_layers for i in range(L)]
            rule_keys = f"'{r.key('moe_layers')}'"
        else:
            step = r.int_or("interleave_moe_layer_step", 1, 1, _INT_MAX)
            sparse = [(i + 1) % step == 0 for i in range(L)]
            rule_keys = f"'{r.key('interleave_moe_layer_step')}'"
    if not any(sparse):
        raise ValueError(
            f"model config has no sparse (MoE) layer among {L} layers; check {rule_keys}"
        )
    if not all(sparse) and dense_intermediate == 0:
        key = r.key("intermediate_size_mlp" if family == "llama4" else "intermediate_size")
        raise ValueError(
            f"model config has {L - sum(sparse)} dense layers but no dense MLP size '{key}'"
        )
    return ModelConfig(
        name=name,
        model_type=model_type,
        hidden_size=hidden,
        num_layers=num_layers,
        num_experts=experts,
        top_k=top_k,
        moe_intermediate_size=moe_intermediate,
        sparse_layers=tuple(sparse),
    )

