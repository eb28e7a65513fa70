"""Every Prometheus metric of the worker, defined once.

Request-level metrics are recorded by the HTTP layer; engine and adapter-manager numbers
(steps, queue lengths, slot and CPU-tier residency, ...) are read at scrape time by a collector.

The `vllm:*` series repeat the numbers under vLLM's names, labels and meanings (vllm/v1/metrics/
loggers.py), so that the endpoint pickers of the Gateway API Inference Extension (llm-d and
others) and vLLM dashboards work unchanged: queue depth, running requests, KV-cache use (blocks held by
requests; cached blocks that no request holds count as free), prefix-cache queries and hits (tokens), the LoRA
info gauge (its value is the time of the engine's last update; `running_lora_adapters` and
`waiting_lora_adapters` list, comma-separated, the adapters with running / waiting requests),
token counters, speculative decoding's draft and acceptance counters (while it is on), TTFT / inter-token
latency / end-to-end histograms. Every series carries
`model_name` (the served model name) and `engine="0"`, as vLLM's do; the cache-config info gauge
(`vllm:cache_config_info`, value 1) carries the KV cache's `block_size` and `num_gpu_blocks` as labels instead,
which the endpoint pickers' prefix-cache scorer reads. The Inference Extension's model-server protocol
(docs/proposals/003-model-server-protocol in kubernetes-sigs/gateway-api-inference-extension) requires the
queue, running, KV-cache and LoRA series and names the cache-config one as optional.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# No `*_created` samples (a timestamp series per counter and histogram that nothing here reads);
# vLLM turns them off the same way. Process-wide: the worker process exports only these metrics.
disable_created_metrics()

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
# vLLM's buckets
_VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
_VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
_VLLM_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)
VLLM_LABELS = ("model_name", "engine")
_LOAD_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

# Engine / manager numbers that the SPEC names, exported under stable names when the engine reports them.
_ENGINE_ALIASES: dict[str, tuple[str, str]] = {
    "max_adapters_in_step": ("lorafleet_max_adapters_in_step", "Most distinct adapters in one engine step so far"),
    "steps": ("lorafleet_engine_steps", "Engine steps run"),
    "num_waiting": ("lorafleet_queue_length", "Requests waiting for admission"),
    "waiting": ("lorafleet_queue_length", "Requests waiting for admission"),
    "queue_length": ("lorafleet_queue_length", "Requests waiting for admission"),
    "num_running": ("lorafleet_requests_running_in_engine", "Requests admitted to the engine"),
    "running": ("lorafleet_requests_running_in_engine", "Requests admitted to the engine"),
}
_MANAGER_ALIASES: dict[str, tuple[str, str]] = {
    "slots_used": ("lorafleet_lora_gpu_slots_used", "GPU slots holding an adapter"),
    "gpu_resident": ("lorafleet_lora_gpu_slots_used", "GPU slots holding an adapter"),
    "cpu_resident": ("lorafleet_lora_cpu_resident", "Adapters resident in the CPU tier"),
}


def _numbers(source: Any) -> dict[str, float]:
    """Numeric fields of a stats object (dataclass, mapping or plain object)."""
    if source is None:
        return {}
    if dataclasses.is_dataclass(source) and not isinstance(source, type):
        items: Mapping[str, Any] = {f.name: getattr(source, f.name) for f in dataclasses.fields(source)}
    elif isinstance(source, Mapping):
        items = source
    else:
        items = {k: v for k, v in vars(source).items() if not k.startswith("_")}
    return {k: float(v) for k, v in items.items() if isinstance(v, int | float) and not isinstance(v, bool)}


def _metric_name(prefix: str, key: str) -> str:
    return prefix + re.sub(r"[^a-zA-Z0-9_]", "_", key)


class EngineCollector(Collector):
    """Reads engine and adapter-manager stats at scrape time."""

    def __init__(self, engine_stats: Callable[[], Any], manager_stats: Callable[[], Any]) -> None:
        self._engine_stats = engine_stats
        self._manager_stats = manager_stats

    def collect(self) -> Iterator[GaugeMetricFamily]:
        seen: set[str] = set()
        for stats, prefix, aliases in (
            (self._engine_stats(), "lorafleet_engine_", _ENGINE_ALIASES),
            (self._manager_stats(), "lorafleet_lora_manager_", _MANAGER_ALIASES),
        ):
            for key, value in _numbers(stats).items():
                names = [(_metric_name(prefix, key), f"Engine statistic {key}")]
                if key in aliases:
                    names.append(aliases[key])
                for name, doc in names:
                    if name not in seen:
                        seen.add(name)
                        yield GaugeMetricFamily(name, doc, value=value)


class GatewayCollector(Collector):
    """vLLM's scheduler, KV-cache, token and LoRA series, read from the engine's stats at scrape time."""

    def __init__(
        self, engine_stats: Callable[[], Any], model_name: str, max_loras: int, cache_config: Mapping[str, str]
    ) -> None:
        self._engine_stats = engine_stats
        self._labels = [model_name, "0"]
        self._max_loras = max_loras
        self._cache_config = dict(cache_config)

    def _family(self, kind: type[GaugeMetricFamily | CounterMetricFamily], name: str, doc: str, value: float) -> Metric:
        family = kind(name, doc, labels=VLLM_LABELS)
        family.add_metric(self._labels, value)
        return family

    def collect(self) -> Iterator[Metric]:
        st = self._engine_stats()
        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        yield self._family(
            gauge, "vllm:num_requests_running", "Number of requests in model execution batches.", st.num_running
        )
        yield self._family(
            gauge, "vllm:num_requests_waiting", "Number of requests waiting to be processed.", st.num_waiting
        )
        usage = 1.0 - st.kv_blocks_free / st.kv_blocks_total if st.kv_blocks_total else 0.0
        yield self._family(gauge, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage)
        yield self._family(
            gauge, "vllm:gpu_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage (older name).", usage
        )
        yield self._family(counter, "vllm:prompt_tokens", "Number of prefill tokens processed.", st.prompt_tokens)
        yield self._family(
            counter, "vllm:generation_tokens", "Number of generation tokens processed.", st.generation_tokens
        )
        yield self._family(
            counter, "vllm:num_preemptions", "Cumulative number of preemption from the engine.", st.preemptions
        )
        yield self._family(
            counter,
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            st.prefix_cache_queries,
        )
        yield self._family(
            counter,
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            st.prefix_cache_hits,
        )
        cache = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=[*self._cache_config, "engine"]
        )
        cache.add_metric([*self._cache_config.values(), "0"], 1.0)
        yield cache
        yield from self._spec_decode(st)
        if self._max_loras > 0:
            info = GaugeMetricFamily(
                "vllm:lora_requests_info",
                "Running stats on lora requests.",
                labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            )
            running, waiting = ",".join(st.running_adapters), ",".join(st.waiting_adapters)
            info.add_metric([str(self._max_loras), waiting, running], st.updated_at or time.time())
            yield info

    def _spec_decode(self, st: Any) -> Iterator[Metric]:
        """vLLM's speculative-decoding counters (vllm/v1/spec_decode/metrics.py), while speculation is on."""
        per_pos = getattr(st, "spec_accepted_per_pos", ())
        if not per_pos:
            return
        counter = CounterMetricFamily
        yield self._family(counter, "vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", st.spec_drafts)
        yield self._family(
            counter, "vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", st.spec_draft_tokens
        )
        yield self._family(
            counter, "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", st.spec_accepted_tokens
        )
        family = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            labels=[*VLLM_LABELS, "position"],
        )
        for pos, value in enumerate(per_pos):
            family.add_metric([*self._labels, str(pos)], value)
        yield family


