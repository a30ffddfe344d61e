"""The rollout viewer: a run's samples as one self-contained HTML page.

    astralight report RUN_DIR --viewer        # also writes RUN_DIR/report/viewer.html
    astralight report RUN_DIR --serve         # serves it on http://127.0.0.1:8765/ (live)

What it reads, read-only: the dataflow DB's ``samples`` table (through
:class:`~astralight.report.rundata.ReadOnlyStore`: ``mode=ro`` while the run writes its WAL, so
a live run's committed samples are seen; ``immutable`` otherwise), each sample's stored blob
decoded by :func:`astralight.protocol.decode` (msgpack with validated fields, never pickle), and
the tokenizer of each policy's model folder (:func:`model_folders`: the trainer and RaaS configs
under ``RUN_DIR/configs/``, else ``recipe.yaml``, else ``RUN_DIR/models/init``), to turn token ids
back into text. Without a tokenizer the page shows the token ids.

What it loads is capped (:class:`ViewerCaps`): the newest ``scan`` stored samples (by arrival)
are looked at, and of those the last ``versions`` policy versions of each policy (a sample's
version is its ``min_version``: the oldest version behind its generated tokens), at most
``samples`` samples per version and policy (newest task groups first) and at most ``tokens``
tokens of each sample (its head and tail, the middle elided). So a run of any size renders in
about the same time.

The page (:mod:`astralight.report.viewer_page`) groups samples per policy version and per task
group, colours tokens by loss mask or by behaviour log-prob, shows reward, advantage, the tool
calls and their results, and errors, and filters by reward, tool error kind, state and policy.
"""

from __future__ import annotations

import sqlite3
import sys
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

import yaml

from astralight.protocol import ProtocolError, Sample, decode
from astralight.report.rundata import ReadOnlyStore, RunFolderError, _db_path, check_run_dir

#: the page's file name in the report folder
VIEWER_FILE = "viewer.html"
#: defaults of the caps (flags --viewer-versions / --viewer-samples / --viewer-tokens)
DEFAULT_VERSIONS = 8
DEFAULT_SAMPLES = 16
DEFAULT_TOKENS = 2048
#: stored samples looked at: versions * samples * this (at least MIN_SCAN), newest first
SCAN_FACTOR = 40
MIN_SCAN = 2000
#: ``--serve``'s default port (0: any free one)
DEFAULT_PORT = 8765
#: files that make a folder worth handing to ``transformers.AutoTokenizer``
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                   "spiece.model")
#: blobs fetched per query (SQLite's bound-parameter limit is far above)
_FETCH_CHUNK = 500


@dataclass(frozen=True)
class ViewerCaps:
    """How much the viewer loads: see the module docstring."""

    versions: int = DEFAULT_VERSIONS
    samples: int = DEFAULT_SAMPLES
    tokens: int = DEFAULT_TOKENS

    def __post_init__(self) -> None:
        for name in ("versions", "samples", "tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--viewer-{name}: must be an int >= 1, got {value!r}")

    @property
    def scan(self) -> int:
        """Stored samples looked at, newest first."""
        return max(MIN_SCAN, self.versions * self.samples * SCAN_FACTOR)


@dataclass
class StoredSample:
    """One decoded sample of the DB with its row's id and state (queued, served, acked, ...)."""

    row_id: int
    state: str
    sample: Sample


@dataclass
class Rollouts:
    """What :func:`load_rollouts` read: the chosen samples and what was left out, and why."""

    samples: list[StoredSample] = field(default_factory=list)
    stored: int = 0  # samples in the DB
    scanned: int = 0  # of them looked at (the newest)
    versions: dict[str, list[int]] = field(default_factory=dict)  # shown, per policy, newest first
    versions_seen: dict[str, int] = field(default_factory=dict)  # in the scanned rows
    notes: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------- samples


