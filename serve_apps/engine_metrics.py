"""vLLM's engine metrics exported through Ray's metrics, tagged with the Serve app.

`stat_loggers()` is what a replica passes to AsyncLLM (stat_loggers=): vLLM's
RayPrometheusStatLogger (vllm.v1.metrics.ray_wrappers) with every metric also tagged
`application` and `deployment` (vLLM adds `ReplicaId`, Ray `WorkerId`, `NodeAddress`...), so
Ray's metrics agent on every node exports each replica's running/waiting requests, KV-cache
use, latencies and token counts (as `ray_vllm_*`) to the Prometheus of the cluster and to
Ray's LLM dashboards; then vLLM's own PrometheusStatLogger, so the replica's /metrics route
keeps serving `vllm:*` (cluster status reads it: cluster/serving/serving_health.py).

The order matters: every PrometheusStatLogger unregisters the `vllm:*` collectors of
prometheus_client when it is built, so vLLM's own logger must come last.
"""

from __future__ import annotations

import functools
from typing import Any

APP_TAG_KEYS = ("application", "deployment")


def serve_tags() -> dict[str, str]:
    """{application, deployment} of the replica this runs in ("" outside Serve)."""
    try:
        from ray import serve

        ctx = serve.get_replica_context()
        return {"application": str(ctx.app_name), "deployment": str(ctx.deployment)}
    except Exception:  # not in a replica (RayServeException), or Serve not importable
        return {key: "" for key in APP_TAG_KEYS}


def _tagged(base: type, tags: dict[str, str]) -> type:
    """A vLLM Ray metric wrapper whose metric also carries the app tags (as default tags)."""

    class Tagged(base):
        @staticmethod
        def _get_tag_keys(labelnames):
            return base._get_tag_keys(labelnames) + APP_TAG_KEYS

        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self.metric.set_default_tags(dict(tags))

        def _build_tags(self, *labels: Any, **labelskwargs: Any) -> dict[str, str]:
            names = self.metric._tag_keys[:-len(APP_TAG_KEYS) - 1]  # less ReplicaId, app tags
            if labels and len(labels) != len(names):
                raise ValueError(f"Number of labels must match the number of tag keys. "
                                 f"Expected {len(names)}, got {len(labels)}")
            return super()._build_tags(**dict(zip(names, labels)), **labelskwargs)

    Tagged.__name__ = Tagged.__qualname__ = "App" + base.__name__
    return Tagged


@functools.lru_cache(maxsize=1)
def app_ray_stat_logger() -> type:
    """RayPrometheusStatLogger whose metrics carry this replica's app tags."""
    from vllm.v1.metrics import ray_wrappers as rw

    tags = serve_tags()
    gauge, counter = _tagged(rw.RayGaugeWrapper, tags), _tagged(rw.RayCounterWrapper, tags)
    histogram = _tagged(rw.RayHistogramWrapper, tags)
    spec = type("AppRaySpecDecodingProm", (rw.RaySpecDecodingProm,), {"_counter_cls": counter})
    kv = type("AppRayKVConnectorProm", (rw.RayKVConnectorProm,),
              {"_gauge_cls": gauge, "_counter_cls": counter, "_histogram_cls": histogram})
    perf = type("AppRayPerfMetricsProm", (rw.RayPerfMetricsProm,), {"_counter_cls": counter})
    return type("AppRayPrometheusStatLogger", (rw.RayPrometheusStatLogger,), {
        "_gauge_cls": gauge, "_counter_cls": counter, "_histogram_cls": histogram,
        "_spec_decoding_cls": spec, "_kv_connector_cls": kv, "_perf_metrics_cls": perf})


def stat_loggers() -> list[type]:
    """AsyncLLM's stat_loggers: Ray's metrics (app-tagged), then vLLM's own /metrics."""
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    return [app_ray_stat_logger(), PrometheusStatLogger]
