"""The rollout viewer's HTML: one self-contained page (inline CSS and a little vanilla JS, nothing
fetched from anywhere) rendered from :class:`~astralight.report.viewer.Rollouts`.

Every piece of sample text (decoded tokens, metadata, tool calls and results, task ids) is
untrusted model or environment output: it goes through :func:`html.escape` (``quote=True``)
before it reaches the page, as element text or as a quoted attribute value, never into the
script. The page also carries a Content-Security-Policy that lets only its own script run (by
its SHA-256), so even markup that slipped through could not execute.

Layout: a header (run, DB, tokenizers, what the caps left out), the filter bar (policy, reward
range, tool error kind, sample state) and the colour toggle (loss mask / behaviour log-prob), then
one section per policy and version (newest first), one ``<details>`` per task group, one
``<article class="sample">`` per sample with ``data-model``, ``data-reward``, ``data-errors``,
``data-state`` and ``data-version`` (what the filters read). Tokens: runs of prompt (``class="p"``)
and environment (``class="e"``: tool results, observations) tokens with ``data-m="0"``, and one
span per generated token, ``class="g bN" data-m="1" data-lp="..."`` (``N``: the log-prob's bucket,
:func:`lp_bucket`). The script fills in the counts (``#shown-count``) and applies the filters.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import math
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from astralight.report.viewer import Detokenizer, Rollouts, StoredSample, Tokenizers, ViewerCaps

#: the tool error kinds and agent failures a sample's metadata can state (agents.stats)
try:
    from astralight.agents.stats import ERROR_KINDS, FAILURE_KINDS
except ImportError:  # pragma: no cover - part of the package
    ERROR_KINDS, FAILURE_KINDS = (), ()

#: log-prob bucket bounds: p >= 0.9, 0.5, 0.1, 0.01, below
LP_BOUNDS = (math.log(0.9), math.log(0.5), math.log(0.1), math.log(0.01))
#: characters of a tool result / metadata value shown
MAX_RESULT_CHARS = 600
MAX_METADATA_CHARS = 4000
#: tokens (and characters) of the prompt's end shown while the prompt is folded
PROMPT_TAIL = 120
#: metadata keys shown in a sample's header line (the rest: under "metadata")
HEADER_KEYS = ("end", "finish_reason", "turns", "attempt", "segment", "judged_correct",
               "team_correct")


def esc(value: Any) -> str:
    """``value`` as HTML text or a quoted attribute value (NUL, which HTML turns into U+FFFD
    anyway, made explicit)."""
    return html.escape(str(value), quote=True).replace("\x00", "\ufffd")


def lp_bucket(lp: float) -> int:
    """0 (likely: p >= 0.9) .. 4 (p < 0.01): the colour of a generated token in log-prob mode."""
    for i, bound in enumerate(LP_BOUNDS):
        if lp >= bound:
            return i
    return len(LP_BOUNDS)


def error_kinds(metadata: dict) -> list[str]:
    """The tool error kinds a sample's metadata counts (``tool_errors``: ``{kind: n}`` with
    n > 0) and its agent failure (``end`` ``error`` / ``timeout``: ``agent_error`` /
    ``agent_timeout``)."""
    out = []
    errors = metadata.get("tool_errors")
    if isinstance(errors, dict):
        for kind, n in errors.items():
            if isinstance(n, (int, float)) and not isinstance(n, bool) and n > 0:
                out.append(str(kind))
    end = metadata.get("end")
    if isinstance(end, str) and end in FAILURE_KINDS:
        out.append(f"agent_{end}")
    return out


def _attr_token(kind: str) -> str:
    """An error kind as one space-free word of ``data-errors``."""
    return "".join(c if c.isalnum() or c in "_-." else "_" for c in kind) or "_"


# ----------------------------------------------------------------------------- tokens


def _pieces(ids: list[int], detok: Detokenizer | None) -> list[str]:
    if detok is not None:
        try:
            return detok.pieces(ids)
        except Exception:  # noqa: BLE001 - an id outside the vocabulary, a broken tokenizer
            pass
    return [f"{i} " for i in ids]


def render_tokens(sample: Any, detok: Detokenizer | None, max_tokens: int) -> str:
    """The sample's tokens as spans (see the module docstring), the prompt's inside a closed
    ``<details class="prompt">``; at most ``max_tokens`` of them: the first quarter and the last
    three quarters of the cap, with the middle elided."""
    ids = sample.token_ids.tolist()
    n = len(ids)
    mask = sample.loss_mask
    lps = sample.logprobs
    if n > max_tokens:
        head = max_tokens // 4
        parts = [(0, head), (n - (max_tokens - head), n)]
    else:
        parts = [(0, n)]
    prompt: list[str] = []
    rest: list[str] = []
    for k, (a, b) in enumerate(parts):
        if k:
            skipped = parts[1][0] - parts[0][1]
            (prompt if parts[0][1] < sample.prompt_len else rest).append(
                f'<span class="gap">[... {skipped} tokens not shown ...]</span>')
        pieces = _pieces(ids[a:b], detok)
        run_kind: str | None = None
        run: list[str] = []
        out = prompt

        def flush() -> None:
            if run:
                out.append(f'<span class="{run_kind}" data-m="0">{esc("".join(run))}</span>')
                run.clear()

        for i, piece in zip(range(a, b), pieces):
            if i >= sample.prompt_len and out is prompt:
                flush()
                out = rest
            if mask[i]:
                flush()
                lp = float(lps[i])
                out.append(f'<span class="g b{lp_bucket(lp)}" data-m="1" data-lp="{lp:.4g}">'
                           f'{esc(piece)}</span>')
            else:
                kind = "p" if i < sample.prompt_len else "e"
                if kind != run_kind:
                    flush()
                run_kind = kind
                run.append(piece)
        flush()
    if not prompt:
        return "".join(rest)
    tail = ""
    if detok is not None and sample.prompt_len:
        try:
            text = detok.decode(ids[max(0, sample.prompt_len - PROMPT_TAIL):sample.prompt_len])
            text = text[-PROMPT_TAIL:].replace("\r", "").replace("\n", " \u23ce ")
            tail = f' <span class="pt">...{esc(text)}</span>'
        except Exception:  # noqa: BLE001 - as _pieces: ids shown, no tail
            pass
    return (f'<details class="prompt"><summary>prompt: {sample.prompt_len} tokens{tail}'
            f'</summary>' + "".join(prompt) + '</details>' + "".join(rest))


def turns_of(sample: Any, detok: Detokenizer | None) -> list[tuple[str, str]]:
    """After the prompt: ``("model", text)`` for each run of generated tokens and ``("env",
    text)`` for each run of the environment's (tool results, observations), decoded."""
    if detok is None:
        return []
    mask = np.asarray(sample.loss_mask).astype(bool)
    ids = sample.token_ids.tolist()
    runs: list[tuple[str, int, int]] = []
    start = min(sample.prompt_len, len(ids))
    for i in range(start, len(ids) + 1):
        if i == len(ids) or (i > start and mask[i] != mask[i - 1]):
            if i > start:
                runs.append(("model" if mask[start] else "env", start, i))
            start = i
    try:
        texts = detok.decode_batch([ids[a:b] for _, a, b in runs])
    except Exception:  # noqa: BLE001 - undecodable ids: no turns shown
        return []
    return [(kind, text) for (kind, _, _), text in zip(runs, texts)]