def load_rollouts(db_path: str | Path, caps: ViewerCaps = ViewerCaps()) -> Rollouts:
    """The samples to show, from the dataflow DB at ``db_path`` (read-only, see the module
    docstring). A missing or unreadable DB is a note, not an error."""
    out = Rollouts()
    path = Path(db_path)
    if not path.is_file():
        out.notes.append(f"no dataflow DB at {path}: no samples to show (pass --db PATH when "
                         f"the dataflow's state_dir is elsewhere)")
        return out
    try:
        store = ReadOnlyStore(path)
    except sqlite3.Error as exc:
        out.notes.append(f"the dataflow DB {path} cannot be opened ({exc})")
        return out
    try:
        conn = store.conn
        conn.execute("BEGIN")  # one snapshot for every query below (a live run keeps writing)
        try:
            _choose_and_fetch(conn, caps, out)
        finally:
            conn.rollback()  # nothing was written: ends the read transaction
    except sqlite3.Error as exc:
        out.notes.append(f"the dataflow DB {path} has no readable samples table ({exc})")
    finally:
        store.close()
    return out


def _choose_and_fetch(conn: sqlite3.Connection, caps: ViewerCaps, out: Rollouts) -> None:
    out.stored = int(conn.execute("SELECT COUNT(*) FROM samples").fetchone()[0])
    # newest first, by rowid; no column after ``blob`` is read, so big blobs' overflow pages are
    # not (``created`` is stored after it)
    rows = conn.execute("SELECT id, task_id, model_id, min_version FROM samples "
                        "ORDER BY id DESC LIMIT ?", (caps.scan,)).fetchall()
    out.scanned = len(rows)
    # (model_id, version) -> {task_id: [row ids]}, newest group first
    buckets: dict[tuple[str, int], dict[str, list[int]]] = {}
    for r in rows:
        buckets.setdefault((r["model_id"], int(r["min_version"])), {}) \
            .setdefault(r["task_id"], []).append(int(r["id"]))
    per_model: dict[str, list[int]] = {}
    for model_id, version in buckets:
        per_model.setdefault(model_id, []).append(version)
    chosen: list[int] = []
    for model_id in sorted(per_model):
        versions = sorted(set(per_model[model_id]), reverse=True)
        out.versions_seen[model_id] = len(versions)
        out.versions[model_id] = versions[:caps.versions]
        for version in out.versions[model_id]:
            picked: list[int] = []
            for ids in buckets[(model_id, version)].values():  # whole groups, newest first
                if len(picked) >= caps.samples:
                    break
                picked.extend(sorted(ids)[:caps.samples - len(picked)])
            chosen.extend(picked)
    undecodable = []
    for i in range(0, len(chosen), _FETCH_CHUNK):
        part = chosen[i:i + _FETCH_CHUNK]
        marks = ",".join("?" * len(part))
        for r in conn.execute(f"SELECT id, state, blob FROM samples WHERE id IN ({marks})", part):
            try:
                sample = decode(bytes(r["blob"]))
            except ProtocolError as exc:
                undecodable.append(f"{r['id']} ({exc})")
                continue
            if not isinstance(sample, Sample):
                undecodable.append(f"{r['id']} (holds a {type(sample).__name__}, not a Sample)")
                continue
            out.samples.append(StoredSample(int(r["id"]), str(r["state"]), sample))
    if undecodable:
        out.notes.append(f"{len(undecodable)} stored samples do not decode and are left out: "
                         + "; ".join(undecodable[:3]) + (" ..." if len(undecodable) > 3 else ""))
    out.samples.sort(key=lambda s: (s.sample.model_id, -s.sample.min_version, -s.row_id))


# ----------------------------------------------------------------------------- tokenizers


