"""A sweep as one card of the sidebar: the registry rows of its trials, grouped by the sweep each
belongs to (the `sweep` column: the sweep's name, the trial's number, the trials asked for, the
monitored metric and its direction), with what the card shows of the whole: trials ended of all,
the best value so far, and the sweep's state.
"""

from __future__ import annotations

ACTIVE = ("queued", "running")
PRUNED = "pruned by the sweep"  # how a pruned trial's stop reason begins (sweeps/trials.py, Pruning)


def sweep_cards(registry, runs: list[dict]) -> list[dict]:
    """One card per sweep that any of `runs` (newest first) is a trial of, in that order; each with
    all of its trials, also those older than `runs` reaches."""
    names = list(dict.fromkeys(run["sweep"]["name"] for run in runs if run.get("sweep")))
    if not names:
        return []
    stops = registry.sweep_stops()
    return [sweep_card(name, registry.sweep_runs(name), stops.get(name)) for name in names]


def sweep_card(name: str, rows: list[dict], stop_reason: str | None = None) -> dict:
    """The card of the sweep `name` from its trials' rows (newest first); `stop_reason`: the stop of
    the whole sweep asked, in words, or None."""
    tag = rows[0]["sweep"]  # the newest trial's: a sweep run again with more trials says so there
    trials = sorted((_trial(row, tag["monitor"]) for row in rows), key=lambda trial: trial["trial"])
    done = [trial for trial in trials if trial["status"] not in ACTIVE]
    valued = [trial for trial in done if trial["value"] is not None]
    pick = min if tag["direction"] == "minimize" else max
    best = pick(valued, key=lambda trial: trial["value"]) if valued else None
    return {"name": name, "trials": max(tag["trials"], len(trials)), "done": len(done),
            "monitor": tag["monitor"], "direction": tag["direction"],
            "best": None if best is None else {"trial": best["trial"], "value": best["value"], "id": best["id"]},
            "state": _state(trials, len(done), tag["trials"], stop_reason), "stop_reason": stop_reason,
            "started_at": min((t["started_at"] or 0 for t in trials), default=None),
            "updated_at": max((t["updated_at"] or 0 for t in trials), default=None), "runs": trials}


def _trial(row: dict, monitor: str) -> dict:
    """A trial's row as the card lists it: its number, its state in the sweep's words, its value."""
    trial = {key: value for key, value in row.items() if key not in ("config", "history", "losses")}
    trial["trial"] = row["sweep"]["trial"]
    status, reason = row["status"], row.get("stop_reason") or ""
    if status == "completed":
        trial["state"] = "complete"
    elif status == "stopped" and reason.startswith(PRUNED):
        trial["state"] = "pruned"
    elif status == "running" and row.get("stop_requested"):
        trial["state"] = "stopping"
    else:
        trial["state"] = status
    trial["value"] = _value(row, monitor) if status == "completed" else None
    return trial


def _value(row: dict, monitor: str) -> float | None:
    """The monitored value of the weights the trial ended with, as its run recorded it: its best with
    restore_best, else the last one measured."""
    recorded = row.get("best") if (row.get("config") or {}).get("restore_best") else row.get("latest")
    value = (recorded or {}).get(monitor)
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _state(trials: list[dict], done: int, asked: int, stop_reason: str | None) -> str:
    if any(trial["status"] in ACTIVE for trial in trials):
        return "stopping" if stop_reason else "running"
    if stop_reason:
        return "stopped"
    return "completed" if done >= asked else "incomplete"  # its kernel ended it early, or runs it on