def tool_rows(turns: list[tuple[str, str]]) -> list[dict]:
    """The tool calls of the model's turns (``<tool_call>{json}</tool_call>``), each with its
    model turn (1, 2, ...), the environment's next turn (its result) and the parse error, if
    any."""
    try:
        from astralight.agents.tools import parse_tool_calls
    except ImportError:  # pragma: no cover - part of the package
        return []
    rows = []
    model_turn = 0
    for k, (kind, text) in enumerate(turns):
        if kind != "model":
            continue
        model_turn += 1
        if "<tool_call>" not in text:
            continue
        result = turns[k + 1][1] if k + 1 < len(turns) and turns[k + 1][0] == "env" else None
        for call in parse_tool_calls(text):
            rows.append({"turn": model_turn, "name": call.name, "arguments": call.arguments,
                         "error": call.error, "result": result})
    return rows


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f" [... {len(text) - limit} more]"


# ----------------------------------------------------------------------------- samples


def _fmt(x: float) -> str:
    return f"{x:+.3f}" if x else "0"


def render_sample(s: StoredSample, detok: Detokenizer | None, caps: ViewerCaps) -> str:
    x = s.sample
    meta = x.metadata if isinstance(x.metadata, dict) else {}
    errors = error_kinds(meta)
    mask = np.asarray(x.loss_mask).astype(bool)
    gen_versions = x.versions[mask]
    vmax = int(gen_versions.max()) if gen_versions.size else x.min_version
    vtext = f"v{x.min_version}" + (f"-{vmax}" if vmax != x.min_version else "")
    head = [f'<span class="idx">#{x.sample_index}</span>',
            f'<span class="pol">{esc(x.model_id)}</span>'
            + (f' <span class="role">{esc(x.role)}</span>' if x.role else ""),
            f'<span title="policy versions of the generated tokens">{esc(vtext)}</span>',
            f'<span class="st st-{esc(_attr_token(s.state))}">{esc(s.state)}</span>',
            f'reward <b class="rw">{x.reward:.3f}</b>',
            f'advantage <b class="adv">{_fmt(x.advantage)}</b>',
            f'{x.num_tokens} tokens ({int(mask.sum())} generated)']
    for key in HEADER_KEYS:
        if isinstance(meta.get(key), (str, int, float)):  # bool is an int
            head.append(f'{esc(key)} <b>{esc(meta[key])}</b>')
    if isinstance(meta.get("tool_calls"), int):
        head.append(f'tool calls <b>{meta["tool_calls"]}</b>')
    parts = [f'<article class="sample" id="s{s.row_id}" data-model="{esc(x.model_id)}" '
             f'data-reward="{x.reward!r}" data-advantage="{x.advantage!r}" '
             f'data-errors="{esc(" ".join(_attr_token(e) for e in errors))}" '
             f'data-state="{esc(s.state)}" data-version="{x.min_version}">',
             '<div class="sh">' + ' <span class="sep">&middot;</span> '.join(head) + '</div>']
    if errors:
        counts = meta.get("tool_errors") if isinstance(meta.get("tool_errors"), dict) else {}
        shown = [f'{esc(e)}' + (f' &times;{esc(counts[e])}' if e in counts else '')
                 for e in errors]
        parts.append('<div class="err">errors: ' + ", ".join(shown) + '</div>')
    for key in ("agent_error", "error"):
        if isinstance(meta.get(key), str) and meta[key]:
            parts.append(f'<div class="err">{esc(key)}: {esc(_cut(meta[key], 2000))}</div>')
    parts.append(f'<div class="toks">{render_tokens(x, detok, caps.tokens)}</div>')
    calls = tool_rows(turns_of(x, detok)) if detok is not None else []
    if calls:
        rows = []
        for c in calls:
            what = (f'<span class="err">{esc(c["error"][0])}: {esc(c["error"][1])}</span>'
                    if c["error"] else "")
            args = json.dumps(c["arguments"], ensure_ascii=False)
            result = "" if c["result"] is None else _cut(c["result"], MAX_RESULT_CHARS)
            rows.append(f'<tr><td>{c["turn"]}</td><td>{esc(c["name"])}</td>'
                        f'<td><code>{esc(_cut(args, MAX_RESULT_CHARS))}</code>{what}</td>'
                        f'<td><pre>{esc(result)}</pre></td></tr>')
        parts.append('<table class="tools"><thead><tr><th>turn</th><th>tool</th>'
                     '<th>arguments</th><th>result</th></tr></thead><tbody>' + "".join(rows)
                     + '</tbody></table>')
    if meta:
        text = json.dumps(meta, ensure_ascii=False, indent=1, default=str, sort_keys=True)
        parts.append(f'<details class="meta"><summary>metadata</summary>'
                     f'<pre>{esc(_cut(text, MAX_METADATA_CHARS))}</pre></details>')
    parts.append('</article>')
    return "".join(parts)


