"""The replicas' answers merged into one: the model list and the Prometheus metrics.

/v1/models: each model once, with `replicas`: where it is registered and in which tier there
(`disk`, `host`, `device`); the top-level `tier` is the best of them and `pinned` holds if it
is pinned anywhere. /metrics: every replica's series with a `replica` label, each family once.
"""

from __future__ import annotations

_TIER_RANK = {"disk": 0, "host": 1, "device": 2}
_PER_REPLICA = ("tier", "pinned", "in_flight", "waiting")
_SUMMED = ("in_flight", "waiting")


def merge_cards(per_replica: dict[str, list[dict]]) -> list[dict]:
    """Model cards of every replica (replica id -> its cards), merged by model id."""
    merged: dict[str, dict] = {}
    for rid, cards in per_replica.items():
        for card in cards:
            here = {"replica": rid, **{k: card[k] for k in _PER_REPLICA if k in card}}
            out = merged.get(card["id"])
            if out is None:
                out = merged[card["id"]] = {**card, "replicas": []}
            else:
                if _TIER_RANK.get(card.get("tier"), -1) > _TIER_RANK.get(out.get("tier"), -1):
                    out["tier"] = card["tier"]
                out["pinned"] = bool(out.get("pinned")) or bool(card.get("pinned"))
                for key in _SUMMED:
                    if key in card:
                        out[key] = out.get(key, 0) + card[key]
                if out.get("rank") is None and card.get("rank") is not None:
                    out["rank"] = card["rank"]
            out["replicas"].append(here)
    # the base model first, as a single server lists it; adapters in name order
    return sorted(merged.values(), key=lambda c: (c.get("parent") is not None, c["id"]))


def relabel_metrics(per_replica: dict[str, str], extra: str = "") -> str:
    """Prometheus text of every replica, a `replica="ID"` label on each sample, and each
    family's HELP/TYPE once with all its samples together (as the format requires)."""
    families: dict[str, tuple[list[str], list[str]]] = {}
    for rid, text in per_replica.items():
        current = None
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    current = parts[2]
                    head, _ = families.setdefault(current, ([], []))
                    if line not in head:
                        head.append(line)
                continue
            if current is None:  # a sample before any TYPE: its own family
                current = line.split("{", 1)[0].split(" ", 1)[0]
                families.setdefault(current, ([], []))
            families[current][1].append(_with_label(line, "replica", rid))
    lines = []
    for head, samples in families.values():
        lines.extend(head)
        lines.extend(samples)
    return "\n".join(lines) + "\n" + extra


def _with_label(sample: str, key: str, value: str) -> str:
    label = f'{key}="{_escape(value)}"'
    brace = sample.find("{")
    space = sample.find(" ")
    if brace != -1 and (space == -1 or brace < space):
        rest = sample[brace + 1:]
        return f"{sample[:brace]}{{{label}{'' if rest.startswith('}') else ','}{rest}"
    return f"{sample[:space]}{{{label}}}{sample[space:]}"


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
