"""Who may call which route of the dataflow service: scoped bearer tokens, instance secrets and
the browser guards.

**Scopes.** A token grants one scope, and each process holds the token of its own:

* ``rollout`` (a RaaS): register, heartbeat, lease, push / push_many, return, deregister, drain
  itself; read versions, manifests and weight files.
* ``trainer``: pull, ack, extend, ``trainer/resumed``, upload weight files and publish for its own
  ``model_id``; read stats, the eval results, balance report and counters of its ``model_id``,
  versions, manifests and weight files.
* ``admin`` (the launcher, the autoscaler, an operator): everything (drain any instance, read
  stats, run the autoscaler, act as any instance without its secret).

The service reads one token per scope from its environment: ``ASTRALIGHT_ROLLOUT_TOKEN``,
``ASTRALIGHT_TRAINER_TOKEN``, ``ASTRALIGHT_ADMIN_TOKEN``, or from the file that
``ASTRALIGHT_ROLLOUT_TOKEN_FILE`` (..._TRAINER_..., ..._ADMIN_...) names (one line; the variable
wins when both are set). ``ASTRALIGHT_TOKEN`` (or ``ASTRALIGHT_TOKEN_FILE``) is the single-token
mode: it grants every scope, alone or next to scoped tokens. With none of them set the
service has no auth (loopback only, see :func:`astralight.dataflow.service.check_bind`).

A client presents ``ASTRALIGHT_TOKEN`` (or ``ASTRALIGHT_TOKEN_FILE``): set it, in each process,
to the token of that process's scope. ``astralight run`` does this itself
(:func:`handoff_env`): each RaaS gets the rollout token, each trainer a trainer token bound to its
``model_id``, the autoscaler the admin token (and hands its RaaS the rollout token), the
launcher's own progress view uses the admin token.

**A trainer's model_id.** ``ASTRALIGHT_TRAINER_TOKEN`` itself is a trainer token for every
``model_id``. The token bound to one ``model_id`` is derived from it
(:func:`trainer_token`: an HMAC of the model_id), so one variable configures every policy and a
trainer holding the token of ``solver`` cannot pull, ack or publish ``verifier``'s batches or
weights. Print one with ``python -m astralight.dataflow.auth trainer-token MODEL_ID`` (reads
``ASTRALIGHT_TRAINER_TOKEN``).

**Instance secrets.** ``POST /v1/register`` answers an ``instance_secret``; heartbeat, lease,
push, push_many, return, deregister and drain of that instance then need it in the
``X-Astralight-Instance-Secret`` header, and a push of a task that another instance holds
(leased or returned by it) is refused with 409 (a late push after the lease expired and went to
another instance gets the same answer, and the RaaS drops it).
:class:`~astralight.dataflow.client.DataflowClient` stores the secret (per dataflow URL and
instance, shared by every client of the process, so the RaaS's heartbeat, push and goodbye
threads all send it) and sends it by itself. Registering a known instance again needs its
secret while the instance is live (not ``left``, heard from within ``lease_seconds``); after
that anyone holding the rollout scope may take the id over, which issues a new secret. The
secrets are kept as SHA-256 digests in the service state (SQLite ``meta``), so they survive a
restart of the service. The admin scope (hence the single-token mode and the no-token mode)
acts as any instance without a secret: in those modes no instance needs one.

**Browser guards** (:class:`AccessGuard`), every mode: a request carrying ``Origin`` is refused
(403); a request with a body must be ``Content-Type: application/msgpack`` (a weight upload
``application/octet-stream``), else 415 -- a page cannot send either without a CORS preflight,
which the service never answers. Without any token, a request whose ``Host`` is not a loopback
name (``localhost``, ``127.0.0.1``, ``[::1]``), the configured ``host``, or (for a wildcard bind
such as ``0.0.0.0``) an IP address is refused too (403: DNS rebinding).
"""

from __future__ import annotations

import base64
import contextvars
import hashlib
import hmac
import ipaddress
import json
import os
import secrets
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from starlette.routing import compile_path