# ----------------------------------------------------------------------------- the page

CSS = """
:root{--fg:#1b1f24;--muted:#5f6b76;--line:#d8dee4;--bg:#f6f8fa}
*{box-sizing:border-box}
body{margin:0;font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:var(--fg)}
header.top{padding:12px 20px;background:#24292f;color:#fff}
header.top h1{margin:0 0 4px;font-size:18px}
header.top .src{color:#c9d1d9;font-size:12px}
.bar{position:sticky;top:0;z-index:2;display:flex;flex-wrap:wrap;gap:14px;align-items:center;
 padding:8px 20px;background:#fff;border-bottom:1px solid var(--line);font-size:13px}
.bar label{display:inline-flex;gap:4px;align-items:center}
.bar input[type=number]{width:70px}
#shown-count{font-weight:600;margin-left:auto}
.notes{margin:10px 20px;padding:8px 12px;background:#fff8c5;border:1px solid #eed888;
 border-radius:6px;font-size:13px}
.notes p{margin:2px 0}
main{padding:4px 20px 40px}
section.version>h2{font-size:16px;margin:18px 0 6px;padding-bottom:4px;
 border-bottom:2px solid var(--line)}
section.version>h2 .vc{font-weight:400;color:var(--muted);font-size:13px}
details.group{margin:8px 0;border:1px solid var(--line);border-radius:6px;background:var(--bg)}
details.group>summary{cursor:pointer;padding:6px 10px;font-size:13px}
details.group>summary code{font-weight:600}
.gc{color:var(--muted)}
article.sample{margin:6px 8px 8px;padding:8px 10px;background:#fff;border:1px solid var(--line);
 border-radius:6px}
.sh{font-size:12.5px;color:var(--muted);margin-bottom:6px}
.sh b{color:var(--fg)}
.sep{color:#aab4be}
.idx,.pol{font-weight:600;color:var(--fg)}
.role{background:#ddf4ff;border-radius:4px;padding:0 4px}
.st{border-radius:4px;padding:0 5px;background:#eaeef2;color:#24292f}
.st-acked{background:#dafbe1}.st-stale,.st-filtered{background:#ffebe9}
.st-queued{background:#fff8c5}
.err{color:#a40e26;font-size:12.5px;margin:2px 0}
.toks{white-space:pre-wrap;word-break:break-word;font:12px/1.55 ui-monospace,SFMono-Regular,Menlo,
 Consolas,monospace;padding:6px 8px;border-radius:4px;background:#fbfcfd;max-height:420px;
 overflow:auto;border:1px solid #eef1f4}
.toks details.prompt>summary{cursor:pointer;color:var(--muted);font:12px system-ui,sans-serif}
.toks details.prompt>summary .pt{font:12px/1.55 ui-monospace,SFMono-Regular,Menlo,Consolas,
 monospace;color:#57606a;background:#eceff1}
.toks .gap{display:block;color:var(--muted);font-style:italic;margin:4px 0}
body.mode-mask .toks .p{background:#eceff1;color:#57606a}
body.mode-mask .toks .e{background:#ddf4ff;color:#0a3069}
body.mode-mask .toks .g{background:#d2f4d9}
body.mode-lp .toks .p,body.mode-lp .toks .e{color:#8c959f}
body.mode-lp .toks .b0{background:#d2f4d9}
body.mode-lp .toks .b1{background:#eef7c3}
body.mode-lp .toks .b2{background:#fff0b3}
body.mode-lp .toks .b3{background:#ffd8b5}
body.mode-lp .toks .b4{background:#ffb3b3}
.legend span{display:inline-block;padding:0 6px;border-radius:3px;margin-right:2px;font-size:12px}
body.mode-lp .legend .lm,body.mode-mask .legend .ll{display:none}
table.tools{border-collapse:collapse;margin:8px 0 2px;font-size:12.5px;width:100%}
table.tools th,table.tools td{border:1px solid var(--line);padding:3px 6px;text-align:left;
 vertical-align:top}
table.tools th{background:var(--bg)}
table.tools pre{margin:0;white-space:pre-wrap;word-break:break-word}
details.meta{font-size:12px;margin-top:4px}
details.meta pre{margin:4px 0;white-space:pre-wrap;word-break:break-word;background:var(--bg);
 padding:6px}
#tip{position:fixed;right:12px;bottom:10px;background:#24292f;color:#fff;padding:4px 8px;
 border-radius:4px;font-size:12px;visibility:hidden}
[hidden]{display:none!important}
"""

