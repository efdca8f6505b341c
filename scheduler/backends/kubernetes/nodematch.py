"""Which nodes a pod template may run on, by kube-scheduler's rules; and what silod refuses.

Pure (no API calls). One rule set for three callers, so they cannot disagree:

- placement (placement.py): a node is a candidate only if the pod's nodeSelector and required
  node affinity select it and the pod tolerates its NoSchedule/NoExecute taints;
- the admission webhook (webhook.py) and REST submissions (backend.create_workload) run
  `admission_problems` on the workload: one validation function for both.

Node affinity follows k8s.io/component-helpers/scheduling/corev1/nodeaffinity: the
nodeSelectorTerms are ORed, a term's matchExpressions and matchFields are ANDed, a term with
neither matches no node; operators In, NotIn, Exists, DoesNotExist, Gt, Lt (integers); the only
field is metadata.name (In/NotIn). NotIn and DoesNotExist match a node without the label.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

LABEL_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt")
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


@dataclass(frozen=True, slots=True)
class NodeLabels:
    """What admission checks of a node: its name, labels and GPUs (allocatable nvidia.com/gpu)."""

    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    gpus: int = 0


def _expression_matches(expr: Mapping[str, Any], value: str | None) -> bool:
    op = expr.get("operator")
    values = [str(v) for v in expr.get("values") or []]
    if op == "In":
        return value is not None and value in values
    if op == "NotIn":
        return value is None or value not in values
    if op == "Exists":
        return value is not None
    if op == "DoesNotExist":
        return value is None
    if op in ("Gt", "Lt"):
        try:
            have, want = int(value or ""), int(values[0])
        except (ValueError, IndexError):
            return False
        return have > want if op == "Gt" else have < want
    return False


def term_matches(term: Mapping[str, Any], name: str, labels: Mapping[str, str]) -> bool:
    if not isinstance(term, Mapping):
        return False  # malformed (a workload created without the webhook): selects nothing
    exprs = term.get("matchExpressions") or []
    fields = term.get("matchFields") or []
    if not exprs and not fields or not all(isinstance(e, Mapping) for e in [*exprs, *fields]):
        return False
    return (all(_expression_matches(e, labels.get(str(e.get("key")))) for e in exprs)
            and all(_expression_matches(f, name if f.get("key") == "metadata.name" else None) for f in fields))


def required_terms(pod_spec: Mapping[str, Any]) -> list[Mapping[str, Any]] | None:
    """The required node affinity's nodeSelectorTerms, or None when the pod has none."""
    aff = pod_spec.get("affinity")
    node_aff = aff.get("nodeAffinity") if isinstance(aff, Mapping) else None
    required = node_aff.get("requiredDuringSchedulingIgnoredDuringExecution") if isinstance(node_aff, Mapping) else None
    if not isinstance(required, Mapping):
        return None
    terms = required.get("nodeSelectorTerms")
    return list(terms) if isinstance(terms, list) else []


def node_selected(name: str, labels: Mapping[str, str], selector: Mapping[str, str],
                  terms: Sequence[Mapping[str, Any]] | None) -> bool:
    """The node satisfies the nodeSelector and (when given) one of the required affinity terms."""
    if not all(labels.get(k) == v for k, v in selector.items()):
        return False
    return terms is None or any(term_matches(t, name, labels) for t in terms)