ROLLOUT, TRAINER, ADMIN = "rollout", "trainer", "admin"
SCOPES = (ROLLOUT, TRAINER, ADMIN)
#: the single-token mode: grants every scope (and is what every client presents)
TOKEN_VAR = "ASTRALIGHT_TOKEN"
SCOPE_VARS = {ROLLOUT: "ASTRALIGHT_ROLLOUT_TOKEN", TRAINER: "ASTRALIGHT_TRAINER_TOKEN",
              ADMIN: "ASTRALIGHT_ADMIN_TOKEN"}
FILE_SUFFIX = "_FILE"
INSTANCE_SECRET_HEADER = "X-Astralight-Instance-Secret"
#: a token on a public (non-loopback) bind must be at least this long
MIN_PUBLIC_TOKEN_BYTES = 16
#: the Content-Type a request body must declare (weight uploads: PUT)
BODY_TYPES = ("application/msgpack", "application/x-msgpack")
UPLOAD_TYPES = ("application/octet-stream", "application/msgpack")
GENERATE_HINT = "python -c 'import secrets; print(secrets.token_urlsafe(32))'"


# ----------------------------------------------------------------------------- tokens


def check_token(value: str, name: str) -> str:
    """A token as given in ``name``: 1+ visible ASCII characters, no spaces (ValueError naming
    ``name`` otherwise: an empty or blank token would silently mean no auth, or one nobody can
    send in a header)."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{name}: the token is empty or whitespace; unset {name} to run without "
                         f"it, or set it to 16+ random characters ({GENERATE_HINT})")
    if not all("!" <= ch <= "~" for ch in value):
        raise ValueError(f"{name}: the token must be visible ASCII characters without spaces "
                         f"(it travels in the Authorization header); e.g. {GENERATE_HINT}")
    return value


def read_env_token(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """The token in variable ``name``, else in the file ``name``_FILE names (its text, one line;
    surrounding whitespace stripped); None when neither is set. A set but blank value, an
    unreadable file or a malformed token is a ValueError naming the variable."""
    env = os.environ if env is None else env
    if name in env:
        return check_token(env[name], name)
    path = env.get(name + FILE_SUFFIX)
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{name}{FILE_SUFFIX}: cannot read the token file {path!r}: "
                         f"{exc}") from None
    return check_token(text, f"{name}{FILE_SUFFIX} ({path})")


def client_token(env: Mapping[str, str] | None = None) -> str:
    """What a client presents by default: ``ASTRALIGHT_TOKEN`` (else ``ASTRALIGHT_TOKEN_FILE``);
    empty when neither is set (an empty ``ASTRALIGHT_TOKEN`` also means none, as it always did)."""
    env = os.environ if env is None else env
    if env.get(TOKEN_VAR) == "":
        return ""
    return read_env_token(TOKEN_VAR, env) or ""


def trainer_token(trainer_key: str, model_id: str) -> str:
    """The trainer token bound to ``model_id``, derived from ``ASTRALIGHT_TRAINER_TOKEN``'s value
    (HMAC-SHA256 of the model_id, url-safe base64): the service accepts it for that model_id
    only."""
    mac = hmac.new(trainer_key.encode(), b"astralight-trainer-token\0" + model_id.encode(),
                   hashlib.sha256).digest()
    return "trainer." + base64.urlsafe_b64encode(mac).decode().rstrip("=")


def scoped_tokens(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``{scope: token}`` of the scoped variables that are set (variable or ``_FILE``)."""
    out = {}
    for scope, var in SCOPE_VARS.items():
        value = read_env_token(var, env)
        if value is not None:
            out[scope] = value
    return out


# ----------------------------------------------------------------------------- principals


@dataclass(frozen=True)
class Principal:
    """Who a request is: its ``scope``; a trainer's ``model_id`` (None: every model_id); and
    ``source``, the variable its token came from (for messages)."""

    scope: str
    model_id: str | None = None
    source: str = ""

    @property
    def admin(self) -> bool:
        return self.scope == ADMIN

    def describe(self) -> str:
        bound = f" bound to model_id {self.model_id!r}" if self.model_id is not None else ""
        return f"the {self.scope} scope{bound} ({self.source})" if self.source else \
            f"the {self.scope} scope{bound}"


#: the caller when the service has no token at all: everything is open
OPEN = Principal(ADMIN, source="no token configured")