class Detokenizer:
    """Token ids to text with a Hugging Face tokenizer (a ``tokenizers.Tokenizer`` loaded from
    ``tokenizer.json``, or a ``transformers`` tokenizer); special tokens are kept as text."""

    def __init__(self, tokenizer: Any, source: str):
        self.tokenizer = tokenizer
        self.source = source
        self._fast = hasattr(tokenizer, "decode_batch")  # tokenizers.Tokenizer

    def decode(self, ids: list[int]) -> str:
        if self._fast:
            return self.tokenizer.decode(ids, skip_special_tokens=False)
        return self.tokenizer.decode(ids, skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False)

    def decode_batch(self, seqs: list[list[int]]) -> list[str]:
        if self._fast:
            return list(self.tokenizer.decode_batch(seqs, skip_special_tokens=False))
        return list(self.tokenizer.batch_decode(seqs, skip_special_tokens=False,
                                                clean_up_tokenization_spaces=False))

    def pieces(self, ids: list[int]) -> list[str]:
        """One string per token whose concatenation is the decoded text. Tried in turn, the
        first that adds up to the decoded text wins: each token on its own (character and
        byte-level BPE vocabularies); each token after its left neighbour (decoders that drop a
        leading space at the start, as SentencePiece's); incrementally (a token that ends inside
        a multi-byte character shows as empty and the character goes to the token that
        completes it)."""
        if not ids:
            return []
        whole = self.decode(ids)
        alone = self.decode_batch([[i] for i in ids])
        if "".join(alone) == whole:
            return alone
        pairs = self.decode_batch([[a, b] for a, b in zip(ids, ids[1:])])
        paired = [alone[0]] + [p[len(a):] if p.startswith(a) else "\ufffd"
                               for a, p in zip(alone, pairs)]
        if "".join(paired) == whole and "\ufffd" not in whole:
            return paired
        out: list[str] = []
        prefix_at = read_at = 0
        before = ""
        for i in range(len(ids)):
            after = self.decode(ids[prefix_at:i + 1])
            if len(after) > len(before) and not after.endswith("\ufffd"):
                out.append(after[len(before):])
                prefix_at, read_at = read_at, i + 1
                before = self.decode(ids[prefix_at:read_at])
            else:
                out.append("")
        if read_at < len(ids):  # what never completed (a cut-off character): shown as decoded
            out[-1] += self.decode(ids[prefix_at:])[len(before):]
        return out


