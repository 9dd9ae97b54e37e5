"""The operator's dashboard (``deploy/grafana/tandem-dashboard.json``) queries only series that
the app exports, named as Prometheus sees them through Ray's metrics agent, and
``docs/metrics.md`` names every metric the app defines.

What "defined" means comes from the code, not from a list here: the metric objects that the
``*Metrics`` classes of ``deployments/metrics.py`` create (``ray.util.metrics`` objects can be
created without a Ray cluster), and for Ray Serve's own metrics the names its source passes to
``Counter`` / ``Gauge`` / ``Histogram``. What Prometheus sees was checked on Ray 2.60 (see
docs/metrics.md): ``ray_`` in front; a histogram as ``_bucket`` / ``_sum`` / ``_count``; a
counter with ``_total`` added unless its name has it; a gauge as it is.
"""

from __future__ import annotations

import ast
import inspect
import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
import ray.serve
from ray.util.metrics import Counter, Gauge, Histogram, Metric

import deployments.metrics as app_metrics
from autoscaling.decide import ActionKind
from autoscaling.scale import ScaleKind

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "tandem-dashboard.json"
DOCS = ROOT / "docs" / "metrics.md"
RAY_PREFIX = "ray_"
DATASOURCE_UID = "${datasource}"
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")

# ---- what the code defines ---------------------------------------------------------------


def _kind(metric: Metric) -> str:
    for cls, kind in ((Histogram, "histogram"), (Counter, "counter"), (Gauge, "gauge")):
        if isinstance(metric, cls):
            return kind
    raise TypeError(f"unknown metric type {type(metric).__name__}")


def _metrics_in(values: Iterable[object]) -> Iterator[Metric]:
    """The metric objects among ``values``, looking inside dicts, lists and tuples."""
    for value in values:
        if isinstance(value, Metric):
            yield value
        elif isinstance(value, dict):
            yield from _metrics_in(value.values())
        elif isinstance(value, list | tuple):
            yield from _metrics_in(value)


def _metrics_classes() -> list[type]:
    module = app_metrics.__name__
    return [
        cls
        for name, cls in vars(app_metrics).items()
        if inspect.isclass(cls) and cls.__module__ == module and name.endswith("Metrics")
    ]


def app_metric_kinds() -> dict[str, str]:
    """name -> kind of every metric the app's ``*Metrics`` classes create. A required
    constructor argument is the pool (``EngineMetrics(section)``): given ``"prefill"``."""
    kinds: dict[str, str] = {}
    for cls in _metrics_classes():
        required = [p for p in inspect.signature(cls).parameters.values() if p.default is inspect.Parameter.empty]
        instance = cls(*["prefill"] * len(required))
        for metric in _metrics_in(vars(instance).values()):
            kinds[metric.info["name"]] = _kind(metric)
    return kinds


def _metric_call(node: ast.AST) -> tuple[str, str] | None:
    """(name, kind) of a ``Counter("serve_...")``-like call, else None."""
    if not isinstance(node, ast.Call):
        return None
    func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
    if func not in ("Counter", "Gauge", "Histogram"):
        return None
    args = [*node.args[:1], *(k.value for k in node.keywords if k.arg == "name")]
    if args and isinstance(args[0], ast.Constant) and isinstance(args[0].value, str):
        return args[0].value, func.lower()
    return None