class Credentials:
    """The tokens a service accepts: ``{variable name: (token, Principal)}``.

    Build it with :meth:`from_env` (the service), :meth:`single` (one token, every scope) or
    :meth:`none`. :meth:`lookup` compares the Authorization header against every token in
    constant time over SHA-256 digests (neither which token matched nor a length leaks).
    """

    def __init__(self, tokens: dict[str, tuple[str, Principal]]):
        seen: dict[str, tuple[str, Principal]] = {}
        for name, (token, principal) in tokens.items():
            check_token(token, name)
            if token in seen:
                first, other = seen[token]
                if (other.scope, other.model_id) != (principal.scope, principal.model_id):
                    raise ValueError(f"{name}: holds the same token as {first}; give each scope a "
                                     f"token of its own ({GENERATE_HINT})")
                continue  # the same grant twice (ASTRALIGHT_TOKEN = ASTRALIGHT_ADMIN_TOKEN)
            seen[token] = (name, principal)
        self.tokens = {name: token for name, (token, _) in tokens.items()}
        self._digests = [(hashlib.sha256(f"Bearer {token}".encode()).digest(), principal)
                         for token, (_, principal) in seen.items()]

    @classmethod
    def none(cls) -> "Credentials":
        return cls({})

    @classmethod
    def single(cls, token: str, name: str = TOKEN_VAR) -> "Credentials":
        return cls({name: (check_token(token, name), Principal(ADMIN, source=name))})

    @classmethod
    def from_env(cls, model_ids: Iterable[str] = (),
                 env: Mapping[str, str] | None = None) -> "Credentials":
        """``ASTRALIGHT_TOKEN`` (every scope), the three scoped variables (or their ``_FILE``),
        and a derived trainer token per ``model_id`` (:func:`trainer_token`)."""
        out: dict[str, tuple[str, Principal]] = {}
        single = read_env_token(TOKEN_VAR, env)
        if single is not None:
            out[TOKEN_VAR] = (single, Principal(ADMIN, source=TOKEN_VAR))
        for scope, token in scoped_tokens(env).items():
            var = SCOPE_VARS[scope]
            out[var] = (token, Principal(scope, source=var))
            if scope == TRAINER:
                for m in model_ids:
                    name = f"trainer token of {m!r} (derived from {var})"
                    out[name] = (trainer_token(token, m), Principal(TRAINER, m, var))
        return cls(out)

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    @property
    def scoped(self) -> bool:
        return any(p.scope != ADMIN for _, p in self._digests)

    def lookup(self, authorization: bytes | None) -> Principal | None:
        got = hashlib.sha256(authorization or b"").digest()
        found = None
        for digest, principal in self._digests:  # every one, whichever matches
            if hmac.compare_digest(got, digest):
                found = principal
        return found


# ----------------------------------------------------------------------------- routes


@dataclass(frozen=True)
class Rule:
    """Who may call a route besides ``admin``: ``scopes``; ``binds``: what the handler checks
    for a non-admin caller: ``"model"`` (a trainer token bound to another model_id is refused),
    ``"instance"`` (the instance secret), or None."""

    scopes: frozenset[str]
    binds: str | None = None


def _rule(*scopes: str, binds: str | None = None) -> Rule:
    return Rule(frozenset(scopes), binds)


