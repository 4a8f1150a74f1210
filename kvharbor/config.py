"""Configuration models at the edges (pydantic): engine, router and platform."""

from __future__ import annotations

import json
import re
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from kvharbor.engine.model_info import chat_template_text     # torch-free, as this module


DTYPES = "^(auto|float32|float16|bfloat16)$"
BACKENDS = "^(auto|cpu|reference|triton)$"
KV_DTYPES = "^(auto|int8|fp8_e4m3)$"
KvCacheDtype = Annotated[str, BeforeValidator(lambda v: "fp8_e4m3" if v == "fp8" else v),
                         Field(pattern=KV_DTYPES)]
"""A KV cache dtype; vLLM's ``fp8`` is read as ``fp8_e4m3``."""


def json_option(value, name: str, example: str):
    """An option given as JSON text (the ``serve run`` command line), parsed; any other value as
    it is. Raises ValueError naming the option ``name`` and showing ``example``."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"{name} takes JSON, e.g. {example}: {e}") from None


class QoSSpec(BaseModel):
    """What the engine needs to know about a QoS class."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    priority: int = Field(0, description="Scheduling priority; higher is served first and preempted last.")
    pinned: bool = Field(False, description="Requests of this class may use the pinned KV region.")
    preemptible: bool = Field(True, description="Higher classes may preempt running requests of this class.")
    ttft_slo_ms: float | None = Field(None, gt=0, description="Time-to-first-token target (ms). While "
                                      "requests of this class are about, steps of the engine are kept "
                                      "under half of it by trimming lower classes' work (unless step_target_ms is set).")
    step_target_ms: float | None = Field(None, gt=0, description="Longest estimated engine step (ms) "
                                         "while requests of this class are about (None: ttft_slo_ms / 2).")

    def step_target_s(self) -> float | None:
        """The step-duration target in seconds (None: no time budget for this class)."""
        ms = self.step_target_ms or (self.ttft_slo_ms / 2 if self.ttft_slo_ms else None)
        return ms / 1000.0 if ms else None


DEFAULT_QOS = {
    "premium": QoSSpec(priority=100, pinned=True, preemptible=False),
    "standard": QoSSpec(priority=50),
    "batch": QoSSpec(priority=10),
}


