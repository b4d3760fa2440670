"""What ``tfspeed.tune`` leaves behind: ``tuned.flags`` (the original flags nested, paths made
absolute, then each changed flag with its measured reason), ``tune.json`` (every candidate),
``tune.png``, the report lines it prints, and the reconversion it only recommends.
"""

from __future__ import annotations

import dataclasses
import json
import os

from tfspeed.config import BATCHING_MODES
from tfspeed.tuning.measurements import COLD, InputKey, InputTiming, Measurements
from tfspeed.tuning.predict import Candidate, candidates, predict, rate, rate_key, rate_unit
from tfspeed.tuning.verify import Budget, given_knobs
from tfspeed.util import charts

_PATH_FLAGS = ("flagfile", "data_dir", "model_dir")
_TUNE_FLAGS = ("--budget_s", "--tune_dir", "--verify", "--measure_to")  # not the job's


def write_outputs(tune_dir: str, config, flag_args: list[str], m: Measurements,
                  ranked: list[dict], chosen: dict, user: dict, budget: Budget,
                  keep_user: bool) -> dict:
    """``tuned.flags``, ``tune.json`` and ``tune.png`` into ``tune_dir``; prints the report.

    Returns:
      What ``tune.json`` holds, with the chart's path added.
    """
    result = _result(m, ranked, chosen, user, budget, keep_user)
    result["reconvert"] = recommend_storage(config, m, chosen) if chosen else None
    result["tuned_flags"] = write_flags(
        os.path.join(tune_dir, "tuned.flags"), flag_args, config,
        None if keep_user else chosen, user, m,
        kept_because="no candidate beat the original flags" if chosen else
        "no candidate fit the budget (a larger --budget_s verifies some)")
    with open(os.path.join(tune_dir, "tune.json"), "w") as f:
        json.dump({**result, "measurements": m.to_json()}, f, indent=2, default=str)
    result["chart"] = chart(result, os.path.join(tune_dir, "tune.png"))
    for line in report_lines(result, m):
        print(line)
    return result


def _result(m: Measurements, ranked, chosen, user, budget: Budget, keep_user: bool) -> dict:
    def row(r):
        return {"flags": r["candidate"].flags(), "label": r["candidate"].label(),
                "predicted": round(rate(r), 1), "bound": r["bound"],
                "step_ms": round(r["step_ms"], 3), "input_cpu_ms": round(r["input_cpu_ms"], 3),
                **({"predicted_real_tokens_per_sec": round(r["real_tokens_per_sec"], 1),
                    "expected_padding": r["expected_padding"],
                    "cost_per_real_token": r["cost_per_real_token"]}
                   if "real_tokens_per_sec" in r else {}),
                **({"measured": r["measured"]} if "measured" in r else {})}

    best = user if keep_user else chosen
    measured = rate(best["measured"])
    predicted = best.get("predicted") if keep_user else rate(chosen)
    return {
        "measurements": m,
        "candidates": [row(r) for r in ranked],
        "chosen": {"label": "your flags", **user} if keep_user else row(chosen),
        "kept_your_flags": keep_user,
        rate_key(best["measured"]): measured,
        "predicted": predicted,
        "prediction_error": abs(predicted - measured) / measured if predicted else None,
        "user": user.get("measured"),
        "user_predicted": user.get("predicted"),
        "vs_user": measured / rate(user["measured"]) if "measured" in user
        else None,
        **_token_result(m, best),
        "skipped": budget.skipped,
        "seconds": round(budget.used(), 1),
        "budget_s": budget.seconds,
    }


def _token_result(m: Measurements, best: dict) -> dict:
    """For token records: the batchings considered and the chosen one's measured real
    tokens/s and padding (absent for other jobs, as before)."""
    if not m.text:
        return {}
    figures = best["measured"]
    return {"batching_candidates": sorted(m.text["batching"]),
            "tokens_per_batch_candidates": m.text["tokens_per_batch"],
            "real_tokens_per_sec": figures.get("real_tokens_per_sec"),
            "padding_fraction": figures.get("padding_fraction"),
            "batching": figures["resolved"].get("batching")}