ANY = (ROLLOUT, TRAINER)
#: every route of the app and who may call it (admin: all). A route missing here is refused to
#: every scope but admin, and tests/unit/test_scopes.py fails until it gets a line.
ROUTES: dict[tuple[str, str], Rule] = {
    ("GET", "/v1/info"): _rule(*ANY),
    ("GET", "/v1/stats"): _rule(TRAINER),
    ("GET", "/v1/eval/{model_id}"): _rule(TRAINER, binds="model"),
    ("GET", "/v1/eval/{model_id}/{version}/completions"): _rule(TRAINER, binds="model"),
    ("POST", "/v1/eval"): _rule(TRAINER, binds="model"),
    ("GET", "/v1/balance/{model_id}"): _rule(TRAINER, binds="model"),
    ("GET", "/v1/counters/{model_id}"): _rule(TRAINER, binds="model"),
    ("POST", "/v1/register"): _rule(ROLLOUT, binds="instance"),
    ("POST", "/v1/heartbeat"): _rule(ROLLOUT, binds="instance"),
    ("POST", "/v1/instances/{instance_id}/drain"): _rule(ROLLOUT, binds="instance"),
    ("POST", "/v1/return"): _rule(ROLLOUT, binds="instance"),
    ("POST", "/v1/deregister"): _rule(ROLLOUT, binds="instance"),
    ("POST", "/v1/lease"): _rule(ROLLOUT, binds="instance"),
    ("POST", "/v1/push"): _rule(ROLLOUT, binds="instance"),
    ("POST", "/v1/push_many"): _rule(ROLLOUT, binds="instance"),
    ("POST", "/v1/pull"): _rule(TRAINER, binds="model"),
    ("POST", "/v1/ack"): _rule(TRAINER, binds="model"),
    ("POST", "/v1/trainer/resumed"): _rule(TRAINER, binds="model"),
    ("POST", "/v1/batches/extend"): _rule(TRAINER, binds="model"),
    ("GET", "/v1/version/{model_id}"): _rule(*ANY),
    ("PUT", "/v1/weights/{model_id}/{version}/{name}"): _rule(TRAINER, binds="model"),
    ("GET", "/v1/weights/{model_id}/{version}/{name}"): _rule(*ANY),
    ("POST", "/v1/publish"): _rule(TRAINER, binds="model"),
    ("GET", "/v1/manifest/{model_id}/latest"): _rule(*ANY),
    ("GET", "/v1/manifest/{model_id}/{version}"): _rule(*ANY),
}
_COMPILED = [(method, compile_path(path)[0], path, rule) for (method, path), rule in ROUTES.items()]


def route_rule(method: str, path: str) -> tuple[str, Rule] | None:
    """``(path template, Rule)`` of the route ``method path`` would reach, or None."""
    for m, regex, template, rule in _COMPILED:
        if m == method and regex.match(path):
            return template, rule
    return None


def scopes_of(rule: Rule | None) -> str:
    names = sorted(rule.scopes) + [ADMIN] if rule is not None else [ADMIN]
    return " or ".join(names)


# ----------------------------------------------------------------------------- per request


@dataclass(frozen=True)
class Access:
    """What :class:`AccessGuard` learned about the current request, for the handlers."""

    principal: Principal
    instance_secret: str | None = None


_ACCESS: contextvars.ContextVar[Access | None] = contextvars.ContextVar("astralight_access",
                                                                         default=None)


def current() -> Access:
    """The current request's :class:`Access` (open admin outside a guarded request)."""
    return _ACCESS.get() or Access(OPEN)


# ----------------------------------------------------------------------------- hosts


def _bare_host(host: str) -> str:
    """``Host`` header value without its port, brackets and trailing dot, lower case."""
    host = host.strip().lower()
    if host.startswith("["):
        host = host[1:].split("]", 1)[0]
    elif host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".")


def _ip(host: str):
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def host_allowed(host_header: str, configured: str) -> bool:
    """Whether a ``Host`` may reach a service without a token bound to ``configured``: a
    loopback name or address, the configured host itself, or -- for a wildcard bind
    (``0.0.0.0``, ``::``) -- any IP address (DNS rebinding needs a name)."""
    host = _bare_host(host_header)
    ip = _ip(host)
    if host == "localhost" or (ip is not None and ip.is_loopback):
        return True
    conf = _bare_host(configured) if configured else ""
    if host == conf:
        return True
    conf_ip = _ip(conf) if conf else None
    wildcard = conf == "" or (conf_ip is not None and conf_ip.is_unspecified)
    return wildcard and ip is not None


# ----------------------------------------------------------------------------- the middleware


def _header(scope, name: bytes) -> list[bytes]:
    return [v for k, v in scope["headers"] if k == name]