def load_detokenizer(folder: str | Path) -> tuple[Detokenizer | None, str]:
    """The tokenizer of a model folder, or ``(None, why not)``. ``tokenizer.json`` is read
    with the ``tokenizers`` library (fast); else ``transformers.AutoTokenizer`` (local files
    only, nothing downloaded, no remote code)."""
    folder = Path(folder)
    if not folder.is_dir():
        return None, f"{folder} is not a folder"
    try:
        if (folder / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            return Detokenizer(Tokenizer.from_file(str(folder / "tokenizer.json")),
                               str(folder / "tokenizer.json")), ""
        if not any((folder / name).is_file() for name in TOKENIZER_FILES):
            return None, f"no tokenizer files in {folder} (looked for {', '.join(TOKENIZER_FILES)})"
        from transformers import AutoTokenizer

        return Detokenizer(AutoTokenizer.from_pretrained(str(folder), local_files_only=True),
                           str(folder)), ""
    except Exception as exc:  # noqa: BLE001 - any tokenizer failure: show token ids instead
        return None, f"no tokenizer loads from {folder} ({type(exc).__name__}: {exc})"


def _relocated(path: str, run_dir: Path) -> Path:
    """``path`` as written in a config; when it no longer exists (the run folder was moved or
    copied) and it pointed into a run's ``models/`` folder, the same place in ``run_dir``."""
    p = Path(path)
    if p.exists():
        return p
    parts = p.parts
    if "models" in parts:
        at = len(parts) - 1 - parts[::-1].index("models")
        moved = run_dir.joinpath("models", *parts[at + 1:])
        if moved.exists():
            return moved
    return p


def _yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None


def _fill(value: Any, run_dir: Path) -> str | None:
    """A recipe's ``model_path`` with its placeholders filled as the launcher fills them."""
    if not isinstance(value, str) or not value:
        return None
    value = value.replace("{init_model}", str(run_dir / "models" / "init"))
    value = value.replace("{run_dir}", str(run_dir))
    return None if "{" in value else value


def model_folders(run_dir: str | Path) -> dict[str, tuple[Path, str]]:
    """``{model_id: (model folder, where it was named)}`` from the run folder: each trainer
    config ``configs/trainer-<model_id>.yaml`` (``model.init_args.model_path``), each RaaS
    config ``configs/raas-*.yaml`` (``engines.<model_id>.model_path``), then ``recipe.yaml``'s
    trainers and RaaS (``{init_model}`` is ``RUN_DIR/models/init``). A path that moved with the
    run folder is looked for under ``RUN_DIR/models/``."""
    run_dir = Path(run_dir)
    found: dict[str, tuple[Path, str]] = {}

    def add(model_id: Any, path: Any, where: str) -> None:
        if isinstance(model_id, str) and model_id and isinstance(path, str) and path \
                and model_id not in found:
            found[model_id] = (_relocated(path, run_dir), where)

    configs = run_dir / "configs"
    for cfg_path in sorted(configs.glob("trainer-*.yaml")):
        cfg = _yaml(cfg_path)
        args = ((cfg or {}).get("model") or {}).get("init_args") if isinstance(cfg, dict) else None
        if isinstance(args, dict):
            model_id = args.get("model_id") or cfg_path.stem[len("trainer-"):]
            add(model_id, args.get("model_path"), f"configs/{cfg_path.name}")
    for cfg_path in sorted(configs.glob("raas-*.yaml")):
        cfg = _yaml(cfg_path)
        engines = cfg.get("engines") if isinstance(cfg, dict) else None
        for model_id, engine in (engines.items() if isinstance(engines, dict) else ()):
            if isinstance(engine, dict):
                add(model_id, engine.get("model_path"), f"configs/{cfg_path.name}")
    recipe = _yaml(run_dir / "recipe.yaml")
    if isinstance(recipe, dict):
        for trainer in recipe.get("trainers") or []:
            cfg = (trainer.get("config") or trainer) if isinstance(trainer, dict) else {}
            args = ((cfg.get("model") or {}).get("init_args")) if isinstance(cfg, dict) else None
            if isinstance(args, dict):
                add(args.get("model_id"), _fill(args.get("model_path"), run_dir), "recipe.yaml")
        for raas in recipe.get("raas") or []:
            engines = raas.get("engines") if isinstance(raas, dict) else None
            for model_id, engine in (engines.items() if isinstance(engines, dict) else ()):
                if isinstance(engine, dict):
                    add(model_id, _fill(engine.get("model_path"), run_dir), "recipe.yaml")
    return found


class Tokenizers:
    """The detokenizer of each policy, loaded once (a served viewer keeps it across reloads).

    ``override``: one model folder for every policy (``--tokenizer DIR``)."""

    def __init__(self, run_dir: str | Path, override: str | Path | None = None):
        self.run_dir = Path(run_dir)
        self.override = Path(override) if override is not None else None
        self._by_folder: dict[Path, tuple[Detokenizer | None, str]] = {}
        self._by_model: dict[str, tuple[Detokenizer | None, str]] = {}
        self._folders: dict[str, tuple[Path, str]] | None = None

    def _load(self, folder: Path) -> tuple[Detokenizer | None, str]:
        if folder not in self._by_folder:
            self._by_folder[folder] = load_detokenizer(folder)
        return self._by_folder[folder]

    def for_model(self, model_id: str) -> tuple[Detokenizer | None, str]:
        """``(detokenizer, "")`` or ``(None, why there is none)``."""
        if model_id in self._by_model:
            return self._by_model[model_id]
        if self.override is not None:
            found = self._load(self.override)
        else:
            if self._folders is None:
                self._folders = model_folders(self.run_dir)
            folders = self._folders
            default = self.run_dir / "models" / "init"
            if model_id in folders:
                folder, where = folders[model_id]
                tok, why = self._load(folder)
                found = (tok, why and f"{why}; the folder is named by {where}")
            elif default.is_dir():
                found = self._load(default)
            else:
                found = (None, f"no model folder named for {model_id!r} in RUN_DIR/configs/ or "
                               f"recipe.yaml, and no RUN_DIR/models/init (pass --tokenizer DIR)")
        self._by_model[model_id] = found
        return found


# ----------------------------------------------------------------------------- the page


def viewer_html(run_dir: str | Path, db: str | Path | None = None,
                caps: ViewerCaps = ViewerCaps(), tokenizers: Tokenizers | None = None,
                live: bool = False) -> str:
    """The viewer page of ``run_dir`` as HTML text (nothing is written)."""
    from astralight.report.viewer_page import render_page

    run_dir = Path(run_dir)
    started = time.monotonic()
    db_path = Path(db) if db is not None else _db_path(run_dir)
    rollouts = load_rollouts(db_path, caps)
    tokenizers = tokenizers or Tokenizers(run_dir)
    return render_page(run_dir, db_path, rollouts, caps, tokenizers, live=live,
                       started=started)


def write_viewer(run_dir: str | Path, out_dir: str | Path | None = None,
                 db: str | Path | None = None, caps: ViewerCaps = ViewerCaps(),
                 tokenizer: str | Path | None = None) -> Path:
    """Write ``viewer.html`` into ``out_dir`` (default ``run_dir/report``); returns its path.
    Raises :class:`RunFolderError` for a non-run folder (or a missing ``db``)."""
    run_dir = Path(run_dir)
    check_run_dir(run_dir, Path(db) if db is not None else None)
    out = Path(out_dir) if out_dir is not None else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    page = viewer_html(run_dir, db, caps, Tokenizers(run_dir, tokenizer))
    path = out / VIEWER_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(page, encoding="utf-8", errors="replace")
    tmp.replace(path)
    return path


# ----------------------------------------------------------------------------- --serve


class ViewerServer(ThreadingHTTPServer):
    """Serves the viewer page of one run folder on 127.0.0.1, regenerated on every load."""

    daemon_threads = True

    def __init__(self, run_dir: Path, port: int, db: Path | None, caps: ViewerCaps,
                 tokenizers: Tokenizers, log: Callable[[str], None] | None = None):
        self.run_dir, self.db, self.caps, self.tokenizers = run_dir, db, caps, tokenizers
        self.log = log
        super().__init__(("127.0.0.1", port), _Handler)

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"


class _Handler(BaseHTTPRequestHandler):
    server: ViewerServer
    server_version = "astralight-viewer"

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self._answer(body=True)

    def do_HEAD(self) -> None:  # noqa: N802
        self._answer(body=False)

    def _answer(self, body: bool) -> None:
        path = urlsplit(self.path).path
        host = (self.headers.get("Host") or "").strip().lower()
        allowed = {f"127.0.0.1:{self.server.port}", f"localhost:{self.server.port}"}
        if host and host not in allowed:  # a DNS-rebinding page must not read the samples
            return self._send(HTTPStatus.MISDIRECTED_REQUEST, "text/plain",
                              b"the viewer answers only to 127.0.0.1 / localhost\n", body)
        if path not in ("/", f"/{VIEWER_FILE}", "/index.html"):
            return self._send(HTTPStatus.NOT_FOUND, "text/plain", b"not found: try /\n", body)
        try:
            page = viewer_html(self.server.run_dir, self.server.db, self.server.caps,
                               self.server.tokenizers, live=True)
        except Exception as exc:  # noqa: BLE001 - shown, and the server keeps serving
            import html

            text = f"<!doctype html><pre>viewer failed: {html.escape(repr(exc))}</pre>"
            return self._send(HTTPStatus.INTERNAL_SERVER_ERROR, "text/html; charset=utf-8",
                              text.encode(), body)
        self._send(HTTPStatus.OK, "text/html; charset=utf-8",
                   page.encode("utf-8", errors="replace"), body)

    def _send(self, status: HTTPStatus, ctype: str, data: bytes, body: bool) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")
        self.end_headers()
        if body:
            self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's name
        if self.server.log is not None:
            self.server.log(f"[viewer] {self.address_string()} {format % args}")


def make_server(run_dir: str | Path, port: int = DEFAULT_PORT, db: str | Path | None = None,
                caps: ViewerCaps = ViewerCaps(), tokenizer: str | Path | None = None,
                log: Callable[[str], None] | None = None) -> ViewerServer:
    """A :class:`ViewerServer` bound to ``127.0.0.1:port`` (0: a free port; see ``.url``), not
    yet serving: call ``serve_forever()`` (and ``shutdown()`` from another thread). Raises
    :class:`RunFolderError` for a non-run folder and ``OSError`` when the port is taken."""
    run_dir = Path(run_dir)
    check_run_dir(run_dir, Path(db) if db is not None else None)
    if not 0 <= port <= 65535:
        raise ValueError(f"--port: must be in [0, 65535], got {port}")
    return ViewerServer(run_dir, port, Path(db) if db is not None else None, caps,
                        Tokenizers(run_dir, tokenizer), log)


def serve(run_dir: str | Path, port: int = DEFAULT_PORT, db: str | Path | None = None,
          caps: ViewerCaps = ViewerCaps(), tokenizer: str | Path | None = None) -> int:
    """``astralight report RUN_DIR --serve``: serve until Ctrl-C; returns the exit status."""
    try:
        server = make_server(run_dir, port, db, caps, tokenizer,
                             log=lambda line: print(line, file=sys.stderr, flush=True))
    except RunFolderError as exc:
        print(f"astralight report: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"astralight report: --port {port}: cannot listen on 127.0.0.1:{port} ({exc}); "
              f"pick another port, or --port 0 for any free one", file=sys.stderr)
        return 2
    print(f"rollout viewer of {run_dir} at {server.url} (regenerated on each load; Ctrl-C "
          f"stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0