def recommend_storage(config, m: Measurements, chosen: dict) -> dict | None:
    """Raw storage at the training size, where images are decoded every epoch: the command
    and its predicted gain (never run here)."""
    from tfspeed.data import schema as schema_lib

    if m.image_storage not in ("jpeg", "png") or not config.data.image_size:
        return None
    schema = schema_lib.read(config.data.data_dir)
    cold = m.input[COLD]
    raw = max(cold.cpu_s - m.stages.decode, 0.0)  # decoding gone; reading 150 KB is ~free
    c = dataclasses.replace(chosen["candidate"], input_placement="host", cache="none",
                            parse="batched")
    now = rate(predict(c, m))
    stored_raw = {**m.input, COLD: InputTiming(cpu_s=raw, wall_s=cold.wall_s)}
    after = predict(c, dataclasses.replace(m, input=stored_raw))
    size = config.data.image_size
    return {
        "command": f"python scripts/to_tfrecord.py --source={schema.source} "
                   f"--output={config.data.data_dir.rstrip('/')}-{size}px "
                   f"--image_size={size} --image_format=raw",
        "predicted_gain_uncached": rate(after) / now,
        "when": "every epoch without a cache; with one, only the first epoch",
    }


def write_flags(path: str, flag_args: list[str], config, chosen: dict | None, user: dict,
                m: Measurements | None,
                kept_because: str = "no candidate beat the original flags") -> dict:
    """``tuned.flags``: the original flags, then each changed flag with its reason.

    Args:
      chosen: the winning entry, or None where the user's flags stay (nothing changes;
        ``m`` is then not needed).
      kept_because: where they stay, why (the first line says it).

    Returns:
      ``{"path": path, "changed": {flag: value}}``.
    """
    resolved = (user.get("measured") or {}).get("resolved", {})
    changed = _changed(chosen["candidate"], config, resolved, m) if chosen is not None else {}
    measured = rate((chosen or user)["measured"])
    unit = rate_unit((chosen or user)["measured"])
    head = f"# python -m tfspeed.tune: {measured:,.0f} {unit} measured with these flags"
    if chosen is None:
        head += f"; {kept_because}, nothing changed"
    elif "measured" in user:
        head += (f", {measured / rate(user['measured']):.2f}x the original's "
                 f"{rate(user['measured']):,.0f} (predicted "
                 f"{rate(chosen):,.0f})")
    lines = [head, *(_absolute(a) for a in flag_args
                     if a.startswith("--") and not a.startswith(_TUNE_FLAGS))]
    # A nested flagfile's own relative paths resolve from where the tune ran: pin them, so
    # the tuned flags train the same job from any directory.
    given = {a[2:].partition("=")[0] for a in flag_args}
    pinned = [f"--{name}={value}" for name, value in _resolved_paths(config)
              if name not in given]
    if pinned:
        lines += [f"# paths resolved from {os.getcwd()}, so these flags work from anywhere",
                  *pinned]
    for name, value in changed.items():
        lines.append(f"# {reason(name, str(value), chosen['candidate'], m)}")
        lines.append(f"--{name}={value}")
    with open(path + ".tmp", "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(path + ".tmp", path)
    return {"path": path, "changed": changed}


def _changed(c: Candidate, config, resolved: dict, m: Measurements) -> dict:
    """``c``'s knobs that differ from what the user's flags give (or resolved to, for
    ``auto`` and 0), leaving out those that do not apply to ``c``, and those left to
    ``auto`` that no candidate varied (nothing was compared: on text, the input's
    placement, cache and parse): ``auto`` decides them as before, and where the run of the
    user's flags did not happen there is no resolved value to compare with."""
    given, every = given_knobs(config), candidates(m)
    fixed = {name for name in c.flags() if len({getattr(o, name) for o in every}) == 1}
    changed = {}
    for name, value in c.flags().items():
        value = getattr(c, name)
        if name in fixed and given[name] in ("auto", 0):
            continue
        if name == "tokens_per_batch" and (c.batching == "pad" or not value):
            continue  # a padded batch (a classifier's bucketed one) holds --batch_size texts
        if c.input_placement == "device" and name in ("cache", "parse", "input_threads"):
            continue  # the split is read once, into the step
        if name == "parse" and c.cache != "none":
            continue  # parsing happens once, before the cache
        now = resolved.get(name, given[name]) if given[name] in ("auto", 0) else given[name]
        if str(now) != str(value):
            changed[name] = value
    return changed


def _absolute(arg: str) -> str:
    """``--flag=path`` with the path made absolute, for the flags that name paths."""
    name, _, value = arg[2:].partition("=")
    if name in _PATH_FLAGS and value:
        return f"--{name}={os.path.abspath(value)}"
    if name == "prepare_source" and value:
        return f"--{name}={_absolute_source(value)}"
    return arg


def _absolute_source(spec: str) -> str:
    """``KIND:PATH`` with PATH absolute (``digits``, ``tfds:NAME`` as they are)."""
    kind, sep, path = spec.partition(":")
    return f"{kind}:{os.path.abspath(path)}" if sep and kind != "tfds" else spec


def _resolved_paths(config) -> list[tuple[str, str]]:
    """The job's paths, absolute: what its flags (nested flagfiles too) resolved to here."""
    paths = [("data_dir", os.path.abspath(config.data.data_dir)),
             ("model_dir", os.path.abspath(config.model_dir))]
    if config.data.prepare_source:
        paths.append(("prepare_source", _absolute_source(config.data.prepare_source)))
    return paths


def reason(name: str, value: str, c: Candidate, m: Measurements) -> str:
    """One line of measured figures behind one changed flag."""
    cold = m.input[COLD].cpu_s * m.batch_size * 1000
    if name == "input_placement" and value == "device":
        return (f"the decoded split ({m.size_mb:,.1f} MB) fits the {m.ram_budget_mb:,.0f}"
                f" MB budget; held in the step it needs no input work, through tf.data it "
                f"costs {cold:.2f} CPU-ms per batch decoded")
    if name == "input_placement":
        return "tf.data measured faster than holding the split in the step"
    if name == "cache" and value == "none":
        return (f"decoding costs {cold:.2f} CPU-ms per batch: a cache measured no faster "
                "(its fill and per-element bookkeeping cost as much)")
    if name == "cache":
        warm = m.input.get(InputKey(value))
        warm_ms = (warm.cpu_s if warm else 0) * m.batch_size * 1000
        return (f"input costs {cold:.2f} CPU-ms per batch decoded, {warm_ms:.2f} from the "
                f"{value} cache; the split takes {m.size_mb:,.1f} MB of "
                f"{m.ram_budget_mb:,.0f}")
    if name == "parse" and InputKey("none", "single") in m.input:
        single = m.input[InputKey("none", "single")].cpu_s * m.batch_size * 1000
        return f"parsing costs {cold:.2f} CPU-ms per batch batched, {single:.2f} one by one"
    if name == "parse":  # one parse mode measured (token records: always batched)
        return f"the input measured {cold:.2f} CPU-ms per batch parsed {value}"
    if name == "input_threads":
        return (f"input capped at {value} of {m.cores} cores measured faster: the step "
                "keeps the rest")
    if name == "batching":
        return (f"{_token_costs(m)}; {value} measured the most real tokens/s")
    if name == "tokens_per_batch":
        step = m.step[c.step_key]
        return (f"a call costs {1000 * step.overhead_s:.2f} ms besides the step's "
                f"{1000 * step.step_s:.1f} ms on {m.text['held_tokens']:,} tokens: "
                f"{value} tokens per batch measured the most real tokens/s of "
                f"{m.text['tokens_per_batch']}")
    if name in ("precision", "xla"):
        figures = ", ".join(f"{k}: {1000 * v.step_s:.2f} ms" for k, v in m.step.items())
        return f"the step alone per precision/xla: {figures}"
    s = m.step[c.step_key]
    return (f"a call costs {1000 * s.overhead_s:.2f} ms besides its steps of "
            f"{1000 * s.step_s:.3f} ms: {value} steps per call keep that under 2%")


def _token_costs(m: Measurements) -> str:
    """Each batching's expected padding and, where known, predicted work per real token."""
    costs, measured = m.text.get("costs") or {}, m.text["batching"]
    return "; ".join(
        f"{mode}: {100 * measured[mode]['expected_padding']:.0f}% padding" +
        (f", {costs[mode]:.2f}x the work per real token" if mode in costs else "")
        for mode in BATCHING_MODES if mode in measured) + (
        " (padding and attention pairs counted)" if m.text.get("attention_length") else "")


def report_lines(result: dict, m: Measurements) -> list[str]:
    """What the command prints: the measurements, the verified candidates, the choice."""
    cached = "".join(f", {1e6 * m.input[InputKey(k)].cpu_s:.1f} from the {k} cache"
                     for k in ("memory", "disk") if InputKey(k) in m.input)
    lines = [f"tfspeed tune ({result['seconds']:.0f} s of a {result['budget_s']:.0f} s "
             f"budget, {m.cores} cores, batch {m.batch_size})",
             f"  input: {1e6 * m.input[COLD].cpu_s:.1f} CPU-µs per example decoded" + cached +
             f"; split {m.size_mb:,.1f} MB decoded",
             "  step alone: " + ", ".join(f"{k} {1000 * v.step_s:.2f} ms + "
                                          f"{1000 * v.overhead_s:.2f} ms per call"
                                          for k, v in m.step.items()),
             *([f"  text: {m.text['mean_length']:.0f} tokens per sequence on average, rows "
                f"of up to {m.text['max_length']}; {_token_costs(m)}"] if m.text else []),
             f"  {'candidate':<58} {'predicted':>10} {'measured':>10}"]
    if result["user"]:
        lines.append(f"  {'your flags':<58} {'':>10} "
                     f"{rate(result['user']):>10,.0f}")
    for r in (r for r in result["candidates"] if "measured" in r):
        mark = "*" if r["label"] == result["chosen"]["label"] else " "
        lines.append(f" {mark}{r['label']:<58} {r['predicted']:>10,.0f} "
                     f"{rate(r['measured']):>10,.0f}")
    vs = f", {result['vs_user']:.2f}x your flags" if result["vs_user"] else ""
    error = result["prediction_error"]
    lines.append(f"chosen: {result['chosen']['label']}{vs}" + (
        f" (prediction error {100 * error:.0f}%)" if error is not None else ""))
    if result["reconvert"]:
        r = result["reconvert"]
        lines.append(f"reconvert (not done; {r['when']}): {r['command']}  [predicted "
                     f"{r['predicted_gain_uncached']:.2f}x uncached]")
    for s in result["skipped"]:
        lines.append(f"skipped for lack of time: {s}")
    lines.append(f"train with: python -m tfspeed.train --flagfile={result['tuned_flags']['path']}")
    return lines


def chart(result: dict, path: str) -> str:
    """Predicted against measured speed (``predict.rate``) of the verified candidates, as a
    PNG."""
    shown = [r for r in result["candidates"] if "measured" in r]
    user = result["user"]
    bars = charts.Panel(
        labels=[r["label"] for r in shown],
        series={"predicted": [r["predicted"] for r in shown],
                "measured": [rate(r["measured"]) for r in shown]},
        value_label=rate_unit(shown[0]["measured"]) if shown else "examples/s", font_size=7,
        reference=("your flags", rate(user)) if user else None)
    return charts.bar_chart(path, [bars], size=(9, 1.2 + 0.5 * len(shown)))