class WorkerMetrics:
    """The worker's metrics in their own registry (several workers can live in one test process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "lorafleet_requests",
            "Inference requests by model (base or adapter) and outcome",
            ["model", "outcome"],
            registry=r,
        )
        self.prompt_tokens = Counter("lorafleet_prompt_tokens", "Prompt tokens by model", ["model"], registry=r)
        self.generation_tokens = Counter(
            "lorafleet_generation_tokens", "Generated tokens by model", ["model"], registry=r
        )
        self.time_to_first_token = Histogram(
            "lorafleet_time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.inter_token_latency = Histogram(
            "lorafleet_inter_token_latency_seconds", "Time between tokens", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.request_latency = Histogram(
            "lorafleet_request_latency_seconds", "End-to-end request latency", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.requests_in_flight = Gauge("lorafleet_requests_in_flight", "Inference requests being served", registry=r)
        self.lora_loads = Counter("lorafleet_lora_loads", "Adapter load calls by outcome", ["outcome"], registry=r)
        self.lora_unloads = Counter(
            "lorafleet_lora_unloads", "Adapter unload calls by outcome", ["outcome"], registry=r
        )
        self.lora_load_latency = Histogram(
            "lorafleet_lora_load_seconds",
            "Adapter load latency (fetch + validate + load)",
            buckets=_LOAD_BUCKETS,
            registry=r,
        )
        self.lora_unload_latency = Histogram(
            "lorafleet_lora_unload_seconds",
            "Adapter unload latency (includes in-flight drain)",
            buckets=_LOAD_BUCKETS,
            registry=r,
        )
        self.lora_on_demand_loads = Counter(
            "lorafleet_lora_on_demand_loads",
            "Adapters loaded on demand (a request named a catalogued adapter the worker did not hold) by outcome: "
            "success, error (fetch or validation failed), capacity (no place and nothing evictable)",
            ["outcome"],
            registry=r,
        )
        self.lora_on_demand_evictions = Counter(
            "lorafleet_lora_on_demand_evictions",
            "Adapters loaded on demand that were unloaded to make room under --max-loaded-loras "
            "(least recently used, no request in flight)",
            registry=r,
        )
        self.loras_registered = Gauge("lorafleet_lora_registered", "Adapters registered on this worker", registry=r)
        self.max_loras = Gauge("lorafleet_max_loras", "GPU adapter slots (--max-loras)", registry=r)
        self.max_cpu_loras = Gauge("lorafleet_max_cpu_loras", "CPU-tier capacity (--max-cpu-loras)", registry=r)
        self.ready = Gauge("lorafleet_ready", "1 when the model is loaded and the engine runs", registry=r)
        # vLLM's request series (the engine's are read by GatewayCollector)
        self.vllm_time_to_first_token = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            VLLM_LABELS,
            buckets=_VLLM_TTFT_BUCKETS,
            registry=r,
        )
        self.vllm_inter_token_latency = Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            VLLM_LABELS,
            buckets=_VLLM_ITL_BUCKETS,
            registry=r,
        )
        self.vllm_time_per_output_token = Histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds (older name of vllm:inter_token_latency_seconds).",
            VLLM_LABELS,
            buckets=_VLLM_ITL_BUCKETS,
            registry=r,
        )
        self.vllm_e2e_latency = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            VLLM_LABELS,
            buckets=_VLLM_E2E_BUCKETS,
            registry=r,
        )
        self.vllm_request_success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*VLLM_LABELS, "finished_reason"],
            registry=r,
        )

    def attach_engine(
        self,
        engine_stats: Callable[[], Any],
        manager_stats: Callable[[], Any],
        *,
        model_name: str,
        max_loras: int,
        cache_config: Mapping[str, str],
    ) -> None:
        """`cache_config`: the KV cache's `block_size` and `num_gpu_blocks` (vLLM's CacheConfig label names)."""
        self.registry.register(EngineCollector(engine_stats, manager_stats))
        self.registry.register(GatewayCollector(engine_stats, model_name, max_loras, cache_config))

    def render(self) -> bytes:
        return generate_latest(self.registry)