def _structure_problems(pod_spec: Mapping[str, Any], where: str) -> list[str]:
    """Scheduling fields silod reads and the API server would take but silod cannot honour, or
    that are malformed (the API server validates pods, not yet the Jobs that make them)."""
    out: list[str] = []
    selector = pod_spec.get("nodeSelector")
    if selector is not None and not (isinstance(selector, Mapping)
                                     and all(isinstance(v, str) for v in selector.values())):
        out.append(f"{where} nodeSelector must map label keys to string values")
    terms = required_terms(pod_spec)
    for i, term in enumerate(terms or []):
        if not isinstance(term, Mapping):
            out.append(f"{where} nodeSelectorTerms[{i}] must be an object")
            continue
        for part in ("matchExpressions", "matchFields"):
            for j, e in enumerate(term.get(part) or []):
                at = f"{where} nodeSelectorTerms[{i}].{part}[{j}]"
                op, values = (e.get("operator"), e.get("values")) if isinstance(e, Mapping) else (None, None)
                if op not in LABEL_OPERATORS or (part == "matchFields" and op not in ("In", "NotIn")):
                    out.append(f"{at}.operator {op!r}: use one of "
                               + ", ".join(LABEL_OPERATORS if part == "matchExpressions" else ("In", "NotIn")))
                elif part == "matchFields" and e.get("key") != "metadata.name":
                    out.append(f"{at}.key {e.get('key')!r}: the only node field is metadata.name")
                elif op in ("In", "NotIn") and not values:
                    out.append(f"{at}: operator {op} needs values")
                elif op in ("Exists", "DoesNotExist") and values:
                    out.append(f"{at}: operator {op} takes no values")
                elif op in ("Gt", "Lt") and not (isinstance(values, list) and len(values) == 1
                                                 and str(values[0]).lstrip("-").isdigit()):
                    out.append(f"{at}: operator {op} takes one integer value")
    if terms is not None and not terms:
        out.append(f"{where} requiredDuringSchedulingIgnoredDuringExecution has no nodeSelectorTerms")
    tolerations = pod_spec.get("tolerations")
    if tolerations is not None and not isinstance(tolerations, list):
        out.append(f"{where} tolerations must be a list")
    for i, t in enumerate(tolerations if isinstance(tolerations, list) else []):
        at = f"{where} tolerations[{i}]"
        if not isinstance(t, Mapping):
            out.append(f"{at} must be an object")
            continue
        op = t.get("operator") or "Equal"
        if op not in ("Equal", "Exists"):
            out.append(f"{at}.operator {op!r}: use Equal or Exists")
        elif op == "Exists" and t.get("value"):
            out.append(f"{at}: operator Exists takes no value")
        elif op == "Equal" and not t.get("key"):
            out.append(f"{at}: an empty key needs operator Exists")
        if t.get("effect") and t.get("effect") not in TAINT_EFFECTS:
            out.append(f"{at}.effect {t.get('effect')!r}: use one of {', '.join(TAINT_EFFECTS)} (or none: every effect)")
    return out


def pod_spec_problems(pod_spec: Mapping[str, Any], where: str, nodes: Sequence[NodeLabels] | None,
                      gpus: int = 0) -> list[str]:
    """Why silod would never admit pods of this spec: malformed scheduling fields, or (given the
    cluster's nodes) a nodeSelector / required node affinity that no node matches (among the
    nodes with GPUs when the pods request GPUs). With no such node at all nothing is refused
    here: a cluster still being built is not a reason (the job waits, and fails after
    --backend-opt unschedulable-timeout)."""
    problems = _structure_problems(pod_spec, where)
    if problems or not nodes:
        return problems
    pool = [n for n in nodes if n.gpus > 0] if gpus > 0 else list(nodes)
    if not pool:
        return problems
    selector = pod_spec.get("nodeSelector") or {}
    terms = required_terms(pod_spec)
    if selector or terms is not None:
        if not any(node_selected(n.name, n.labels, selector, terms) for n in pool):
            what = " and ".join(x for x, on in (("nodeSelector " + ", ".join(f"{k}={v}" for k, v in sorted(selector.items())),
                                                 bool(selector)),
                                                ("required node affinity", terms is not None)) if on)
            out_of = f"{len(pool)} node(s)" + (" with GPUs" if gpus > 0 else "")
            problems.append(f"{where}: no node of the cluster matches its {what} (0 of {out_of}); change the"
                            f" selector, or label a node so that it matches, then create the workload again")
    return problems


__all__ = ["NodeLabels", "node_selected", "pod_spec_problems", "required_terms", "term_matches"]