def serve_metric_kinds() -> dict[str, str]:
    """name -> kind of every metric Ray Serve's own code defines (read from its source)."""
    kinds: dict[str, str] = {}
    for path in sorted((Path(ray.serve.__file__).parent / "_private").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            found = _metric_call(node)
            if found is not None and found[0].startswith("serve_"):
                kinds[found[0]] = found[1]
    return kinds


def exported_series(kinds: dict[str, str]) -> set[str]:
    """The series names Prometheus sees for metrics of these names and kinds."""
    series: set[str] = set()
    for name, kind in kinds.items():
        base = RAY_PREFIX + name
        if kind == "histogram":
            series.update(base + suffix for suffix in HISTOGRAM_SUFFIXES)
        elif kind == "counter":
            series.add(base if base.endswith("_total") else base + "_total")
        else:
            series.add(base)
    return series


# ---- what the dashboard queries ----------------------------------------------------------

_STRINGS = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGES = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENTIFIER = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool", "and", "or", "unless"}
_LABEL_VALUES = re.compile(r"label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)\s*,")


def series_in(expr: str) -> set[str]:
    """The series names a PromQL expression selects: identifiers outside strings, label
    matchers, ranges and grouping clauses that are not functions (followed by ``(``),
    keywords, numbers (``1e3``) or Grafana variables (``$pool``)."""
    text = _STRINGS.sub('""', expr)  # first: a regex in a matcher may hold braces
    for pattern in (_MATCHERS, _RANGES, _GROUPING):
        text = pattern.sub(" ", text)
    names = set()
    for match in _IDENTIFIER.finditer(text):
        before = text[match.start() - 1] if match.start() else " "
        after = text[match.end() :].lstrip()
        if before in "0123456789.$" or after.startswith("(") or match.group().lower() in _KEYWORDS:
            continue
        names.add(match.group())
    return names


def _panels(dashboard: dict) -> Iterator[dict]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # a collapsed row holds its panels


def queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target, annotation and variable query."""
    found = [(panel["title"], target["expr"]) for panel in _panels(dashboard) for target in panel.get("targets", [])]
    found += [(f"annotation {a['name']}", a["expr"]) for a in dashboard["annotations"]["list"] if "expr" in a]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
            found += [(f"variable {variable['name']}", m) for m in _LABEL_VALUES.findall(query)]
    return found


def unknown_series(expr: str, known: set[str]) -> set[str]:
    """Series ``expr`` selects that are not exported, and every series at all of a
    ``histogram_quantile`` over something other than buckets."""
    names = series_in(expr)
    bad = names - known
    if "histogram_quantile" in expr:
        bad |= {name for name in names if not name.endswith("_bucket")}
    return bad


# ---- tests -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def known() -> set[str]:
    return exported_series({**serve_metric_kinds(), **app_metric_kinds()})


def test_the_app_metrics_are_found_in_the_code():
    names = {cls.__name__ for cls in _metrics_classes()}
    assert {"IngressMetrics", "EngineMetrics", "AutoscalerMetrics"} <= names
    kinds = app_metric_kinds()
    assert kinds["tandem_ttft_seconds"] == "histogram"
    assert kinds["tandem_autoscaler_actions_total"] == "counter"
    assert kinds["tandem_kv_block_usage"] == "gauge"
    assert serve_metric_kinds()["serve_deployment_replica_healthy"] == "gauge"


def test_the_dashboard_is_valid_with_unique_panel_ids_and_no_overlap(dashboard):
    assert dashboard["schemaVersion"] >= 36
    ids = [panel["id"] for panel in _panels(dashboard)]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {sorted(i for i in ids if ids.count(i) > 1)}"
    cells: dict[tuple[int, int], str] = {}
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = panel["title"]


def test_every_panel_queries_through_the_datasource_variable(dashboard):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for panel in _panels(dashboard):
        if panel["type"] == "row":
            assert not panel.get("targets"), panel["title"]
            continue
        assert panel["datasource"]["uid"] == DATASOURCE_UID, panel["title"]
        assert panel["targets"], f"{panel['title']!r} has no query"
        for target in panel["targets"]:
            assert target.get("datasource", panel["datasource"])["uid"] == DATASOURCE_UID, panel["title"]
    for annotation in dashboard["annotations"]["list"]:
        if "expr" in annotation:
            assert annotation["datasource"]["uid"] == DATASOURCE_UID, annotation["name"]
    for variable in variables.values():
        if variable["type"] == "query":
            assert variable["datasource"]["uid"] == DATASOURCE_UID, variable["name"]


def test_every_queried_series_is_one_the_app_exports(dashboard, known):
    found = queries(dashboard)
    assert len(found) >= 20
    unknown = {}
    for where, expr in found:
        assert series_in(expr), f"{where}: no series in {expr!r}"
        bad = unknown_series(expr, known)
        if bad:
            unknown[where] = sorted(bad)
    assert not unknown, f"series not exported (as Prometheus names them): {unknown}"


def test_the_check_rejects_a_wrong_name(known):
    selector = 'ray_tandem_ttft_seconds_bucket{path=~"$p", le!="{x}"}[$__rate_interval]'
    good = f"histogram_quantile(0.9, sum by (le, path) (rate({selector})))"
    assert series_in(good) == {"ray_tandem_ttft_seconds_bucket"}
    assert not unknown_series(good, known)
    assert unknown_series(good.replace("ttft_seconds", "ttft_second"), known) == {"ray_tandem_ttft_second_bucket"}
    assert unknown_series(good.replace("ray_tandem", "tandem"), known) == {"tandem_ttft_seconds_bucket"}
    assert unknown_series(good.replace("_bucket", "_count"), known) == {"ray_tandem_ttft_seconds_count"}
    assert series_in("60 * sum by (action) (increase(ray_tandem_autoscaler_actions_total[5m])) > 1e3") == {
        "ray_tandem_autoscaler_actions_total"
    }


def test_the_docs_name_every_metric_and_action(dashboard):
    docs = DOCS.read_text()
    missing = [name for name in app_metric_kinds() if f"`{name}`" not in docs]
    missing += [kind.value for kind in (*ActionKind, *ScaleKind) if f"`{kind.value}`" not in docs]
    serve_used = {
        name for _, expr in queries(dashboard) for name in series_in(expr) if name.startswith(RAY_PREFIX + "serve_")
    }
    missing += [name for name in serve_used if f"`{name.removesuffix('_bucket')}`" not in docs]
    assert not missing, f"docs/metrics.md does not name: {missing}"