class AccessGuard:
    """ASGI middleware around the whole app: browser guards, the bearer token, the route's scope.

    In order: ``Origin`` present -> 403; no token configured and a ``Host`` that is not allowed
    (:func:`host_allowed`) -> 403; a token configured and no matching ``Authorization: Bearer``
    -> 401; a scope the route (:data:`ROUTES`) does not grant -> 403; a body (or a declared
    content type) other than msgpack (weight uploads: octet-stream) -> 415. Unknown paths are
    refused to every scope but admin (then 404). Websockets are closed (no such routes).
    Every refusal is JSON ``{"error", "field"}`` naming the header and the fix.
    """

    def __init__(self, app, credentials: Credentials, host: str = "127.0.0.1",
                 on_refuse: Callable[[str], None] | None = None):
        self.app = app
        self.credentials = credentials
        self.host = host
        self.on_refuse = on_refuse  # told the refused field (the app's per-client counters)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refused = self.check(scope)
        if isinstance(refused, tuple):
            if self.on_refuse is not None:
                self.on_refuse(refused[1])
            await _refuse(send, *refused)
            return
        token = _ACCESS.set(refused)
        try:
            await self.app(scope, receive, send)
        finally:
            _ACCESS.reset(token)

    def check(self, scope) -> Access | tuple[int, str, str]:
        """The request's :class:`Access`, or ``(status, field, message)`` refusing it."""
        method, path = scope.get("method", ""), scope.get("path", "")
        if _header(scope, b"origin"):
            return (403, "origin", "origin: requests from a web page (with an Origin header) are "
                                   "refused; call the dataflow from a process "
                                   "(astralight.dataflow.client), not a browser")
        creds = self.credentials
        if not creds.enabled:
            hosts = _header(scope, b"host")
            if hosts and not host_allowed(hosts[0].decode("latin-1"), self.host):
                return (403, "host", (
                    f"host: {hosts[0].decode('latin-1')[:100]!r} is not a loopback name "
                    f"(localhost, 127.0.0.1, [::1]) nor the configured host {self.host!r}; without "
                    f"a token the service answers only those (DNS rebinding guard). Connect via "
                    f"127.0.0.1, or set {TOKEN_VAR} (or scoped tokens) on the service"))
            principal = OPEN
        else:
            values = _header(scope, b"authorization")
            principal = creds.lookup(values[0] if len(values) == 1 else None)
            if principal is None:
                hint = (f"set {TOKEN_VAR} in this process to the token of its scope (rollout, "
                        f"trainer or admin)" if creds.scoped else
                        f"set {TOKEN_VAR} on both sides")
                return (401, "authorization", f"authorization: missing or wrong bearer token "
                                              f"({hint})")
        found = route_rule(method, path)
        if not principal.admin:
            rule = found[1] if found else None
            if rule is None or principal.scope not in rule.scopes:
                where = f"{method} {found[0] if found else path[:200]}"
                return (403, "authorization", (
                    f"authorization: {where} needs the {scopes_of(rule)} scope; this token has "
                    f"{principal.describe()}. Give this process the token of a scope that may "
                    f"call it (ASTRALIGHT_TOKEN)"))
        bad_type = _content_type_problem(scope, method)
        if bad_type:
            return (415, "content-type", bad_type)
        secrets_ = _header(scope, INSTANCE_SECRET_HEADER.lower().encode())
        secret = secrets_[0].decode("latin-1") if len(secrets_) == 1 else None
        return Access(principal, secret)


def _content_type_problem(scope, method: str) -> str | None:
    types = _header(scope, b"content-type")
    lengths = _header(scope, b"content-length")
    has_body = bool(_header(scope, b"transfer-encoding")) or any(
        v.strip() not in (b"", b"0") for v in lengths)
    if not has_body and not (types and method not in ("GET", "HEAD")):
        return None
    allowed = UPLOAD_TYPES if method == "PUT" else BODY_TYPES
    got = types[0].decode("latin-1").split(";", 1)[0].strip().lower() if len(types) == 1 else None
    if got in allowed:
        return None
    what = "a weight upload" if method == "PUT" else "a request body"
    return (f"content-type: {what} must be sent as Content-Type: {allowed[0]} (got "
            f"{'none' if got is None else repr(got[:80])}); the dataflow takes no text, form or "
            f"multipart bodies (astralight.dataflow.client sends the right type)")


async def _refuse(send, status: int, field: str, message: str) -> None:
    body = json.dumps({"error": message, "field": field}).encode()
    headers = [(b"content-type", b"application/json")]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# ----------------------------------------------------------------------------- instance secrets