class SpeculativeConfig(BaseModel):
    """Speculative decoding (vLLM's ``speculative_config``): each step, a running request
    proposes up to ``num_speculative_tokens`` draft tokens and the model verifies them in the
    same forward (see engine/spec_decode.py). ``ngram`` (prompt lookup) drafts the tokens that
    followed the most recent earlier occurrence of the request's last n tokens, for n from
    ``prompt_lookup_max`` down to ``prompt_lookup_min``."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    method: str = Field("ngram", pattern="^ngram$", description="How drafts are proposed: 'ngram' (prompt lookup).")
    num_speculative_tokens: int = Field(4, ge=1, le=16, description="Most draft tokens verified per request and step.")
    prompt_lookup_max: int = Field(4, ge=1, le=16, description="Longest n-gram matched.")
    prompt_lookup_min: int = Field(1, ge=1, le=16, description="Shortest n-gram matched.")
    adaptive: bool = Field(True, description="Verify only the drafts expected to pay for themselves: "
                           "a draft is kept while its expected acceptance (learned per request) "
                           "exceeds the share of a step's tokens per second its compute costs (from the "
                           "learned step-cost model), so a compute-bound batch drafts little and a "
                           "single stream drafts fully. False: verify every draft.")

    @model_validator(mode="after")
    def _lookup_range(self):
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        return self

    @classmethod
    def parse(cls, value):
        """A JSON string (the ``serve run`` command line, vLLM's ``--speculative-config``) as a dict."""
        return json_option(value, "speculative_config", '{"method": "ngram", "num_speculative_tokens": 4}')


# EngineConfig's and PlatformConfig's field: a SpeculativeConfig, its dict, or its JSON.
SpeculativeOption = Annotated[SpeculativeConfig | None, BeforeValidator(SpeculativeConfig.parse)]


def _human_int(value):
    """vLLM's token counts on the command line: ``32k`` is 32,000, ``32K`` 32,768 (decimals only
    with k, m, g: ``25.6k``); ``auto`` (max_model_len) is None, the model's own."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.lower() == "auto":
        return None
    if match := re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgG])", text):
        number, suffix = match.groups()
        if suffix.islower():
            return int(float(number) * 10 ** (3 * ("kmg".index(suffix) + 1)))
        if "." in number:
            raise ValueError(f"{value!r}: no decimals with K, M or G (powers of 1024); did you mean "
                             f"{number}{suffix.lower()}?")
        return int(number) * 1024 ** ("KMG".index(suffix) + 1)
    return text


TokenCount = Annotated[int, BeforeValidator(_human_int)]
"""A number of tokens: an int, or vLLM's ``32k`` / ``32K`` (see ``_human_int``)."""
ModelLength = Annotated[int | None, BeforeValidator(_human_int)]
"""``max_model_len``: a :data:`TokenCount`, or None / ``auto`` for the model's own."""


# EngineConfig's and PlatformConfig's field: a Jinja file's path or the template, kept as its text.
ChatTemplateOption = Annotated[str | None, AfterValidator(chat_template_text)]
CHAT_TEMPLATE_DOC = ("The chat template (vLLM's --chat-template): a Jinja file's path or the template "
                     "itself, instead of the tokenizer's (None: the tokenizer's own).")


# EngineConfig's and PlatformConfig's fields: where default sampling comes from.
GENERATION_CONFIG_DOC = ("Where requests' default sampling parameters come from (vLLM's --generation-config): "
                         "'auto' (the model's generation_config.json: temperature, top_p, top_k, min_p, "
                         "the penalties and max_new_tokens as max_tokens), 'vllm' (the neutral values) "
                         "or a folder holding a generation_config.json.")
OVERRIDE_GENERATION_CONFIG_DOC = ("Default sampling parameters that replace or add to the generation "
                                  "config's (vLLM's --override-generation-config), e.g. "
                                  "{\"temperature\": 0.5}; JSON on the command line.")
OverrideOption = Annotated[dict[str, float | int], BeforeValidator(
    lambda v: json_option(v, "override_generation_config", '{"temperature": 0.5}'))]

# EngineConfig's and PlatformConfig's field: a thinking model's format.
ReasoningParser = Literal["deepseek_r1", "qwen3"] | None
REASONING_PARSER_DOC = ("A thinking model's format (vLLM's --reasoning-parser): each chat message's "
                        "reasoning field holds what the model wrote inside <think>...</think>, and a "
                        "structured output (response_format, structured_outputs) constrains only the "
                        "answer after </think>, unless the prompt already closed it.")


class EngineConfig(BaseModel):
    """Engine settings; the ``LLM`` keyword arguments of the same names."""

    model_config = ConfigDict(extra="forbid")
    model: str = Field("kvharbor/tiny-llama", description="Builtin id, local checkpoint directory or hub id.")
    num_kv_blocks: int | None = Field(None, ge=2, description="KV blocks in the cache (None: 4096 on CPU, sized from free memory on CUDA).")
    block_size: int = Field(16, ge=1, le=256, description="Tokens per KV block.")
    pinned_kv_blocks: int = Field(0, ge=0, description="Blocks reserved for pinned QoS classes (the region's floor when it is sized by load).")
    pinned_kv_blocks_max: int | None = Field(None, ge=0, description="Ceiling of the pinned region when it "
                                             "is sized by load (peak pinned-class demand over pinned_demand_window_s, "
                                             "with headroom); None: a fixed region of pinned_kv_blocks.")
    pinned_demand_window_s: float = Field(30.0, gt=0, description="Window (s) of the peak pinned-class "
                                          "demand that sizes the pinned region.")
    device: str = Field("auto", description="'cpu', 'cuda', 'cuda:N' or 'auto' (CUDA when available).")
    dtype: str = Field("auto", pattern=DTYPES, description="'float32', 'float16', 'bfloat16' or 'auto' (bf16 on CUDA, fp32 on CPU).")
    attention_backend: str = Field("auto", pattern=BACKENDS, description="'auto' (Triton on CUDA, the CPU kernels on CPU), 'cpu', 'reference' or 'triton'.")
    kv_cache_dtype: KvCacheDtype = Field("auto", description="'auto' (model dtype), 'int8' or 'fp8_e4m3' ('fp8', vLLM's name, is fp8_e4m3).")
    model_path: str = Field("auto", pattern="^(auto|kvharbor|transformers)$", description="'auto' (kvharbor's own forward for Llama/Qwen2/Mistral, else transformers'), 'kvharbor' or 'transformers'.")
    max_num_batched_tokens: TokenCount = Field(2048, ge=1, description="Token budget per step (chunked prefill above it).")
    max_num_seqs: int = Field(128, ge=1, description="Most requests in one step.")
    enable_prefix_caching: bool = Field(True, description="Requests reuse the cached KV blocks of the prompt "
                                        "prefixes they share (vLLM's name). False: every prompt is computed "
                                        "in full (e.g. to measure the engine without reuse).")
    enforce_eager: bool = Field(False, description="Never replay CUDA graphs: run every step eagerly. "
                                "On CUDA with the Triton backend and kvharbor's model path, decode steps "
                                "(every request one token) are otherwise captured once per batch bucket "
                                "and replayed (see engine/decode_graphs.py).")
    async_scheduling: bool = Field(True, description="Where decode steps replay CUDA graphs: launch "
                                   "a decode step whose requests all continue before reading the "
                                   "tokens of the one in flight, so the host's bookkeeping overlaps "
                                   "the GPU's work (see Engine.step). Off: every step waits for its tokens.")
    low_priority_prefill_cap: int | None = Field(
        256, ge=0, description="While requests of a higher class are unfinished (or were in the "
        "last 2 s), lower classes get at most this many prefill tokens per step (their decodes "
        "still run), so steps stay short for premium arrivals. None: no cap (plain priority order).")
    max_model_len: ModelLength = Field(None, ge=1, description="Longest prompt + output (None: the model's, as vLLM derives it: "
                                         "its length fields, stretched by a linear, dynamic or YaRN RoPE scaling).")
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1, description="Share of free GPU memory for the KV cache when num_kv_blocks is None.")
    seed: int = Field(0, description="Seed of the builtin models' random weights (tiny-llama's "
                                     "are trained and do not depend on it).")
    scheduling: str = Field("priority", pattern="^(priority|fcfs)$",
                            description="'priority' (QoS classes, then tenant fairness) or 'fcfs' (arrival order only).")
    qos_classes: dict[str, QoSSpec] = Field(default_factory=lambda: dict(DEFAULT_QOS),
                                            description="QoS classes by name.")
    eviction_policy: str = Field("lru", pattern="^(lru|lfu)$", description="Which free cached KV block is reused "
                                 "first: 'lru' (freed longest ago) or 'lfu' (fewest uses, then freed longest ago; see engine/eviction.py).")
    host_kv_blocks: int = Field(0, ge=0, description="KV blocks of host memory (pinned on CUDA) that keep blocks evicted from the device, by hash, LRU; prefix hits there are copied back instead of recomputed. 0 disables the host tier.")
    session_ttl_s: float = Field(300.0, gt=0, description="Seconds an idle session (no turn running) keeps its "
                                 "KV blocks referenced before they return to the LRU (per-tenant values come from tenants.yaml).")
    session_max_blocks: int | None = Field(None, ge=0, description="Most KV block references one tenant's idle "
                                           "sessions may hold (oldest session released first); None: half the KV blocks.")
    preemption_mode: str = Field("recompute", pattern="^(recompute|swap|auto)$",
                                 description="'recompute' (drop a preempted request's KV), 'swap' (copy it to the host tier and back; needs host_kv_blocks) or 'auto' (swap when it saves more than half its work).")
    lora_modules: dict[str, str] = Field(default_factory=dict, description="LoRA adapters loaded at start, "
                                         "name -> PEFT checkpoint directory (vLLM's --lora-modules); a request "
                                         "names one to generate with it (see engine/lora.py).")
    max_lora_rank: int = Field(64, ge=1, description="Largest LoRA rank an adapter may have (vLLM's --max-lora-rank).")
    speculative_config: SpeculativeOption = Field(None, description="Speculative decoding (vLLM's "
                                                  "speculative_config), e.g. {\"method\": \"ngram\", "
                                                  "\"num_speculative_tokens\": 4}; None: off.")
    chat_template: ChatTemplateOption = Field(None, description=CHAT_TEMPLATE_DOC)
    generation_config: str = Field("auto", description=GENERATION_CONFIG_DOC)
    override_generation_config: OverrideOption = Field(default_factory=dict,
                                                       description=OVERRIDE_GENERATION_CONFIG_DOC)
    reasoning_parser: ReasoningParser = Field(None, description=REASONING_PARSER_DOC)


