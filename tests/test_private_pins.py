"""The pins of the two private interfaces serving still relies on (issue 40 item 3), each in one
adapter module: serve_apps/engine_metrics.py (vLLM's Ray metric wrappers, subclassed with their
class attributes to add the app tags) and serve_apps/api_key.py (Ray's internal KV, the one
store every replica reads the API key from). Checked by name against the installed versions,
so an upgrade that moves one fails here first, saying which, before a replica misbehaves.
(paramiko and Fabric: tests/test_ssh_adapter.py.)"""

from __future__ import annotations

import inspect
import re

import pytest

from serve_apps import api_key, engine_metrics

# What engine_metrics.app_ray_stat_logger sets on each vLLM class (read from its source below).
METRIC_CLASS_ATTRIBUTES = {
    "RayPrometheusStatLogger": ("_gauge_cls", "_counter_cls", "_histogram_cls",
                                "_spec_decoding_cls", "_kv_connector_cls", "_perf_metrics_cls"),
    "RaySpecDecodingProm": ("_counter_cls",),
    "RayKVConnectorProm": ("_gauge_cls", "_counter_cls", "_histogram_cls"),
    "RayPerfMetricsProm": ("_counter_cls",),
}
WRAPPERS = ("RayGaugeWrapper", "RayCounterWrapper", "RayHistogramWrapper")


@pytest.fixture(scope="module")
def ray_wrappers():
    from vllm.v1.metrics import ray_wrappers

    return ray_wrappers


def test_the_pins_cover_every_class_attribute_the_adapter_sets():
    """The table above is the adapter's own: every `"_name":` it sets is pinned (a new one
    added there without a pin fails here)."""
    source = inspect.getsource(engine_metrics.app_ray_stat_logger)
    set_there = set(re.findall(r'"(_[a-z_]+_cls)"', source))
    pinned = {a for attrs in METRIC_CLASS_ATTRIBUTES.values() for a in attrs}
    assert set_there and set_there == pinned


@pytest.mark.parametrize("name", sorted(METRIC_CLASS_ATTRIBUTES))
def test_pin_vllm_metric_classes_take_their_metric_classes_from_class_attributes(ray_wrappers,
                                                                                 name):
    cls = getattr(ray_wrappers, name)
    for attr in METRIC_CLASS_ATTRIBUTES[name]:
        assert isinstance(getattr(cls, attr, None), type), f"{name}.{attr}"


@pytest.mark.parametrize("name", WRAPPERS)
def test_pin_vllm_metric_wrappers_build_tags_from_their_tag_keys(ray_wrappers, name):
    """_tagged overrides _get_tag_keys (static, labelnames -> tuple) and _build_tags
    (*labels, **kwargs), and reads the Ray metric's _tag_keys."""
    cls = getattr(ray_wrappers, name)
    assert isinstance(inspect.getattr_static(cls, "_get_tag_keys"), staticmethod), name
    assert cls._get_tag_keys(["model_name"])[0] == "model_name"
    params = inspect.signature(cls._build_tags).parameters
    assert [p.kind for p in params.values()][1:] == [inspect.Parameter.VAR_POSITIONAL,
                                                     inspect.Parameter.VAR_KEYWORD], name


def test_pin_ray_metrics_keep_their_tag_keys():
    from ray.util.metrics import Gauge

    gauge = Gauge("cluster_pin_gauge", description="pin", tag_keys=("a", "b"))
    assert tuple(gauge._tag_keys) == ("a", "b")


@pytest.mark.parametrize("name, params", [
    ("_internal_kv_initialized", ()),
    ("_internal_kv_get", ("key", "namespace")),
    ("_internal_kv_put", ("key", "value", "overwrite", "namespace")),
    ("_internal_kv_del", ("key", "namespace")),
])
def test_pin_ray_internal_kv_functions_api_key_calls(name, params):
    from ray.experimental import internal_kv

    func = getattr(internal_kv, name, None)
    assert callable(func), name
    have = inspect.signature(func).parameters
    assert all(p in have for p in params), (name, list(have))
    assert name in inspect.getsource(api_key)


def test_pin_ray_serve_reads_the_haproxy_paths_the_start_env_sets(tmp_path):
    """cluster/nodes/ray_env.py moves Serve's HAProxy files out of /tmp through five variables
    Ray Serve reads at import (ray/serve/_private/constants.py, not a documented interface):
    each read, and the manager putting the node id below each folder (haproxy.py _per_node)."""
    import json
    import os
    import subprocess
    import sys

    from ray.serve._private import haproxy

    from cluster.nodes.ray_env import SERVE_HAPROXY_FILES

    folder = "/pinned/hap"
    env = {name: f"{folder}/{leaf}" if leaf else folder for name, leaf in SERVE_HAPROXY_FILES.items()}
    code = ("import json; from ray.serve._private import constants as c; "
            f"print(json.dumps({{n: getattr(c, n) for n in {sorted(env)!r}}}))")
    p = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env},
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout.splitlines()[-1]) == env
    source = inspect.getsource(haproxy)
    assert "return os.path.join(d, self._node_id, f)" in source
    for name in SERVE_HAPROXY_FILES:
        assert name in source