#: the page's script: no sample data in it, ever (its hash is in the page's CSP)
SCRIPT = """
(function () {
  "use strict";
  var $ = function (sel) { return document.querySelector(sel); };
  var samples = Array.prototype.slice.call(document.querySelectorAll("article.sample"));
  var groups = Array.prototype.slice.call(document.querySelectorAll("details.group"));
  var sections = Array.prototype.slice.call(document.querySelectorAll("section.version"));
  var f = {policy: $("#f-policy"), error: $("#f-error"), state: $("#f-state"),
           rmin: $("#f-rmin"), rmax: $("#f-rmax")};
  function keep(s) {
    var d = s.dataset, r = parseFloat(d.reward), lo = parseFloat(f.rmin.value),
        hi = parseFloat(f.rmax.value), errs = d.errors ? d.errors.split(" ") : [],
        e = f.error.value;
    if (f.policy.value !== "" && d.model !== f.policy.value) return false;
    if (f.state.value !== "" && d.state !== f.state.value) return false;
    if (!isNaN(lo) && !(r >= lo)) return false;
    if (!isNaN(hi) && !(r <= hi)) return false;
    if (e === "*any") return errs.length > 0;
    if (e === "*none") return errs.length === 0;
    return e === "" || errs.indexOf(e) >= 0;
  }
  function count(el) {
    return el.querySelectorAll("article.sample:not([hidden])").length;
  }
  function apply() {
    var shown = 0;
    samples.forEach(function (s) { s.hidden = !keep(s); if (!s.hidden) shown += 1; });
    groups.forEach(function (g) {
      var n = count(g);
      g.hidden = n === 0;
      g.querySelector(".gn").textContent = n + " of " + g.dataset.n;
    });
    sections.forEach(function (v) {
      var n = count(v);
      v.hidden = n === 0;
      v.querySelector(".vn").textContent = n + " of " + v.dataset.n + " samples";
    });
    $("#shown-count").textContent = shown + " of " + samples.length + " samples shown";
    $("#shown-count").dataset.shown = String(shown);
  }
  function colour(mode) {
    document.body.classList.toggle("mode-lp", mode === "lp");
    document.body.classList.toggle("mode-mask", mode !== "lp");
    Array.prototype.forEach.call(document.querySelectorAll("input[name=colour]"), function (r) {
      r.checked = r.value === (mode === "lp" ? "lp" : "mask");
    });
  }
  function prompts(open) {
    $("#f-prompts").checked = open;
    Array.prototype.forEach.call(document.querySelectorAll("details.prompt"), function (d) {
      d.open = open;
    });
  }
  // the filters live in the address's #fragment too: a view can be shared or bookmarked
  function save() {
    var q = new URLSearchParams();
    ["policy", "error", "state", "rmin", "rmax"].forEach(function (k) {
      if (f[k].value !== "") q.set(k, f[k].value);
    });
    if (document.body.classList.contains("mode-lp")) q.set("colour", "lp");
    if ($("#f-prompts").checked) q.set("prompts", "1");
    try { history.replaceState(null, "", "#" + q.toString()); } catch (e) { /* file: */ }
  }
  function load() {
    var q = new URLSearchParams(location.hash.replace(/^#/, ""));
    ["policy", "error", "state", "rmin", "rmax"].forEach(function (k) {
      if (q.has(k)) f[k].value = q.get(k);
    });
    colour(q.get("colour"));
    prompts(q.get("prompts") === "1");
  }
  ["policy", "error", "state", "rmin", "rmax"].forEach(function (k) {
    f[k].addEventListener("input", function () { apply(); save(); });
    f[k].addEventListener("change", function () { apply(); save(); });
  });
  $("#f-reset").addEventListener("click", function () {
    f.policy.value = ""; f.error.value = ""; f.state.value = ""; f.rmin.value = "";
    f.rmax.value = ""; apply(); save();
  });
  Array.prototype.forEach.call(document.querySelectorAll("input[name=colour]"), function (r) {
    r.addEventListener("change", function () { if (r.checked) colour(r.value); save(); });
  });
  $("#f-prompts").addEventListener("change", function () {
    prompts($("#f-prompts").checked); save();
  });
  var tip = $("#tip");
  document.addEventListener("mouseover", function (ev) {
    var t = ev.target;
    if (t && t.dataset && t.dataset.lp !== undefined) {
      var lp = parseFloat(t.dataset.lp);
      tip.textContent = "generated token: log-prob " + lp.toFixed(4) + ", p = " +
        Math.exp(lp).toFixed(4);
      tip.style.visibility = "visible";
    } else if (t && t.dataset && t.dataset.m === "0") {
      tip.textContent = t.className === "p" ? "prompt (loss mask 0)" :
        "environment / tool result (loss mask 0)";
      tip.style.visibility = "visible";
    } else {
      tip.style.visibility = "hidden";
    }
  });
  load();
  apply();
  document.body.dataset.js = "ready";
})();
"""