def _autoscaling(value):
    from kvharbor.platform.autoscaling import parse

    return parse(value)


class PlatformConfig(BaseModel):
    """Arguments of ``build_app`` (``serve run kvharbor:build_app key=value ...``)."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_strings(cls, data):
        """``key=null`` (or ``none``) on the ``serve run`` command line means None."""
        if isinstance(data, dict):
            return {k: None if isinstance(v, str) and v.lower() in ("null", "none") else v
                    for k, v in data.items()}
        return data

    @model_validator(mode="after")
    def _replicas_or_autoscaling(self):
        if self.replicas is not None and self.autoscaling is not None:
            raise ValueError("set either replicas (a fixed count) or autoscaling (min_replicas, "
                             "max_replicas, ...), not both")
        return self

    @property
    def uses_direct_streams(self) -> bool:
        """Direct streams are on and can work: they need the KV-aware router's ``route_direct``."""
        return self.direct_streams and self.router == "kv"

    model: str = Field("kvharbor/tiny-llama", description="Model served by every replica.")
    served_model_name: list[str] | None = Field(None, min_length=1, description="The names requests give "
                                                "the model and /v1/models lists (vLLM's --served-model-name; "
                                                "on the command line name1,name2); answers carry the first. "
                                                "None: the model's id or path.")

    @field_validator("served_model_name", mode="before")
    @classmethod
    def _names(cls, value):
        """``name1,name2`` (the ``serve run`` command line) as a list."""
        return [n.strip() for n in value.split(",")] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _auto_tools_need_a_parser(self):
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser (hermes): the format "
                             "the model writes its calls in")
        return self

    @model_validator(mode="after")
    def _ray_prefix_reads_bytes(self):
        from kvharbor.engine.model_info import BUILTIN_NAMES  # noqa: PLC0415

        if self.router == "ray_prefix" and self.model not in BUILTIN_NAMES:
            raise ValueError(f"router 'ray_prefix' reads prompts as bytes: it routes the builtin models "
                             f"({', '.join(BUILTIN_NAMES)}) only, not {self.model!r}")
        return self

    @model_validator(mode="after")
    def _names_distinct(self):
        names = self.served_model_name or []
        if any(not n for n in names) or len(set(names)) != len(names):
            raise ValueError(f"served_model_name needs distinct, non-empty names, got {names}")
        if clash := sorted(set(names) & set(self.lora_modules)):
            raise ValueError(f"served_model_name and lora_modules both name {', '.join(clash)}: "
                             "a request's model must say which it means")
        return self
    chat_template: ChatTemplateOption = Field(None, description=CHAT_TEMPLATE_DOC)
    enable_auto_tool_choice: bool = Field(False, description='Serve tool_choice "auto" (the default '
                                          'when a chat sends tools): the model answers text or calls in its '
                                          'own format, read by tool_call_parser (vLLM\'s flag).')
    tool_call_parser: Literal["hermes"] | None = Field(None, description="The model's tool-call format "
                                                       "(vLLM's flag): hermes, <tool_call>{json}</tool_call> "
                                                       "blocks (Qwen2.5, Qwen3, Hermes).")
    reasoning_parser: ReasoningParser = Field(None, description=REASONING_PARSER_DOC)
    generation_config: str = Field("auto", description=GENERATION_CONFIG_DOC)
    override_generation_config: OverrideOption = Field(default_factory=dict,
                                                       description=OVERRIDE_GENERATION_CONFIG_DOC)
    lora_modules: dict[str, str] = Field(default_factory=dict, description="LoRA adapters every replica "
                                         "serves beside the model, name -> PEFT checkpoint directory "
                                         "(on the command line: lora_modules=name=path,name2=path2); a "
                                         "request's `model` names one (see engine/lora.py).")
    max_lora_rank: int = Field(64, ge=1, description="Largest LoRA rank an adapter may have.")
    speculative_config: SpeculativeOption = Field(None, description="Speculative decoding (vLLM's "
                                                  "speculative_config), e.g. {\"method\": \"ngram\", "
                                                  "\"num_speculative_tokens\": 4}; None: off.")

    @field_validator("lora_modules", mode="before")
    @classmethod
    def _lora_pairs(cls, value):
        """``name=path,name2=path2`` (the ``serve run`` command line) as a dict."""
        if not isinstance(value, str):
            return value
        pairs = {}
        for item in filter(None, (p.strip() for p in value.split(","))):
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"lora_modules takes name=path pairs separated by commas, got {item!r}")
            pairs[name] = path
        return pairs
    tenants: str | None = Field(None, description="tenants.yaml path (None: ./tenants.yaml or the packaged example).")
    replicas: int | None = Field(None, ge=1, description="LLM replicas (None: one per GPU, or 2 on CPU).")
    autoscaling: Annotated[dict | None, BeforeValidator(_autoscaling)] = Field(
        None, description="Serve's autoscaling_config for the LLM replicas instead of a fixed "
        "`replicas`, e.g. {\"min_replicas\": 1, \"max_replicas\": 4} (JSON on the command line); "
        "kvharbor's policy counts pinned classes' direct streams as ongoing requests. See "
        "kvharbor.platform.autoscaling.")
    gateway_replicas: int = Field(1, ge=1, description="Gateway (HTTP ingress) replicas.")
    num_kv_blocks: int | None = Field(None, ge=2, description="KV blocks per replica (None: engine default).")
    block_size: int = Field(16, ge=1, description="Tokens per KV block.")
    pinned_kv_blocks: int = Field(0, ge=0, description="Minimum pinned region per replica (tenants.yaml may ask for more).")
    device: str = Field("auto", pattern="^(auto|cpu|cuda)$", description="Replica device: 'auto', 'cpu' or 'cuda' (one GPU per replica).")
    dtype: str = Field("auto", pattern=DTYPES, description="Model dtype (see EngineConfig).")
    attention_backend: str = Field("auto", pattern=BACKENDS, description="'auto', 'cpu', 'reference' or 'triton'.")
    kv_cache_dtype: KvCacheDtype = Field("auto", description="'auto', 'int8' or 'fp8_e4m3' ('fp8', vLLM's name, is fp8_e4m3).")
    max_num_batched_tokens: TokenCount = Field(2048, ge=1, description="Token budget per engine step.")
    max_num_seqs: int = Field(128, ge=1, description="Most requests in one engine step (vLLM's --max-num-seqs).")
    max_model_len: ModelLength = Field(None, ge=1, description="Longest prompt + output (vLLM's --max-model-len; "
                                      "None: the model's context). The gateway refuses longer requests with "
                                      "a 400; above the model's context it fails at start.")
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1, description="Share of a GPU's free memory a replica "
                                          "takes for its KV cache when num_kv_blocks is None (vLLM's name).")
    enable_prefix_caching: bool = Field(True, description="Requests reuse the cached KV of the prefixes they "
                                        "share (vLLM's name); False computes every prompt in full.")
    low_priority_prefill_cap: int | None = Field(256, ge=0, description="Prefill tokens per step for lower classes while higher-class requests are unfinished (None: no cap).")
    scheduling: str = Field("priority", pattern="^(priority|fcfs)$", description="Engine scheduling: 'priority' or 'fcfs'.")
    eviction_policy: str = Field("lru", pattern="^(lru|lfu)$", description="Device KV eviction policy: 'lru' or 'lfu'.")
    host_kv_blocks: int = Field(0, ge=0, description="Host-memory KV blocks per replica for evicted prefixes (0: off).")
    preemption_mode: str = Field("recompute", pattern="^(recompute|swap|auto)$", description="Engine preemption: 'recompute', 'swap' or 'auto'.")
    enforce_eager: bool = Field(False, description="GPU replicas never replay CUDA graphs (see EngineConfig).")
    async_scheduling: bool = Field(True, description="GPU replicas launch a decode step before reading the "
                                   "previous one's tokens (see EngineConfig).")
    router: str = Field("kv", pattern="^(kv|pow2|round_robin|ray_prefix)$", description="Request router: 'kv' (KV-aware), 'pow2' (Serve default), 'round_robin', or 'ray_prefix' (Ray Serve's PrefixCacheAffinityRouter, a comparison peer: builtin models only, it reads their byte-tokenized prompts as text).")
    replica_cpus: float = Field(0.5, gt=0, description="num_cpus per LLM replica when on CPU.")
    cpu_threads: int | None = Field(1, ge=1, description="torch threads per CPU replica (None: torch default).")
    cpu_replica_nice: int = Field(10, ge=0, le=19, description="OS nice increment of the thread that runs a CPU "
                                  "replica's engine steps, so the request path (proxy, gateway, the replica's own "
                                  "event loop) gets the cores before engine compute (0: off; 10 cut premium p99 4x "
                                  "in benchmarks/qos.py). Ray starts its worker processes at nice 15, and Linux "
                                  "caps nice at 19, so the steps run at min(15 + this, 19).")
    premium_port: int | None = Field(None, ge=1, le=65535, description="A second HTTP port for tenants of "
                                     "pinned QoS classes, served by a gateway process of its own "
                                     "(PremiumGateway) on KVHARBOR_PREMIUM_HOST (default 127.0.0.1), so "
                                     "their requests never wait in the main gateway's event loop behind "
                                     "other tenants' traffic (None: off). See kvharbor.platform.premium_lane.")
    main_gateway_nice: int = Field(19, ge=0, le=19, description="With a premium lane (premium_port), the OS nice "
                                   "value every thread of the main port's gateway processes runs at, at least "
                                   "(Ray starts their Python threads at 15, their RPC threads at 0): where the "
                                   "flood's request path fills the host's cores, the lane's gateway and the "
                                   "replicas' event loops get them first (0: unchanged; docs/benchmarks.md, 'QoS').")
    direct_streams: bool = Field(True, description="Requests of pinned QoS classes go from the gateway to "
                                 "their replica over a TCP connection of their own instead of a Serve handle "
                                 "call (routed by the same KV-aware router; other classes keep Serve's path). "
                                 "See kvharbor.platform.direct_stream.")
    directory_name: str = Field("kvharbor-prefix-directory", description="Named PrefixDirectory actor.")
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="Largest accepted HTTP request body.")
    overload_lag_ms: float | None = Field(10.0, gt=0, description="Gateway overload guard: while the "
                                          "gateway's event loop lags more than this (median over 0.25 s), "
                                          "it lowers how many requests of non-pinned classes it lets in, "
                                          "shedding the lowest classes first (429 overloaded); None: off. "
                                          "Serve's proxy, in a cluster build_app starts, sheds with the "
                                          "same target (kvharbor.platform.proxy_guard). "
                                          "See kvharbor.platform.overload_guard.")