class InstanceSecrets:
    """Per-instance secrets: SHA-256 digests in the store's ``meta`` table (key
    ``instance_secret:<id>``), cached in memory; only this object writes them. ``store`` and
    ``lock`` are the core's (every read and write of the store holds the lock)."""

    PREFIX = "instance_secret:"

    def __init__(self, store: Any, lock: Any):
        self.store, self.lock = store, lock
        self._cache: dict[str, str] = {}
        self._cache_lock = threading.Lock()

    @staticmethod
    def _digest(secret: str) -> str:
        return hashlib.sha256(secret.encode()).hexdigest()

    def digest(self, instance_id: str) -> str | None:
        with self._cache_lock:
            cached = self._cache.get(instance_id)
        if cached is not None:
            return cached
        with self.lock:
            value = self.store.get_meta(self.PREFIX + instance_id)
        if isinstance(value, str):
            with self._cache_lock:
                self._cache[instance_id] = value
            return value
        return None

    def matches(self, instance_id: str, secret: str | None) -> bool | None:
        """True / False: the instance holds a secret and ``secret`` is it / is not; None: the
        instance holds none (unknown, or its registration stored no secret)."""
        stored = self.digest(instance_id)
        if stored is None:
            return None
        got = self._digest(secret) if secret else ""
        return hmac.compare_digest(got.encode(), stored.encode())

    def issue(self, instance_id: str) -> str:
        """A new secret for ``instance_id`` (durable once the core's lock is released)."""
        secret = secrets.token_urlsafe(32)
        digest = self._digest(secret)
        with self.lock, self.store.tx():
            self.store.set_meta(self.PREFIX + instance_id, digest)
        with self._cache_lock:
            self._cache[instance_id] = digest
        return secret


# ----------------------------------------------------------------------------- hand-off


#: a launcher component's kind -> the scope of its token
KIND_SCOPES = {"raas": ROLLOUT, "trainer": TRAINER, "autoscale": ADMIN}


def handoff_env(env: Mapping[str, str], scope: str | None,
                model_id: str | None = None) -> dict[str, str]:
    """The environment for a child process of ``scope`` when scoped tokens are set: its
    ``ASTRALIGHT_TOKEN`` is the token of its scope (a trainer's bound to ``model_id``), and the
    other scopes' tokens are removed. The autoscaler (admin) keeps the rollout token for the RaaS
    it starts. ``scope`` None (the dataflow itself) or no scoped token set: ``env`` unchanged.
    A scope with no token of its own keeps an inherited ``ASTRALIGHT_TOKEN`` (every scope);
    with neither it is a ValueError naming the variable to set."""
    env = dict(env)
    tokens = scoped_tokens(env)
    if scope is None or not tokens:
        return env
    token = tokens.get(scope)
    if token is not None and scope == TRAINER and model_id is not None:
        token = trainer_token(token, model_id)
    keep = {ROLLOUT} if scope == ADMIN else set()
    for s, var in SCOPE_VARS.items():
        if s not in keep:
            env.pop(var, None)
            env.pop(var + FILE_SUFFIX, None)
    if token is not None:
        env[TOKEN_VAR] = token
        env.pop(TOKEN_VAR + FILE_SUFFIX, None)
    elif read_env_token(TOKEN_VAR, env) is None:
        raise ValueError(f"{SCOPE_VARS[scope]}: scoped tokens are set but not this one, so a "
                         f"{scope} process would get no token; set {SCOPE_VARS[scope]} (or "
                         f"{TOKEN_VAR}, which grants every scope)")
    return env


def admin_token(env: Mapping[str, str] | None = None) -> str:
    """The token for admin calls from this process (the launcher's progress view): the admin
    token when set, else what a client presents (:func:`client_token`)."""
    return scoped_tokens(env).get(ADMIN) or client_token(env)


def main(argv: list[str] | None = None) -> int:
    """``python -m astralight.dataflow.auth trainer-token MODEL_ID``: print the trainer token
    bound to MODEL_ID (from ``ASTRALIGHT_TRAINER_TOKEN`` or its ``_FILE``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 2 or argv[0] != "trainer-token":
        print("usage: python -m astralight.dataflow.auth trainer-token MODEL_ID", file=sys.stderr)
        return 2
    try:
        key = read_env_token(SCOPE_VARS[TRAINER])
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    if key is None:
        print(f"{SCOPE_VARS[TRAINER]}: not set (nor {SCOPE_VARS[TRAINER]}{FILE_SUFFIX})",
              file=sys.stderr)
        return 2
    print(trainer_token(key, argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