def _csp() -> str:
    digest = base64.b64encode(hashlib.sha256(SCRIPT.encode("utf-8")).digest()).decode()
    return (f"default-src 'none'; style-src 'unsafe-inline'; script-src 'sha256-{digest}'; "
            f"img-src 'none'; base-uri 'none'; form-action 'none'")


def _options(values: list[tuple[str, str]]) -> str:
    return "".join(f'<option value="{esc(v)}">{esc(label)}</option>' for v, label in values)


def render_page(run_dir: Path, db_path: Path, rollouts: Rollouts, caps: ViewerCaps,
                tokenizers: Tokenizers, live: bool = False,
                started: float | None = None) -> str:
    """The whole page (see the module docstring)."""
    samples = rollouts.samples
    model_ids = sorted({s.sample.model_id for s in samples} | set(rollouts.versions))
    detoks: dict[str, Detokenizer | None] = {}
    tok_lines = []
    for m in model_ids:
        detok, why = tokenizers.for_model(m)
        detoks[m] = detok
        tok_lines.append(f"{esc(m)}: " + (f"decoded with {esc(_shown(run_dir, detok.source))}"
                                          if detok is not None
                                          else f"token ids shown ({esc(why)})"))
    # sections: (model_id, version) newest first; groups: task_id, newest first
    sections: dict[tuple[str, int], dict[str, list[StoredSample]]] = {}
    for s in sorted(samples, key=lambda s: -s.row_id):
        sections.setdefault((s.sample.model_id, s.sample.min_version), {}) \
            .setdefault(s.sample.task_id, []).append(s)
    body = []
    for (model_id, version) in sorted(sections, key=lambda k: (k[0], -k[1])):
        groups = sections[(model_id, version)]
        n = sum(len(g) for g in groups.values())
        body.append(f'<section class="version" data-model="{esc(model_id)}" '
                    f'data-version="{version}" data-n="{n}"><h2>{esc(model_id)} &middot; '
                    f'version {version} <span class="vc">(<span class="vn">{n} samples</span>, '
                    f'{len(groups)} task groups)</span></h2>')
        for task_id, group in groups.items():
            group.sort(key=lambda s: (s.sample.sample_index, s.row_id))
            rewards = [g.sample.reward for g in group]
            mean = sum(rewards) / len(rewards)
            first = group[0].sample
            body.append(f'<details class="group" open data-n="{len(group)}"><summary>task '
                        f'<code>{esc(task_id)}</code> <span class="gc">&middot; '
                        f'<span class="gn">{len(group)}</span> samples &middot; reward mean '
                        f'{mean:.3f} &middot; group mean {first.group_mean:.3f}, std '
                        f'{first.group_std:.3f}</span></summary>')
            detok = detoks.get(model_id)
            body.extend(render_sample(s, detok, caps) for s in group)
            body.append('</details>')
        body.append('</section>')
    if not samples:
        body.append('<p>No samples to show (see the notes above).</p>')

    kinds = Counter(k for s in samples for k in error_kinds(
        s.sample.metadata if isinstance(s.sample.metadata, dict) else {}))
    known = [k for k in ERROR_KINDS] + [f"agent_{k}" for k in FAILURE_KINDS]
    error_opts = [("", "any"), ("*any", "with an error"), ("*none", "without errors")]
    error_opts += [(_attr_token(k), f"{k} ({kinds.get(k, 0)})")
                   for k in known + sorted(set(kinds) - set(known))]
    states = sorted({s.state for s in samples})
    policy_opts = [("", f"all ({len(model_ids)})")] + [(m, m) for m in model_ids]

    notes = list(rollouts.notes)
    shown_versions = ", ".join(
        f"{m}: {len(v)} of {rollouts.versions_seen.get(m, len(v))} versions"
        for m, v in sorted(rollouts.versions.items()))
    cap_line = (f"Looked at the newest {rollouts.scanned} of {rollouts.stored} stored samples; "
                f"shown: the last {caps.versions} versions of each policy"
                + (f" ({shown_versions})" if shown_versions else "")
                + f", at most {caps.samples} samples per version and policy, at most "
                  f"{caps.tokens} tokens of each sample (flags --viewer-versions, "
                  f"--viewer-samples, --viewer-tokens).")
    took = f" in {time.monotonic() - started:.2f} s" if started is not None else ""
    when = time.strftime("%Y-%m-%d %H:%M:%S")
    live_line = (" Served live: reload the page to see new samples." if live else "")
    page = [
        '<!doctype html><html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{_csp()}">',  # no quote in it
        '<meta name="referrer" content="no-referrer">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f'<title>rollouts: {esc(run_dir.resolve().name)}</title>',
        f'<style>{CSS}</style></head>',
        '<body class="mode-mask">',
        f'<header class="top"><h1>Rollouts of {esc(run_dir.resolve().name)}</h1>',
        f'<div class="src">{esc(str(run_dir))} &middot; dataflow DB '
        f'{esc(_shown(run_dir, str(db_path)))} &middot; generated {esc(when)}{took}'
        f'{esc(live_line)}</div>',
        '<div class="src">' + " &middot; ".join(tok_lines) + '</div></header>',
        '<div class="bar">',
        f'<label>policy <select id="f-policy">{_options(policy_opts)}</select></label>',
        '<label>reward &ge; <input id="f-rmin" type="number" step="any"></label>',
        '<label>reward &le; <input id="f-rmax" type="number" step="any"></label>',
        f'<label>tool error <select id="f-error">{_options(error_opts)}</select></label>',
        f'<label>state <select id="f-state">'
        f'{_options([("", "any")] + [(s, s) for s in states])}</select></label>',
        '<button id="f-reset" type="button">reset</button>',
        '<label><input id="f-prompts" type="checkbox"> show prompts</label>',
        '<span>colour by <label><input type="radio" name="colour" value="mask" checked> loss '
        'mask</label> <label><input type="radio" name="colour" value="lp"> log-prob</label>'
        '</span>',
        '<span class="legend"><span class="lm" style="background:#eceff1">prompt</span>'
        '<span class="lm" style="background:#d2f4d9">generated (trained)</span>'
        '<span class="lm" style="background:#ddf4ff">tool result / env</span>'
        '<span class="ll" style="background:#d2f4d9">p&ge;0.9</span>'
        '<span class="ll" style="background:#eef7c3">&ge;0.5</span>'
        '<span class="ll" style="background:#fff0b3">&ge;0.1</span>'
        '<span class="ll" style="background:#ffd8b5">&ge;0.01</span>'
        '<span class="ll" style="background:#ffb3b3">&lt;0.01</span></span>',
        f'<span id="shown-count">{len(samples)} samples (the filters need JavaScript)</span>',
        '</div>',
        '<div class="notes"><p>' + esc(cap_line) + '</p>'
        + "".join(f"<p>{esc(n)}</p>" for n in notes) + '</div>',
        '<main>', *body, '</main>',
        '<div id="tip"></div>',
        f'<script>{SCRIPT}</script>',
        '</body></html>\n',
    ]
    return "".join(page)


def _shown(run_dir: Path, path: str) -> str:
    try:
        return Path(path).resolve().relative_to(run_dir.resolve()).as_posix()
    except ValueError:
        return str(path)
